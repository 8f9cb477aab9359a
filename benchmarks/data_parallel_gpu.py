"""Issue 39's GPU figure in one command on a lent two-GPU machine: `pagedserve serve -dp 2` against `-dp 1`,
same model, same workload, same call.

    python benchmarks/data_parallel_gpu.py --shape qwen2.5-1.5b [--num-prompts 1024] [--result-dir DIR]

Each setting serves the shape's random weights (`--load-format dummy`, bf16, the W1 engine flags of
benchmarks/online_serving.py) with a word tokenizer of the shape's vocabulary, warms up (one pass of 256
requests), then runs `bench serve` random --input-len/--output-len (EOS ignored) at --request-rate inf (the
maximum request throughput) and at 70% of that rate (TTFT and TPOT percentiles at a sustainable load). The
summary (data_parallel_SHAPE.json) holds both settings and the ratio of the maximum request throughputs
(target: -dp 2 >= 1.9x -dp 1), every `bench serve` JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.id_word_tokenizer import write_id_word_tokenizer  # noqa: E402
from benchmarks.model_shapes import SHAPES, write_config_dir  # noqa: E402
from benchmarks.online_serving import ENGINE_FLAGS, add_workload_arguments, bench  # noqa: E402
from pagedserve.testing.server_harness import running_server  # noqa: E402

PERCENTILES = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "request_throughput",
               "output_throughput")


def serve_run(target: str, result_dir: Path, name: str, args, rate: float, num_prompts: int) -> dict:
    """One `bench serve` over our gRPC API (no HTTP gateway: the front routes either way)."""
    bench("serve", "--backend", "grpc", "--base-url", target, "--dataset-name", "random",
          "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
          "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--ignore-eos", "--seed", "0",
          "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
          "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{name}.json")
    return json.loads((result_dir / f"{name}.json").read_text())


def measure(model_dir: Path, work: Path, result_dir: Path, args, data_parallel_size: int) -> dict:
    """Peak and 70%-of-peak figures of one setting."""
    flags = [*ENGINE_FLAGS, "--data-parallel-size", str(data_parallel_size)]
    if args.device != "cuda":
        flags = [*flags[: flags.index("--device")], *flags[flags.index("--device") + 2 :], "--device", args.device,
                 "--dtype", "float32"]
    tag = f"dp{data_parallel_size}"
    with running_server(work, str(model_dir), *flags, ready_timeout=900.0) as server:
        target = f"127.0.0.1:{server.port}"
        serve_run(target, result_dir, f"{tag}_warmup", args, float("inf"), min(256, args.num_prompts))
        peak = serve_run(target, result_dir, f"{tag}_rate_inf", args, float("inf"), args.num_prompts)
        rate = round(0.7 * peak["request_throughput"], 2)
        at70 = serve_run(target, result_dir, f"{tag}_rate_70pct", args, rate, args.num_prompts)
    return {"peak": {key: peak[key] for key in PERCENTILES},
            "rate_70pct": {"request_rate": rate, **{key: at70[key] for key in PERCENTILES}}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (tiny shapes)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="data-parallel sizes to measure")
    args = parser.parse_args()
    result_dir = Path(args.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    import torch

    on_gpu = args.device == "cuda"
    summary: dict = {"device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
                     "gpus": torch.cuda.device_count() if on_gpu else 0,
                     "shape": args.shape, "input_len": args.input_len, "output_len": args.output_len,
                     "num_prompts": args.num_prompts, "engine_flags": ENGINE_FLAGS, "runs": {}}
    with tempfile.TemporaryDirectory() as work:
        model_dir = write_config_dir(args.shape, Path(work) / args.shape)
        write_id_word_tokenizer(model_dir, SHAPES[args.shape]["vocab_size"])
        for size in args.sizes:
            summary["runs"][f"dp{size}"] = measure(model_dir, Path(work), result_dir, args, size)
            print(f"dp{size}", json.dumps(summary["runs"][f"dp{size}"]), flush=True)
    runs = summary["runs"]
    if "dp1" in runs and "dp2" in runs:
        summary["dp2_over_dp1_request_throughput"] = (runs["dp2"]["peak"]["request_throughput"]
                                                      / runs["dp1"]["peak"]["request_throughput"])
    (result_dir / f"data_parallel_{args.shape}.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
