"""The model's GEMMs (torch/cuBLAS, bf16) against their floors, for kernel_bench.py's `gemm` section.

Per shape (Qwen2.5-1.5B, Llama-3.1-8B) and projection (QKV, O, gate/up, down, the LM head) at token counts
from a lone decode to a 16k-token prefill step: time per call (CUDA events over back-to-back calls), and the
floor, the larger of FLOPs at the card's measured bf16 matmul rate and bytes moved (activations in and out,
weights read once) at its measured copy bandwidth. `of_floor` = floor / time: how close cuBLAS comes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.model_shapes import SHAPES

TOKEN_COUNTS = (1, 64, 256, 2048, 16384)


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """(in, out) features of each GEMM of a layer, and of the head."""
    s = SHAPES[shape]
    hidden, heads, kv_heads = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"]
    head_dim = s.get("head_dim", hidden // heads)
    return {"qkv": (hidden, (heads + 2 * kv_heads) * head_dim), "o": (heads * head_dim, hidden),
            "gate_up": (hidden, 2 * s["intermediate_size"]), "down": (s["intermediate_size"], hidden),
            "lm_head": (hidden, s["vocab_size"])}


def matmul_rate(time_eager: Callable) -> float:
    """bf16 FLOP/s of an 8192^3 matmul."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / time_eager(lambda: a @ b, iters=20)


def time_in_graph(fn: Callable, time_eager: Callable, calls: int = 20) -> float:
    """Seconds per call of `fn`, from replays of one CUDA graph of `calls` calls (warmed up on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_eager(graph.replay, iters=5) / calls


def bench_gemms(copy_bw: float, time_eager: Callable) -> list[dict]:
    peak = matmul_rate(time_eager)
    rows = []
    for shape in ("qwen2.5-1.5b", "llama-3.1-8b"):
        for name, (k, n) in projections(shape).items():
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for m in TOKEN_COUNTS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                seconds = time_in_graph(lambda: F.linear(x, weight), time_eager)
                flops, moved = 2 * m * n * k, 2 * (m * k + n * k + m * n)
                floor = max(flops / peak, moved / copy_bw)
                rows.append({"shape": shape, "gemm": name, "tokens": m, "us": 1e6 * seconds,
                             "tflop_s": flops / seconds / 1e12, "tb_s": moved / seconds / 1e12,
                             "of_floor": floor / seconds, "bound": "compute" if flops / peak > moved / copy_bw else "memory"})
            del weight, x
    print(f"GEMMs (bf16 matmul peak {peak / 1e12:.0f} TFLOP/s):")
    for row in rows:
        print(f"  {row['shape']:13s} {row['gemm']:8s} M={row['tokens']:6d} {row['us']:9.1f} us  "
              f"{row['tflop_s']:6.1f} TFLOP/s  {row['tb_s']:5.2f} TB/s  {100 * row['of_floor']:5.1f}% of floor "
              f"({row['bound']})", flush=True)
    return [{"matmul_peak_tflop_s": peak / 1e12}, *rows]
