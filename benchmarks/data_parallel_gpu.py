"""Issue 39's GPU figure in one command on a lent two-GPU machine: `pagedserve serve -dp 2` against `-dp 1`,
same model, same workload, same call.

    python benchmarks/data_parallel_gpu.py --shape qwen2.5-1.5b [--num-prompts 1024] [--result-dir DIR]
        [--api-server-count 1 4] [--num-client-processes 4]

The comparison with the front's fix (docs/scale_out.md, "How fast the front relays") in one command:

    python benchmarks/data_parallel_gpu.py --shape qwen2.5-1.5b --num-prompts 1024 --api-server-count 1 4 \
        --num-client-processes 4

Each setting serves the shape's random weights (`--load-format dummy`, bf16, the W1 engine flags of
benchmarks/online_serving.py) with a word tokenizer of the shape's vocabulary, warms up (one pass of 256
requests), then runs `bench serve` random --input-len/--output-len (EOS ignored) at --request-rate inf (the
maximum request throughput) and at 70% of that rate (TTFT and TPOT percentiles at a sustainable load). The
summary (data_parallel_SHAPE.json) holds both settings and the ratio of the maximum request throughputs
(target: -dp 2 >= 1.9x -dp 1), every `bench serve` JSON beside it.

`--api-server-count C [C ...]`: each size above 1 is measured once per C, served with `--api-server-count C`
front processes (runs `dp2_api4` and so on; C = 1 keeps the name `dp2`), each with its ratio over `dp1`.
`--num-client-processes P`: every `bench serve` (-dp 1 too, so the client is the same on both sides) sends
from P processes, each over its own connections: one client process reads about 200 256-token requests a
second per core, and the front's processes share out connections, not requests. `--stream-messages-per-step K`:
the engines' stream pacing (the scheduler's flag) on every run; fewer messages a request cost the front and the
client less (docs/scale_out.md).
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
    bench("serve", "--backend", "grpc", "--base-url", target, "--num-client-processes",
          str(args.num_client_processes), "--dataset-name", "random",
          "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
          "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--ignore-eos", "--seed", "0",
          "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
          "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{name}.json")
    return json.loads((result_dir / f"{name}.json").read_text())


def run_name(data_parallel_size: int, api_server_count: int) -> str:
    return f"dp{data_parallel_size}" + (f"_api{api_server_count}" if api_server_count > 1 else "")


def measure(model_dir: Path, work: Path, result_dir: Path, args, data_parallel_size: int,
            api_server_count: int = 1) -> dict:
    """Peak and 70%-of-peak figures of one setting."""
    flags = [*ENGINE_FLAGS, "--data-parallel-size", str(data_parallel_size)]
    if api_server_count > 1:
        flags += ["--api-server-count", str(api_server_count)]
    if args.stream_messages_per_step is not None:
        flags += ["--stream-messages-per-step", str(args.stream_messages_per_step)]
    if args.device != "cuda":
        flags = [*flags[: flags.index("--device")], *flags[flags.index("--device") + 2 :], "--device", args.device,
                 "--dtype", "float32"]
    tag = run_name(data_parallel_size, api_server_count)
    with running_server(work, str(model_dir), *flags, ready_timeout=900.0) as server:
        target = f"127.0.0.1:{server.port}"
        serve_run(target, result_dir, f"{tag}_warmup", args, float("inf"), min(256, args.num_prompts))
        peak = serve_run(target, result_dir, f"{tag}_rate_inf", args, float("inf"), args.num_prompts)
        rate = round(0.7 * peak["request_throughput"], 2)
        at70 = serve_run(target, result_dir, f"{tag}_rate_70pct", args, rate, args.num_prompts)
    return {"api_server_count": api_server_count, "client_cpu_s": peak.get("client_cpu_s"),
            "peak": {key: peak[key] for key in PERCENTILES},
            "rate_70pct": {"request_rate": rate, **{key: at70[key] for key in PERCENTILES}}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (tiny shapes)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="data-parallel sizes to measure")
    parser.add_argument("--api-server-count", type=int, nargs="+", default=[1],
                        help="front processes: each size above 1 is measured with each of these")
    parser.add_argument("--num-client-processes", type=int, default=1, help="bench serve's client processes")
    parser.add_argument("--stream-messages-per-step", type=int, default=None,
                        help="the engines' stream pacing on every run (default: the scheduler's)")
    args = parser.parse_args()
    if min(args.api_server_count) < 1 or args.num_client_processes < 1:
        parser.error("--api-server-count and --num-client-processes must be at least 1")
    result_dir = Path(args.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    import torch

    on_gpu = args.device == "cuda"
    summary: dict = {"device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
                     "gpus": torch.cuda.device_count() if on_gpu else 0,
                     "shape": args.shape, "input_len": args.input_len, "output_len": args.output_len,
                     "num_prompts": args.num_prompts, "engine_flags": ENGINE_FLAGS,
                     "num_client_processes": args.num_client_processes,
                     "stream_messages_per_step": args.stream_messages_per_step, "runs": {}}
    with tempfile.TemporaryDirectory() as work:
        model_dir = write_config_dir(args.shape, Path(work) / args.shape)
        write_id_word_tokenizer(model_dir, SHAPES[args.shape]["vocab_size"])
        for size in args.sizes:
            for count in (args.api_server_count if size > 1 else [1]):
                name = run_name(size, count)
                summary["runs"][name] = measure(model_dir, Path(work), result_dir, args, size, count)
                print(name, json.dumps(summary["runs"][name]), flush=True)
    runs = summary["runs"]
    for name, run in runs.items():
        if "dp1" in runs and name != "dp1":  # dp2_over_dp1_request_throughput, dp2_api4_over_dp1_...
            summary[f"{name}_over_dp1_request_throughput"] = (run["peak"]["request_throughput"]
                                                              / runs["dp1"]["peak"]["request_throughput"])
    (result_dir / f"data_parallel_{args.shape}.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
