"""FP8 W8A8 linear layers on a GPU: speed against bf16 F.linear, and the GPU path checked against the CPU
reference math, for the Llama-3.1-8B projections (benchmarks/model_shapes.py).

For each projection (qkv, o, gate_up, down) at M = 1, 16, 256, 4096 rows: time per call of bf16 F.linear and of
fp8_scaled_mm (Triton per-token quantization + torch._scaled_mm: worker_svc/layers/fp8_linear.py's path beyond 16
rows), each as the mean over replays of one CUDA graph of back-to-back calls; and the FP8 output's relative error
||gpu - ref|| / ||ref|| against kernels/fp8_linear_ref.py run in float32 on the same inputs, weights and scales
(bound: 1e-2; the GPU product is rounded to bf16, the reference is not), plus the exact agreement of the
kernel's float8 activations and scales with the reference's run on the CPU (`check_and_time` says why the CPU).
Also the static-activation path at M = 256.

Few rows (decode: M = 1, 4, 16, `few_rows` in the JSON): the split-K Triton GEMM (kernels/triton_fp8_gemm.py,
per-token quantization included, as in fp8_scaled_mm) in each of its CANDIDATE_TILES, against fp8_scaled_mm and
bf16 F.linear. Each graph cycles through enough copies of the weight to read past L2 (a float8 qkv weight is
25 MB, the L2 50 MB: benchmarks/wna16_gemm_gpu.py's copies_past_l2). Per configuration: time, K slices, the weight
bytes (float8 W and its float32 scales) over the time in GB/s, and its relative error against the reference.
`best_tiles` per projection is the configuration with the least time summed over the row counts (one entry per
projection is what a tile table would hold); each row count's own best is in its entry.

Run on an H100/H200 (not in CI): `python -m benchmarks.fp8_linear_gpu`; JSON to $OUT/fp8_linear_gpu.json (or
stdout when OUT is unset). Exits 1 when a check fails.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.gemm_floors import projections, time_in_graph
from benchmarks.kernel_bench import time_eager
from benchmarks.wna16_gemm_gpu import copies_past_l2, seconds_per_call
from kernels.fp8_linear_ref import fp8_linear_ref, quantize_per_token, quantize_weight_per_channel
from kernels.triton_fp8_gemm import BLOCK_M, CANDIDATE_TILES, DEFAULT_TILES, Fp8Tiles, fp8_fewrow_mm, launch_splits
from kernels.triton_fp8_quant import fp8_scaled_mm
from kernels.triton_fp8_quant import quantize_per_token as triton_quantize_per_token
from worker_svc.layers.fp8_linear import has_fp8_tensor_cores

SHAPE = "llama-3.1-8b"
ROWS = (1, 16, 256, 4096)
FEW_ROWS = (1, 4, 16)
ERROR_BOUND = 1e-2


def _time_in_graph(fn: Callable) -> float:
    """Seconds per call of `fn`, from replays of one CUDA graph of 20 calls."""
    return time_in_graph(fn, time_eager)


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def check_and_time(name: str, k: int, n: int, rows: int, generator: torch.Generator) -> dict:
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=generator)
    weight_fp8, weight_scale = quantize_weight_per_channel(weight)
    scale_row = weight_scale.reshape(1, -1).contiguous()
    quantized, scales = triton_quantize_per_token(x)
    # The reference runs on the CPU: on CUDA, torch divides by a Python float (amax / 448 in per_token_scales) as
    # a multiplication by its float32 reciprocal (BinaryDivTrueKernel.cu: "may lose one bit of precision"), so
    # about half the rows' scales were 1 ulp off amax / 448 and, through x / scale, a few float8 values one step
    # off (an H200 run: scales unequal in 13 of 16 cases, activations at 16+ rows; relative error 0.002). The kernel divides IEEE-rounded (div_rn)
    # as CPU torch does; there the two agree bit for bit (tests/triton_kernels/test_triton_fp8_quant.py).
    ref_quantized, ref_scales = (t.to(x.device) for t in quantize_per_token(x.cpu()))
    got = fp8_scaled_mm(x, weight_fp8, scale_row, None, None)
    expected = fp8_linear_ref(x.float(), weight_fp8, weight_scale, None, None)
    row = {
        "projection": name, "k": k, "n": n, "rows": rows,
        "bf16_us": _time_in_graph(lambda: F.linear(x, weight)) * 1e6,
        "fp8_us": _time_in_graph(lambda: fp8_scaled_mm(x, weight_fp8, scale_row, None, None)) * 1e6,
        "quantize_us": _time_in_graph(lambda: triton_quantize_per_token(x)) * 1e6,
        "relative_error": _relative_error(got, expected),
        "activations_equal": bool(torch.equal(quantized.view(torch.uint8), ref_quantized.view(torch.uint8))),
        "scales_equal": bool(torch.equal(scales, ref_scales)),
        "bf16_vs_reference_error": _relative_error(F.linear(x, weight), expected),
    }
    row["speedup"] = row["bf16_us"] / row["fp8_us"]
    row["ok"] = row["relative_error"] < ERROR_BOUND and row["activations_equal"] and row["scales_equal"]
    return row


def check_static(k: int, n: int, generator: torch.Generator) -> dict:
    weight_fp8, weight_scale = quantize_weight_per_channel(
        torch.randn(n, k, device="cuda", generator=generator) * 0.02)
    x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16, generator=generator)
    input_scale = torch.tensor(3.0 / 448, device="cuda")
    got = fp8_scaled_mm(x, weight_fp8, weight_scale.reshape(1, -1).contiguous(), input_scale, None)
    error = _relative_error(got, fp8_linear_ref(x.float(), weight_fp8, weight_scale, input_scale, None))
    return {"projection": "static_input_scale", "k": k, "n": n, "rows": 256, "relative_error": error,
            "ok": error < ERROR_BOUND}


def _weight_bytes(k: int, n: int) -> int:
    """What one FP8 call must read of the layer: the float8 weight and its float32 per-channel scales."""
    return n * k + 4 * n


def _tiles_dict(tiles: Fp8Tiles) -> dict:
    return {"block_m": BLOCK_M, **tiles._asdict()}


def time_few_rows(name: str, k: int, n: int, rows: int, generator: torch.Generator) -> dict:
    """One projection at `rows` rows: bf16, fp8_scaled_mm and the Triton GEMM in each candidate tile configuration,
    each over copies of its weight that read past L2."""
    weight_bytes = _weight_bytes(k, n)
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
             for _ in range(copies_past_l2(2 * n * k))]
    weights = [(w, s.reshape(1, -1).contiguous()) for w, s in (
        quantize_weight_per_channel(torch.randn(n, k, device="cuda", generator=generator) * 0.02)
        for _ in range(copies_past_l2(weight_bytes)))]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=generator)
    bf16_s = seconds_per_call([lambda w=w: F.linear(x, w) for w in dense])
    scaled_mm_s = seconds_per_call([lambda w=w, s=s: fp8_scaled_mm(x, w, s, None, None) for w, s in weights])
    weight_fp8, scale_row = weights[0]
    expected = fp8_linear_ref(x.float(), weight_fp8, scale_row.reshape(-1), None, None)
    configs = []
    for tiles in CANDIDATE_TILES:
        seconds = seconds_per_call([lambda w=w, s=s: fp8_fewrow_mm(x, w, s, None, None, tiles) for w, s in weights])
        got = fp8_fewrow_mm(x, weight_fp8, scale_row, None, None, tiles)
        configs.append({"tiles": _tiles_dict(tiles), "splits": launch_splits(rows, n, k, tiles), "us": seconds * 1e6,
                        "weight_gb_s": weight_bytes / seconds / 1e9, "relative_error": _relative_error(got, expected)})
    del dense, weights
    best = min(configs, key=lambda config: config["us"])
    row = {"projection": name, "k": k, "n": n, "rows": rows, "weight_bytes": weight_bytes,
           "bf16_us": bf16_s * 1e6, "bf16_weight_gb_s": 2 * n * k / bf16_s / 1e9,
           "scaled_mm_us": scaled_mm_s * 1e6, "scaled_mm_weight_gb_s": weight_bytes / scaled_mm_s / 1e9,
           "best": best, "speedup_vs_bf16": bf16_s * 1e6 / best["us"],
           "speedup_vs_scaled_mm": scaled_mm_s * 1e6 / best["us"], "configs": configs}
    row["ok"] = all(config["relative_error"] < ERROR_BOUND for config in configs)
    print(f"{name:8s} M={rows:3d} bf16 {row['bf16_us']:7.1f} us  scaled_mm {row['scaled_mm_us']:7.1f} us  "
          f"triton {best['us']:7.1f} us ({best['weight_gb_s']:5.0f} GB/s, {best['tiles']}, splits {best['splits']})",
          file=sys.stderr, flush=True)
    return row


def best_tiles(few_rows: list[dict]) -> dict[str, dict]:
    """Per projection, the configuration with the least time summed over its row counts, and that time."""
    totals: dict[str, dict[tuple, float]] = {}
    for row in few_rows:
        for config in row["configs"]:
            key = tuple(config["tiles"].items())
            per_projection = totals.setdefault(row["projection"], {})
            per_projection[key] = per_projection.get(key, 0.0) + config["us"]
    return {name: {"tiles": dict(min(times, key=times.get)), "total_us": min(times.values())}
            for name, times in totals.items()}


def main() -> int:
    device = torch.device("cuda")
    if not has_fp8_tensor_cores(device):
        print("no FP8 tensor cores (compute capability < 8.9)", file=sys.stderr)
        return 1
    generator = torch.Generator(device="cuda").manual_seed(0)
    results = [check_and_time(name, k, n, rows, generator)
               for name, (k, n) in projections(SHAPE).items() if name != "lm_head" for rows in ROWS]
    results.append(check_static(*projections(SHAPE)["o"], generator))
    few_rows = [time_few_rows(name, k, n, rows, generator)
                for name, (k, n) in projections(SHAPE).items() if name != "lm_head" for rows in FEW_ROWS]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": SHAPE,
              "error_bound": ERROR_BOUND, "results": results, "few_rows": few_rows,
              "default_tiles": _tiles_dict(DEFAULT_TILES), "best_tiles": best_tiles(few_rows),
              "ok": all(row["ok"] for row in results + few_rows)}
    text = json.dumps(report, indent=2)
    out = os.environ.get("OUT")
    if out:
        Path(out, "fp8_linear_gpu.json").write_text(text)
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
