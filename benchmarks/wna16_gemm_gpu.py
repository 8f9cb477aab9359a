"""The W4A16 Triton GEMM (kernels/triton_wna16_gemm.py) on a GPU: time, bandwidth against the card's copy, and
speed against bf16 torch.matmul, for the Llama-3.1-8B projections (benchmarks/model_shapes.py: qkv 4096x6144,
o 4096x4096, gate_up 4096x28672, down 14336x4096) at M = 1, 2, 4, 8, 16, 64, 256 rows, 4-bit, groups of 128,
symmetric (no zero points).

Per projection and row count:
- `wna16_us`: seconds per call, from replays of one CUDA graph of back-to-back calls (gemm_floors.time_in_graph
  with kernel_bench.time_eager). Each graph cycles through enough copies of the weights to read over
  BYTES_PER_GRAPH (the H100/H200 L2 holds 50 MB; a 4-bit qkv weight is 12.6 MB and would otherwise be served
  from L2).
- `bytes`: what the call must move: packed weights + scales + x + y (`bytes_moved`); `wna16_gb_s` = bytes / time.
- `copy_gb_s`: a torch device copy of a buffer of the same size, timed the same way in the same run (bytes read
  + written / time, as kernel_bench's copy), and `of_copy` = wna16_gb_s / copy_gb_s.
- `bf16_us`: torch.matmul of x by the bf16 weight [K, N] of the same shape (the dense layer this replaces), and
  `speedup` = bf16_us / wna16_us.
- `linear_us`: the layer's own call (kernels/triton_wna16_linear.py: this GEMM up to 16 rows, the dequantized
  weight and cuBLAS beyond), and `linear_speedup` = bf16_us / linear_us;
- `bits_equal_fp32_dequant`: the bf16 dequantization gives the fp32 one's bits (required);
- the launch plan (row tile, K slices) and the relative error ||y - ref|| / ||ref|| against kernels/wna16_ref.py
  on the same inputs in bf16 (bound 1e-2: the same bf16 W, summed by cuBLAS in another order).

Run on an H100/H200 (not in CI): `python -m benchmarks.wna16_gemm_gpu --out wna16_gemm_gpu.json`. Exits 1 when
the check fails. `--sweep` first times every candidate tile configuration (`candidate_tiles`) and K split count
per projection and row count, and reports the fastest of each in the JSON's "sweep" (what ROW_TILES was chosen
by).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks.gemm_floors import projections, time_in_graph
from benchmarks.kernel_bench import time_eager
from kernels.triton_wna16_gemm import Tiles, launch_plan, wna16_gemm
from kernels.triton_wna16_gemv import GEMV_MOST_ROWS, GemvTiles, wna16_gemv
from kernels.triton_wna16_gemv import launch_plan as gemv_launch_plan
from kernels.triton_wna16_linear import wna16_linear
from kernels.wna16_ref import pack_factor, wna16_linear_ref

SHAPE = "llama-3.1-8b"
PROJECTIONS = ("qkv", "o", "gate_up", "down")
ROWS = (1, 2, 4, 8, 16, 64, 256)
BITS, GROUP_SIZE = 4, 128
ACTIVATION_BYTES = 2  # bf16
BYTES_PER_GRAPH = 256 << 20
MAX_COPIES = 32
CALLS_PER_GRAPH = 20
ERROR_BOUND = 1e-2
# The GEMV's (block_n, warps, step_words) the sweep tries.
GEMV_CANDIDATES = ((128, 1, 16), (256, 2, 16), (512, 4, 16), (256, 1, 8), (512, 2, 8), (128, 1, 8))


def bytes_moved(rows: int, k_size: int, n_size: int, bits: int, group_size: int, has_zeros: bool = False,
                activation_bytes: int = ACTIVATION_BYTES) -> int:
    """Bytes one call reads and writes at the least: packed int32 weights, scales (and zeros), x, y."""
    packed = k_size // pack_factor(bits) * n_size * 4
    group_params = (k_size // group_size) * n_size * activation_bytes * (2 if has_zeros else 1)
    return packed + group_params + (rows * k_size + rows * n_size) * activation_bytes


def copies_past_l2(num_bytes: int) -> int:
    """How many distinct copies of a `num_bytes` operand one graph cycles through to read BYTES_PER_GRAPH."""
    return max(1, min(MAX_COPIES, math.ceil(BYTES_PER_GRAPH / num_bytes)))


def seconds_per_call(calls: Sequence[Callable]) -> float:
    """Seconds per call of `calls` (each over its own copy of the operands), run in turn in one CUDA graph."""
    repeats = max(1, CALLS_PER_GRAPH // len(calls))
    return time_in_graph(lambda: [call() for call in calls], time_eager, calls=repeats) / len(calls)


def quantized_weights(k_size: int, n_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed 4-bit weights and bf16 scales in the canonical layout (values do not change the speed)."""
    qweight = torch.randint(-2**31, 2**31, (k_size // pack_factor(BITS), n_size), dtype=torch.int32, device="cuda",
                            generator=generator)
    scales = (torch.rand(k_size // GROUP_SIZE, n_size, device="cuda", generator=generator) * 0.01).bfloat16()
    return qweight, scales


def bench_projection(name: str, k_size: int, n_size: int, rows_list: Sequence[int],
                     generator: torch.Generator) -> list[dict]:
    weight_bytes = bytes_moved(0, k_size, n_size, BITS, GROUP_SIZE)
    weight_sets = [quantized_weights(k_size, n_size, generator) for _ in range(copies_past_l2(weight_bytes))]
    dense = [torch.randn(k_size, n_size, device="cuda", generator=generator, dtype=torch.bfloat16)
             for _ in range(copies_past_l2(k_size * n_size * ACTIVATION_BYTES))]
    results = []
    for rows in rows_list:
        x = torch.randn(rows, k_size, device="cuda", generator=generator, dtype=torch.bfloat16)
        num_bytes = bytes_moved(rows, k_size, n_size, BITS, GROUP_SIZE)
        sources = [torch.empty(num_bytes, dtype=torch.uint8, device="cuda") for _ in range(copies_past_l2(num_bytes))]
        targets = [torch.empty_like(source) for source in sources]
        wna16_s = seconds_per_call([lambda q=q, s=s: wna16_gemm(x, q, s, None, BITS, GROUP_SIZE)
                                    for q, s in weight_sets])
        linear_s = seconds_per_call([lambda q=q, s=s: wna16_linear(x, q, s, None, BITS, GROUP_SIZE)
                                     for q, s in weight_sets])
        copy_s = seconds_per_call([lambda a=a, b=b: b.copy_(a) for a, b in zip(sources, targets)])
        bf16_s = seconds_per_call([lambda w=w: torch.matmul(x, w) for w in dense])
        del sources, targets
        qweight, scales = weight_sets[0]
        got = wna16_gemm(x, qweight, scales, None, BITS, GROUP_SIZE).float()
        expected = wna16_linear_ref(x, qweight, scales, None, BITS, GROUP_SIZE).float()
        fp32_dequant = wna16_gemm(x, qweight, scales, None, BITS, GROUP_SIZE, bf16_dequant=False).float()
        plan = launch_plan(rows, n_size, k_size, GROUP_SIZE)
        row = {"projection": name, "k": k_size, "n": n_size, "rows": rows, "bytes": num_bytes,
               "bits_equal_fp32_dequant": torch.equal(got, fp32_dequant),
               "block_m": plan.tiles.block_m, "block_n": plan.tiles.block_n, "block_k": plan.block_k,
               "splits": plan.splits, "wna16_us": wna16_s * 1e6, "wna16_gb_s": num_bytes / wna16_s / 1e9,
               "copy_gb_s": 2 * num_bytes / copy_s / 1e9, "bf16_us": bf16_s * 1e6,
               "linear_us": linear_s * 1e6, "linear_speedup": bf16_s / linear_s,
               "relative_error": ((got - expected).norm() / expected.norm()).item()}
        row["of_copy"] = row["wna16_gb_s"] / row["copy_gb_s"]
        row["speedup"] = bf16_s / wna16_s
        row["ok"] = row["relative_error"] < ERROR_BOUND and row["bits_equal_fp32_dequant"]
        if rows <= GEMV_MOST_ROWS:
            gemv_s = seconds_per_call([lambda q=q, s=s: wna16_gemv(x, q, s, None, BITS, GROUP_SIZE)
                                       for q, s in weight_sets])
            gemv_error = ((wna16_gemv(x, qweight, scales, None, BITS, GROUP_SIZE).float() - expected).norm()
                          / expected.norm()).item()
            row.update(gemv_us=gemv_s * 1e6, gemv_of_copy=num_bytes / gemv_s / 1e9 / row["copy_gb_s"],
                       gemv_speedup=bf16_s / gemv_s, gemv_relative_error=gemv_error)
            row["ok"] = row["ok"] and gemv_error < ERROR_BOUND
            print(f"{name:8s} M={rows:4d} GEMV {row['gemv_us']:8.1f} us ({row['gemv_of_copy']:4.0%} of copy) "
                  f"x{row['gemv_speedup']:.2f} of bf16  err {gemv_error:.1e}", flush=True)
        print(f"{name:8s} M={rows:4d} splits={plan.splits:2d} {row['wna16_us']:8.1f} us {row['wna16_gb_s']:7.0f} GB/s "
              f"({row['of_copy']:4.0%} of copy {row['copy_gb_s']:5.0f})  bf16 {row['bf16_us']:8.1f} us "
              f"(x{row['speedup']:.2f}) linear x{row['linear_speedup']:.2f}  err {row['relative_error']:.1e}", flush=True)
        results.append(row)
    return results


def candidate_tiles(rows: int) -> list[Tiles]:
    """The tile configurations the sweep tries for `rows` rows: split-K ones for decode's few rows."""
    if rows <= 16:
        return [Tiles(16, n, k, 4, stages, split_k=True, swap_ab=swap)
                for n in (64, 128) for k in (64, 128, 256) for stages in (3, 4) for swap in (False, True)]
    return [Tiles(m, n, k, warps, 3, split_k=False)
            for m in (64, 128) for n in (64, 128) for k in (64, 128) for warps in (4, 8)]


def sweep_projection(name: str, k_size: int, n_size: int, rows_list: Sequence[int],
                     generator: torch.Generator) -> list[dict]:
    """The fastest candidate (tiles, splits) per row count, with every timing."""
    weight_bytes = bytes_moved(0, k_size, n_size, BITS, GROUP_SIZE)
    weight_sets = [quantized_weights(k_size, n_size, generator) for _ in range(copies_past_l2(weight_bytes))]
    best = []
    for rows in rows_list:
        x = torch.randn(rows, k_size, device="cuda", generator=generator, dtype=torch.bfloat16)
        num_bytes = bytes_moved(rows, k_size, n_size, BITS, GROUP_SIZE)
        timings = []
        for tiles in candidate_tiles(rows):
            for splits in ((None, 2, 4, 8, 16) if tiles.split_k else (1,)):
                plan = launch_plan(rows, n_size, k_size, GROUP_SIZE, splits, tiles)
                try:
                    seconds = seconds_per_call([lambda q=q, s=s: wna16_gemm(x, q, s, None, BITS, GROUP_SIZE,
                                                                             splits=plan.splits, tiles=tiles)
                                                for q, s in weight_sets])
                except Exception as error:  # e.g. triton's OutOfResources for a tile too large: skip that one
                    print(f"sweep {name} M={rows} {tiles} splits={plan.splits}: {error!r:.200}", flush=True)
                    break
                timings.append({"tiles": list(tiles), "splits": plan.splits, "us": seconds * 1e6,
                                "gb_s": num_bytes / seconds / 1e9})
        fastest = min(timings, key=lambda timing: timing["us"])
        print(f"sweep {name:8s} M={rows:4d} best {fastest}", flush=True)
        best.append({"projection": name, "rows": rows, "best": fastest, "timings": timings})
    return best


def gemv_sweep_projection(name: str, k_size: int, n_size: int, rows_list: Sequence[int],
                          generator: torch.Generator) -> list[dict]:
    """The fastest GEMV tiles and split count per row count (kernels/triton_wna16_gemv.py), with every timing."""
    weight_bytes = bytes_moved(0, k_size, n_size, BITS, GROUP_SIZE)
    weight_sets = [quantized_weights(k_size, n_size, generator) for _ in range(copies_past_l2(weight_bytes))]
    best = []
    for rows in rows_list:
        x = torch.randn(rows, k_size, device="cuda", generator=generator, dtype=torch.bfloat16)
        num_bytes = bytes_moved(rows, k_size, n_size, BITS, GROUP_SIZE)
        timings = []
        for block_n, warps, step_words in GEMV_CANDIDATES:
            tiles = GemvTiles(block_n, warps, 1024, step_words)
            for splits in (None, 16, 32, 64):
                plan = gemv_launch_plan(rows, n_size, k_size, BITS, GROUP_SIZE, splits, tiles)
                try:
                    seconds = seconds_per_call([lambda q=q, s=s: wna16_gemv(x, q, s, None, BITS, GROUP_SIZE,
                                                                             splits=plan.splits, tiles=tiles)
                                                for q, s in weight_sets])
                except Exception as error:  # e.g. triton's OutOfResources: skip that tile
                    print(f"gemv sweep {name} M={rows} {tiles} splits={splits}: {error!r:.200}", flush=True)
                    break
                timings.append({"block_n": block_n, "warps": warps, "step_words": step_words,
                                "splits": plan.splits, "us": seconds * 1e6, "gb_s": num_bytes / seconds / 1e9})
        fastest = min(timings, key=lambda timing: timing["us"])
        print(f"gemv sweep {name:8s} M={rows:4d} best {fastest}", flush=True)
        best.append({"projection": name, "rows": rows, "best": fastest, "timings": timings})
    return best


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON report")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="row counts (M) to time")
    parser.add_argument("--projections", nargs="+", choices=PROJECTIONS, default=list(PROJECTIONS))
    parser.add_argument("--sweep", type=int, nargs="*", default=None,
                        help="first sweep the tiles at these row counts (none given: 1 16 64 256)")
    parser.add_argument("--gemv-sweep", type=int, nargs="*", default=None,
                        help="sweep the GEMV's tiles at these row counts (none given: 1 2 4)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import triton

    generator = torch.Generator(device="cuda").manual_seed(0)
    shapes = projections(SHAPE)
    sweep = [] if args.sweep is None else [
        best for name in args.projections
        for best in sweep_projection(name, *shapes[name], args.sweep or [1, 16, 64, 256], generator)]
    gemv_sweep = [] if args.gemv_sweep is None else [
        best for name in args.projections
        for best in gemv_sweep_projection(name, *shapes[name], args.gemv_sweep or [1, 2, 4], generator)]
    results = [row for name in args.projections
               for row in bench_projection(name, *shapes[name], args.rows, generator)]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "shape": SHAPE, "bits": BITS, "group_size": GROUP_SIZE, "error_bound": ERROR_BOUND,
              "sweep": sweep, "gemv_sweep": gemv_sweep, "results": results, "ok": all(row["ok"] for row in results)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
