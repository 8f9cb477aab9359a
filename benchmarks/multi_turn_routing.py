"""Issue 39's routing comparison in one command: a multi-turn chat workload (`bench serve --dataset-name
multi-turn`) against `serve -dp 2 --router-policy prefix` and then `--router-policy round-robin`, the same
model, flags and workload (one --seed), each on a fresh server.

    python benchmarks/multi_turn_routing.py [--model DIR] [--tiny] [--result-dir DIR]

What it shows: with prefix routing every turn of a conversation lands on the engine whose prefix cache holds
its history, so the engines compute only each turn's new tokens; round-robin alternates a conversation's
turns over the engines, and each engine recomputes the history it has not seen. Reported per policy (from
each run's `bench serve` JSON): TTFT p50/p99, and the server's prefill tokens computed (prompt tokens minus
prefix-cache hits, from the engines' own counters, per engine). The summary (multi_turn_routing.json) and both
runs' JSON land in --result-dir (default benchmarks/results/data_parallel/), with the machine noted.

--model: default the embedded SmolLM2-135M-Instruct; --tiny serves a small random llama (TINY_SHAPE) with the
embedded tokenizer instead (when the CPU is too busy for the real model: on a shared 2-core machine the
embedded Q4 GGUF model served about 30 tokens a second over both engines, too slow for this workload).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedserve.cli import main as pagedserve_main  # noqa: E402
from pagedserve.testing.server_harness import running_server  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("prefix", "round-robin")
# --tiny: small enough for a busy 2-core machine, large enough that a prompt's prefill costs real time.
TINY_SHAPE = dict(vocab_size=49152, eos_token_id=2, max_position_embeddings=4096, hidden_size=256,
                  intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or name (default: the embedded model)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random llama with the embedded tokenizer")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=384, help="tokens of each conversation's opening")
    parser.add_argument("--input-len", type=int, default=32, help="tokens of each user turn")
    parser.add_argument("--output-len", type=int, default=32, help="max tokens of each answer")
    parser.add_argument("--max-active-conversations", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--result-dir", default=str(REPO_ROOT / "benchmarks" / "results" / "data_parallel"))
    return parser.parse_args(argv)


def run_policy(policy: str, model: str, args, work: Path, result_dir: Path) -> dict:
    name = f"multi_turn_{policy}"
    tokenizer = ["--tokenizer", model] if args.tiny else []  # else the server's (gRPC Tokenize)
    (work / policy).mkdir(parents=True, exist_ok=True)
    with running_server(work / policy, "--model", model, "-dp", "2", "--router-policy", policy,
                        "--max-model-len", str(args.max_model_len), ready_timeout=600) as server:
        code = pagedserve_main([
            "bench", "serve", "--backend", "grpc", "--base-url", server.target, *tokenizer,
            "--dataset-name", "multi-turn", "--multi-turn-num-conversations", str(args.conversations),
            "--multi-turn-num-turns", str(args.turns), "--multi-turn-prefix-len", str(args.prefix_len),
            "--multi-turn-input-len", str(args.input_len), "--multi-turn-output-len", str(args.output_len),
            "--max-active-conversations", str(args.max_active_conversations), "--ignore-eos", "--seed", "0",
            "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--label", name, "--result-dir", str(result_dir), "--result-filename", f"{name}.json"])
        if code != 0:
            raise SystemExit(f"bench serve against --router-policy {policy} failed ({code})")
    return json.loads((result_dir / f"{name}.json").read_text())


def summary(record: dict) -> dict:
    prefill = record["server_prefill"]
    return {"completed": record["completed"], "failed": record["failed"], "duration_s": record["duration"],
            "p50_ttft_ms": record["p50_ttft_ms"], "p99_ttft_ms": record["p99_ttft_ms"],
            "mean_ttft_ms": record["mean_ttft_ms"], "p50_e2el_ms": record["p50_e2el_ms"],
            "prompt_tokens": prefill["prompt_tokens"], "cached_tokens": prefill["cached_tokens"],
            "computed_prefill_tokens": prefill["computed_prefill_tokens"], "per_engine": prefill["per_engine"]}


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "device": "cpu",
            "note": "shared CPU machine (other work ran beside it): compare the two policies, not absolute times"}


def main(argv=None) -> int:
    args = parse_args(argv)
    result_dir = Path(args.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="multi-turn-routing-") as scratch:
        work = Path(scratch)
        model = args.model
        if args.tiny:
            from pagedserve.testing.tiny_models import add_embedded_tokenizer, make_tiny_model

            model = str(add_embedded_tokenizer(make_tiny_model(work / "models", "llama", seed=0, **TINY_SHAPE)))
        elif model is None:
            from service_runtime.model_source import resolve_model

            model = resolve_model(None).path
        runs = {policy: summary(run_policy(policy, model, args, work, result_dir)) for policy in POLICIES}
    prefix, round_robin = runs["prefix"], runs["round-robin"]
    record = {
        "benchmark": "multi-turn chat, -dp 2, prefix vs round-robin routing (benchmarks/multi_turn_routing.py)",
        "model": (f"random llama {TINY_SHAPE} + the embedded tokenizer" if args.tiny
                  else (args.model or "embedded SmolLM2-135M-Instruct")),
        "machine": machine(),
        "workload": {"conversations": args.conversations, "turns": args.turns, "prefix_len": args.prefix_len,
                     "input_len": args.input_len, "output_len": args.output_len,
                     "max_active_conversations": args.max_active_conversations},
        "runs": runs,
        "prefix_vs_round_robin": {
            "ttft_p50_ratio": prefix["p50_ttft_ms"] / round_robin["p50_ttft_ms"],
            "computed_prefill_ratio": (prefix["computed_prefill_tokens"] / round_robin["computed_prefill_tokens"]
                                       if round_robin["computed_prefill_tokens"] else None)},
    }
    path = result_dir / "multi_turn_routing.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({policy: {k: v for k, v in run.items() if k != "per_engine"} for policy, run in runs.items()},
                     indent=2))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
