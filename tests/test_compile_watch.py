"""After warm-up, a Triton compile is a warning naming the kernel variant (the warm-up's gap), and the kernel
still compiles."""

from __future__ import annotations

import logging

from triton import knobs

from worker_svc.compile_watch import warn_on_compiles_while_serving


def test_a_compile_after_warm_up_is_a_warning_naming_the_variant(caplog):
    previous = knobs.runtime.jit_cache_hook
    try:
        assert warn_on_compiles_while_serving()
        with caplog.at_level(logging.WARNING, logger="worker_svc.compile_watch"):
            skip = knobs.runtime.jit_cache_hook(repr="_prefill_attention_kernel[num_warps=4](num_seqs: i32)",
                                                key=None, fn=None, compile={}, is_manual_warmup=False,
                                                already_compiled=False)
        assert skip is False
        assert "_prefill_attention_kernel[num_warps=4](num_seqs: i32)" in caplog.text
    finally:
        knobs.runtime.jit_cache_hook = previous
