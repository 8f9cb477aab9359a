"""Sliding-window and soft-capped attention on one GPU: the compiled kernels against the torch reference, what a
window saves, and that a windowed model compiles nothing after warm-up.

  PYTHONPATH=$PWD python benchmarks/window_attention_bench.py

1. Check: the interpreter's window cases (pagedserve/testing/attention_cases.py; keys before each window
   poisoned with NaN, so a kernel reading them fails) compiled for this GPU, fp32 and bf16, single pass and
   split-KV, with and without soft-capping.
2. Decode: bf16, 32 query / 8 KV heads, head_dim 128, block 16, context 32k, window 4096 (Mistral 7B's)
   against full attention, under CUDA graphs: time per call (a windowed decode should cost about W / context).
3. Prefill: 4 x 8192 fresh tokens, window 4096 against full attention.
4. Compiles: a tiny Qwen2 (full layer 0, sliding layers above) on the Triton kernels warmed up as the worker
   does (worker_svc/kernel_warmup.py), then serving steps; the attention kernels' compile caches must not grow.
Writes window_attention_bench.json to $OUT (or ./).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.kernel_bench import (  # noqa: E402
    HEAD_DIM, NUM_Q_HEADS, TOLERANCE, decode_metadata, max_error, prefill_case, time_eager, time_graph,
)
from kernels import paged_attention_ref, triton_decode_attention, triton_prefill_attention  # noqa: E402
from kernels.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedserve.testing import attention_cases  # noqa: E402

CONTEXT, WINDOW, DECODE_BATCHES = 32768, 4096, (1, 8, 64)


def check() -> list[dict]:
    rows = []
    cases = attention_cases.WINDOW_DECODES + attention_cases.WINDOW_PREFILLS
    for dtype in (torch.float32, torch.bfloat16):
        for window in [*attention_cases.WINDOWS, None]:
            for softcap in (None, 0.5):
                for splits in (1, 4, 16):
                    query, kv_cache, metadata = attention_cases.make_case(cases, 4, 128, dtype, 2, device="cuda")
                    scale = 128**-0.5
                    expected = paged_attention_ref.paged_attention(query, kv_cache, metadata, scale, window, softcap)
                    if window is not None:
                        kv_cache = attention_cases.poison_keys_before_windows(kv_cache, metadata, window)
                    output = TritonAttentionBackend(decode_kv_splits=splits).paged_attention(
                        query, kv_cache, metadata, scale, window, softcap
                    )
                    tolerance = TOLERANCE[dtype]
                    ok = bool(torch.allclose(output.float(), expected.float(), atol=tolerance, rtol=tolerance))
                    rows.append({"dtype": str(dtype), "window": window, "softcap": softcap, "splits": splits,
                                 "max_error": max_error(output, expected), "ok": ok})
    failed = [row for row in rows if not row["ok"]]
    print(f"check: {len(rows) - len(failed)}/{len(rows)} ok", *failed, sep="\n", flush=True)
    return rows


def bench_decode() -> list[dict]:
    rows = []
    generator = torch.Generator(device="cuda").manual_seed(0)
    for batch in DECODE_BATCHES:
        pool_blocks = batch * CONTEXT // 16
        kv_cache = torch.randn(2, pool_blocks, 16, 8, HEAD_DIM, device="cuda", generator=generator).bfloat16()
        metadata = decode_metadata(batch, CONTEXT, pool_blocks, generator)
        query = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device="cuda", generator=generator).bfloat16()
        backend = TritonAttentionBackend()
        row = {"batch": batch, "context": CONTEXT, "window": WINDOW}
        for name, window in (("full", None), ("window", WINDOW)):
            call = lambda w=window: backend.paged_attention(query, kv_cache, metadata, HEAD_DIM**-0.5, w)  # noqa: E731
            row[f"{name}_us"] = time_graph(call) * 1e6
        row["window_over_full"] = row["window_us"] / row["full_us"]
        rows.append(row)
        print(f"decode b={batch:3d} ctx={CONTEXT}: full {row['full_us']:.1f} us, window {WINDOW} "
              f"{row['window_us']:.1f} us ({row['window_over_full']:.3f} of full)", flush=True)
        del kv_cache
    return rows


def bench_prefill() -> dict:
    generator = torch.Generator(device="cuda").manual_seed(2)
    query, kv_cache, metadata = prefill_case(4, 8192, 8192, generator)
    backend = TritonAttentionBackend()
    row = {"seqs": 4, "context": 8192, "window": WINDOW}
    for name, window in (("full", None), ("window", WINDOW)):
        row[f"{name}_ms"] = time_eager(
            lambda w=window: backend.paged_attention(query, kv_cache, metadata, HEAD_DIM**-0.5, w)
        ) * 1e3
    print(f"prefill 4 x 8192: full {row['full_ms']:.2f} ms, window {WINDOW} {row['window_ms']:.2f} ms", flush=True)
    return row


def compile_cache_sizes() -> dict[str, int]:
    kernels = {"decode": triton_decode_attention._decode_attention_kernel,
               "merge": triton_decode_attention._merge_kv_splits_kernel,
               "prefill": triton_prefill_attention._prefill_attention_kernel}
    return {name: sum(len(caches[0]) for caches in kernel.device_caches.values()) for name, kernel in kernels.items()}


def check_no_compile_after_warm_up() -> dict:
    from kernels.layer_ops import triton_layer_ops
    from pagedserve.testing.paged_runner import greedy_generate_paged, make_kv_caches
    from pagedserve.testing.tiny_models import QWEN2_SLIDING_WINDOW, make_tiny_model
    from worker_svc.kernel_warmup import warm_up_kernels
    from worker_svc.models.model_loader import load_model

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(tmp, "qwen2", **QWEN2_SLIDING_WINDOW)
        model, config = load_model(path, torch.float32, "cuda", attention_backend=TritonAttentionBackend(),
                                   layer_ops=triton_layer_ops())
    kv_caches = [cache.cuda() for cache in make_kv_caches(config, num_blocks=8, block_size=16)]
    before = compile_cache_sizes()
    warm_up_kernels(model, kv_caches, 16, 8, 16, torch.device("cuda"))
    warmed = compile_cache_sizes()
    prompts = [[3 + i] * length for i, length in enumerate((5, 30, 47, 2, 19, 26, 40, 11))]
    with torch.device("cuda"):
        greedy_generate_paged(model, config, prompts, 6, prefill_chunk=13)
    served = compile_cache_sizes()
    row = {"before": before, "after_warm_up": warmed, "after_serving": served, "ok": served == warmed}
    print(f"compiles: {row}", flush=True)
    return row


def main() -> int:
    results = {"device": torch.cuda.get_device_name()}
    out = Path(os.environ.get("OUT", "."))
    for section, run in (("check", check), ("compiles", check_no_compile_after_warm_up),
                         ("decode", bench_decode), ("prefill", bench_prefill)):
        results[section] = run()
        (out / "window_attention_bench.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results["check"]) and results["compiles"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
