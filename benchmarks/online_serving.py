"""Issue 19's online figures in one command on a lent GPU: `pagedserve bench serve` against our gateway,
against the same engine offline, and the sustainable rate under a goodput SLO.

    python benchmarks/online_serving.py --shape qwen2.5-1.5b [--result-dir DIR]

It serves the shape's random weights (`--load-format dummy`, bf16, the W1 engine flags) with a word tokenizer
of the shape's vocabulary (benchmarks/id_word_tokenizer.py), then:
  1. warms the server up (one small pass), and runs `bench serve` random --input-len/--output-len (EOS
     ignored) at --request-rate inf: the HTTP path's maximum request throughput;
  2. runs `bench throughput` (offline, the same workload and engine flags) for the ratio of the two (the
     HTTP path must not be the bottleneck: target within 15%);
  3. runs `bench serve` at 70% of the maximum rate: TTFT p99 < 300 ms and TPOT p99 < 30 ms are the targets;
  4. sweeps request rates with `--goodput ttft:500 tpot:50` and reports the largest rate at which at least 90%
     of the requests met the SLO (the sustainable rate).
Every `bench serve` JSON and a summary (online_serving_SHAPE.json) land in --result-dir (default $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.id_word_tokenizer import write_id_word_tokenizer  # noqa: E402
from benchmarks.model_shapes import SHAPES, write_config_dir  # noqa: E402
from pagedserve.testing.server_harness import running_server  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINE_FLAGS = ["--load-format", "dummy", "--device", "cuda", "--dtype", "bfloat16", "--max-num-seqs", "256",
                "--max-num-batched-tokens", "16384"]
SLO = ["ttft:500", "tpot:50"]
SUSTAINED = 0.9  # the share of requests that must meet the SLO for a rate to count as sustainable


def bench(*argv: str, timeout: float = 900.0) -> None:
    subprocess.run([sys.executable, "-m", "pagedserve", "bench", *argv], cwd=REPO_ROOT, check=True, timeout=timeout)


def serve_run(url: str, result_dir: Path, name: str, args, rate: float, num_prompts: int, *extra: str) -> dict:
    bench("serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
          "--dataset-name", "random", "--random-input-len", str(args.input_len),
          "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
          "--request-rate", str(rate), "--ignore-eos", "--seed", "0", "--disable-tqdm",
          "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
          "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{name}.json", *extra)
    return json.loads((result_dir / f"{name}.json").read_text())


# Server log lines of a kernel compile after `ready` and of a slow step launch: each stalls every stream of its step.
STALL_MARKS = ("Triton compiles", "slow step launch")


def server_log_lines(server_log: str, marks: tuple[str, ...]) -> list[str]:
    """The messages (timestamp and level cut) of the server log's lines that hold any of `marks`."""
    return [line.split(" WARNING ", 1)[-1].split(" INFO ", 1)[-1] for line in server_log.splitlines()
            if any(mark in line for mark in marks)]


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape and the `bench serve` workload, and where results go (shared with online_gap.py)."""
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--result-dir", default=os.environ.get("OUT", "."))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--goodput-rates", default="0.3,0.5,0.7,0.85,1.0",
                        help="rates of the goodput sweep, as fractions of the maximum request throughput")
    args = parser.parse_args()
    result_dir = Path(args.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {"shape": args.shape, "input_len": args.input_len, "output_len": args.output_len,
                     "num_prompts": args.num_prompts, "engine_flags": ENGINE_FLAGS}
    with tempfile.TemporaryDirectory() as work:
        model_dir = write_config_dir(args.shape, Path(work) / args.shape)
        write_id_word_tokenizer(model_dir, SHAPES[args.shape]["vocab_size"])  # bench serve counts tokens with it
        with running_server(Path(work), str(model_dir), *ENGINE_FLAGS, http=True, ready_timeout=900.0) as server:
            url = server.http_url
            serve_run(url, result_dir, "warmup", args, float("inf"), 256)
            peak = serve_run(url, result_dir, "rate_inf", args, float("inf"), args.num_prompts)
            summary["max_request_throughput"] = peak["request_throughput"]
            summary["max_output_throughput"] = peak["output_throughput"]
            rate70 = round(0.7 * peak["request_throughput"], 2)
            at70 = serve_run(url, result_dir, "rate_70pct", args, rate70, args.num_prompts)
            summary["rate_70pct"] = {"request_rate": rate70, **{key: at70[key] for key in (
                "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms",
                "request_throughput")}}
            sweep = []
            for fraction in (float(f) for f in args.goodput_rates.split(",")):
                rate = round(fraction * peak["request_throughput"], 2)
                record = serve_run(url, result_dir, f"goodput_{fraction}", args, rate, args.num_prompts,
                                   "--goodput", *SLO)
                met = record["request_goodput"] / record["request_throughput"] if record["request_throughput"] else 0
                sweep.append({"request_rate": rate, "request_goodput": record["request_goodput"], "met": met})
            summary["goodput_sweep"] = sweep
            sustainable = [point["request_rate"] for point in sweep if point["met"] >= SUSTAINED]
            summary["sustainable_rate"] = max(sustainable, default=0.0)
        summary["stalls"] = server_log_lines(server.log_path.read_text(errors="replace"), STALL_MARKS)
        bench("throughput", "--model", str(model_dir), *ENGINE_FLAGS, "--input-len", str(args.input_len),
              "--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
              "--output-json", str(result_dir / "offline.json"))
    offline = json.loads((result_dir / "offline.json").read_text())
    summary["offline_requests_per_second"] = offline["requests_per_second"]
    summary["online_over_offline"] = summary["max_request_throughput"] / offline["requests_per_second"]
    (result_dir / f"online_serving_{args.shape}.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
