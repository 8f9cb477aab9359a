"""Time from start to ready, with and without a warm kernel cache, and whether anything compiles after ready
(issue 20 item 3). One command on a lent GPU:

    python benchmarks/cold_start.py --shape qwen2.5-1.5b [--shape llama-3.1-8b] [--engine-flags=...]

Per shape: starts the engine (`pagedserve bench throughput`'s offline engine, random weights of the shape,
W1's limits) with an empty Triton cache (TRITON_CACHE_DIR, a fresh directory: "cold"), times start to
ready, runs W1 twice over different random prompts (the first pass right after ready, the second after it)
and stops; then starts it again on the same cache ("warm", what a restart or the docker image's `models`
volume reuses), times start to ready and one W1 pass. The target: the first W1 pass within 1.2x of the
second. Each worker log line of a kernel compiled while serving (worker_svc/compile_watch.py) and its step
timers are kept. JSON to $OUT/cold_start_<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.model_shapes import SHAPES, write_config_dir  # noqa: E402
from benchmarks.offline_throughput import OUTPUT_LEN, prompts  # noqa: E402
from pagedserve.bench.offline_engine import start_engine  # noqa: E402
from pagedserve.bench.random_token_requests import BenchRequest  # noqa: E402
from pagedserve.bench.throughput import measure_throughput  # noqa: E402
from pagedserve.cli import parse_args  # noqa: E402

NUM_REQUESTS = 256


def start_and_run(model_dir: Path, cache_dir: Path, passes: int, extra: list[str]) -> dict:
    """Starts the engine on `cache_dir`, times start to ready, runs `passes` W1 passes (different prompts
    each), returns their figures and the server log's compile warnings and step timers."""
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir)  # inherited by the engine's processes
    args = parse_args(["bench", "throughput", "--model", str(model_dir), "--load-format", "dummy", "--device", "cuda",
                       "--dtype", "bfloat16", "--max-num-seqs", "256", "--max-num-batched-tokens", "16384",
                       "--max-model-len", "1024", "--swap-space", "1", "--ready-timeout", "900", *extra])
    vocab = SHAPES[model_dir.name]["vocab_size"]
    started = time.perf_counter()
    llm = start_engine(args)
    ready_s = time.perf_counter() - started
    with open(llm.log_path, errors="replace") as log, llm:
        runs = []
        for seed in range(passes):
            requests = [BenchRequest(p, OUTPUT_LEN) for p in prompts(NUM_REQUESTS, vocab, seed=10 + seed)]
            run = measure_throughput(llm, requests, temperature=0.0)
            runs.append({"elapsed_s": run.elapsed_time, "output_tokens_per_s": run.output_tokens_per_second})
            print(f"  pass {seed + 1}: {run.elapsed_time:.2f} s, {run.output_tokens_per_second:,.0f} tok/s", flush=True)
        llm.shutdown()
        server_log = log.read()
    notes = [line.split(" INFO ", 1)[-1].split(" WARNING ", 1)[-1] for line in server_log.splitlines()
             if "while serving" in line or "step time over" in line or "slow step launch" in line or "warmed up" in line]
    return {"ready_s": ready_s, "passes": runs, "log": notes}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES))
    parser.add_argument("--engine-flags", default="", help="extra `pagedserve serve` flags")
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    work = Path(tempfile.mkdtemp())
    for shape in args.shape or ["qwen2.5-1.5b"]:
        model_dir = write_config_dir(shape, work / shape)
        cache_dir = work / f"triton-cache-{shape}"
        print(shape, "cold", flush=True)
        cold = start_and_run(model_dir, cache_dir, 2, args.engine_flags.split())
        print(f"  ready in {cold['ready_s']:.1f} s", flush=True)
        print(shape, "warm", flush=True)
        warm = start_and_run(model_dir, cache_dir, 1, args.engine_flags.split())
        print(f"  ready in {warm['ready_s']:.1f} s", flush=True)
        first, second = (p["elapsed_s"] for p in cold["passes"])
        summary = {"device": torch.cuda.get_device_name(0), "shape": shape, "cold": cold, "warm": warm,
                   "first_over_second_pass": first / second,
                   "warm_first_over_cold_second_pass": warm["passes"][0]["elapsed_s"] / second}
        (out_dir / f"cold_start_{shape}.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps({k: v for k, v in summary.items() if k not in ("cold", "warm")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
