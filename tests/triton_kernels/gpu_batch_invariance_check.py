"""The batch-invariance checks on a real GPU at model-sized shapes (not collected by pytest; needs CUDA).

Why a GPU run on top of the interpreter tests: the interpreter computes `tl.dot` with numpy and has no
tensor cores, no MMA layouts and no FMA contraction, which are where a GPU kernel can make a row's bits
depend on its position in a tile or on the code path it went through. Run on a GPU machine, from the repo
root, with TRITON_INTERPRET unset:

    python -m tests.triton_kernels.gpu_batch_invariance_check

It prints one line per check and exits 1 if a batch-invariant op failed. `--smoke` runs the same checks at
tiny shapes on the CPU (TRITON_INTERPRET=1), to see that the script itself works. The torch / non-invariant
counterparts (F.linear on cuBLAS, the split-KV Triton backend) are run through the same checks for
information: they are expected to differ, which shows the checks can tell.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.batch_invariant_layer_ops import batch_invariant_triton_layer_ops
from kernels.triton_backend import TritonAttentionBackend
from kernels.triton_batch_invariant_attention import SEGMENT, BatchInvariantTritonBackend, segments_agree
from kernels.triton_batch_invariant_norm import log_softmax
from tests.triton_kernels.batch_invariance_cases import (
    PagedPool,
    assert_rows_batch_invariant,
    others_of_random_lengths,
    random_tensor,
    ways_of_serving_one_sequence,
)

# (device, batch sizes, hidden, MoE intermediate, vocabulary, sequence, longest other, KV heads, head dim)
GPU_SHAPES = ("cuda", (1, 3, 64, 257, 2048), 4096, 512, 151936, 700, 900, 8, 128)
SMOKE_SHAPES = ("cpu", (1, 3, 64), 64, 24, 2500, 70, 90, 2, 64)
# Attention's KV segment (keys): the served one on the GPU (the 700-token sequence spans 3); 64 for the smoke
# run's 70 tokens (2 segments; a multiple of the 64-key bf16 tile).
GPU_SEGMENT, SMOKE_SEGMENT = SEGMENT, 64


def rows_invariant(fn, full, batch_sizes) -> str:
    try:
        assert_rows_batch_invariant(fn, full, batch_sizes)
        return "invariant"
    except AssertionError as error:
        return f"NOT invariant ({error})"


def serving_invariant(backend, options, shapes, group_size=4, num_kv_heads=None) -> str:
    """The sequence served every way of `ways_of_serving_one_sequence`; with the shapes' KV heads x 4 query
    heads each unless told (Qwen2.5-1.5B: 2 x 6)."""
    device, _, _, _, _, seq_len, longest, shape_kv_heads, head_dim = shapes
    pool = PagedPool({"ours": seq_len, **others_of_random_lengths(7, longest=longest)}, group_size, torch.bfloat16,
                     seed=3, num_kv_heads=num_kv_heads or shape_kv_heads, head_dim=head_dim, device=device)
    ways = ways_of_serving_one_sequence(pool, backend, options)
    differing = [way for way, output in ways.items() if not torch.equal(output, ways["whole prefill"])]
    return "invariant" if not differing else f"NOT invariant ({', '.join(differing)} differ from the whole prefill)"


def checks(shapes, segment: int) -> dict[str, tuple[bool, Callable[[], str]]]:
    """Each check by name: whether it must hold (False: a non-invariant counterpart, run for information), and
    the check, which returns "invariant" or what differed. Shared with tests/gpu/test_batch_invariance_gpu.py."""
    device, batch_sizes, hidden_size, inter, vocab_size, _, _, _, _ = shapes
    rows = batch_sizes[-1]
    ops = batch_invariant_triton_layer_ops(device)
    dtype = torch.bfloat16
    weight = random_tensor((hidden_size, hidden_size), dtype, 1, device) * 0.02
    hidden = random_tensor((rows, hidden_size), dtype, 2, device)
    norm_weight = random_tensor((hidden_size,), dtype, 3, device)
    w13 = random_tensor((8, 2 * inter, hidden_size // 4), dtype, 4, device) * 0.05
    w2 = random_tensor((8, hidden_size // 4, inter), dtype, 5, device) * 0.05

    def moe(x):
        return ops.fused_moe(x[:, : hidden_size // 4].contiguous(), x[:, hidden_size // 4:].contiguous(), w13, w2,
                             2, True, False)

    named = {
        "linear (batch-invariant)": (True, lambda: rows_invariant(
            lambda x: ops.linear(x, weight, None), hidden, batch_sizes)),
        "F.linear (for information)": (False, lambda: rows_invariant(
            lambda x: F.linear(x, weight), hidden, batch_sizes)),
        "rms_norm + residual": (True, lambda: rows_invariant(
            lambda x: torch.stack(ops.rms_norm(x[:, 0], norm_weight, 1e-6, x[:, 1]), dim=1),
            random_tensor((rows, 2, hidden_size), dtype, 7, device), batch_sizes)),
        "log_softmax": (True, lambda: rows_invariant(
            log_softmax, random_tensor((rows, vocab_size), torch.float32, 8, device) * 4, batch_sizes)),
        "fused_moe (fixed tile)": (True, lambda: rows_invariant(
            moe, random_tensor((rows, hidden_size // 4 + 8), dtype, 6, device), batch_sizes)),
    }
    for name, options in {"plain": {}, "window 256": {"sliding_window": 256},
                          "softcap 50": {"logit_softcap": 50.0}}.items():
        named[f"attention, {name}"] = (True, lambda options=options: serving_invariant(
            BatchInvariantTritonBackend(segment=segment), options, shapes))
    # Decodes forced through each way: (b) segments in programs of their own + merge kernel, (a) one program
    # per decode merging in registers; both against the prefill variant's whole prefill. Qwen2.5-1.5B's heads.
    for way, split in (("(b) split", True), ("(a) in registers", False)):
        for name, options in {"plain": {}, "window 256": {"sliding_window": 256}}.items():
            named[f"attention, decodes {way}, 2 x 6 heads, {name}"] = (
                True, lambda split=split, options=options: serving_invariant(
                    BatchInvariantTritonBackend(segment=segment, split_decodes=split), options, shapes,
                    group_size=6, num_kv_heads=2))
    if device != "cpu":  # the start-up check, at the served shapes (too slow for the interpreter)
        named["segments_agree (split decodes = in-register merge)"] = (
            True, lambda: "invariant" if segments_agree(device) else "NOT invariant (the two ways differ)")
    named["TritonAttentionBackend (for information)"] = (
        False, lambda: serving_invariant(TritonAttentionBackend(), {}, shapes))
    return named


def main(argv: list[str]) -> int:
    smoke = "--smoke" in argv
    failed = False
    for name, (required, check) in checks(SMOKE_SHAPES if smoke else GPU_SHAPES,
                                          SMOKE_SEGMENT if smoke else GPU_SEGMENT).items():
        result = check()
        failed |= required and result != "invariant"
        print(f"{name}: {result}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
