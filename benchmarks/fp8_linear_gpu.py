"""FP8 W8A8 linear layers on a GPU: speed against bf16 F.linear, and the GPU path checked against the CPU
reference math, for the Llama-3.1-8B projections (benchmarks/model_shapes.py).

For each projection (qkv, o, gate_up, down) at M = 1, 16, 256, 4096 rows: time per call of bf16 F.linear and of
the FP8 method's GPU path (Triton per-token quantization + torch._scaled_mm: worker_svc/layers/fp8_linear.py),
each as the mean over replays of one CUDA graph of back-to-back calls; and the FP8 output's relative error
||gpu - ref|| / ||ref|| against kernels/fp8_linear_ref.py run in float32 on the same inputs, weights and scales
(bound: 1e-2; the GPU product is rounded to bf16, the reference is not), plus the exact agreement of the
kernel's float8 activations and scales with the reference's. Also the static-activation path at M = 256.

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
from kernels.fp8_linear_ref import fp8_linear_ref, quantize_per_token, quantize_weight_per_channel
from kernels.triton_fp8_quant import fp8_scaled_mm
from kernels.triton_fp8_quant import quantize_per_token as triton_quantize_per_token
from worker_svc.layers.fp8_linear import has_fp8_tensor_cores

SHAPE = "llama-3.1-8b"
ROWS = (1, 16, 256, 4096)
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
    ref_quantized, ref_scales = quantize_per_token(x)
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


def main() -> int:
    device = torch.device("cuda")
    if not has_fp8_tensor_cores(device):
        print("no FP8 tensor cores (compute capability < 8.9)", file=sys.stderr)
        return 1
    generator = torch.Generator(device="cuda").manual_seed(0)
    results = [check_and_time(name, k, n, rows, generator)
               for name, (k, n) in projections(SHAPE).items() if name != "lm_head" for rows in ROWS]
    results.append(check_static(*projections(SHAPE)["o"], generator))
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": SHAPE,
              "error_bound": ERROR_BOUND, "results": results, "ok": all(row["ok"] for row in results)}
    text = json.dumps(report, indent=2)
    out = os.environ.get("OUT")
    if out:
        Path(out, "fp8_linear_gpu.json").write_text(text)
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
