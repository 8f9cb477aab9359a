"""Issue 21's GPU measurement: how many distinct completions one request gets while other traffic changes the
batch around it, with and without `--batch-invariant`. One command on a lent GPU:

    python benchmarks/batch_invariance_gpu.py --shape qwen2.5-1.5b [--num-targets 1000] [--num-others 1000]

Per mode (the default kernels, then `--batch-invariant`), one server with random weights (bf16) receives, in
Poisson arrival order at --request-rate, --num-targets copies of one target request interleaved with
--num-others requests of random prompt and output lengths (temperature 1, random seeds). Half the copies are
greedy and half are seeded at temperature 1 (one fixed seed): either kind should give one completion every
time. Each copy asks for its tokens' logprobs, and a completion is its token ids *and* those logprobs, so
"distinct" counts bit differences a token-level comparison would miss. The copies see every situation the
mode covers: batches of any size and mix, the prompt computed whole or from the prefix cache, chunked when a
long other request shares its step (--max-num-batched-tokens is small enough for that), and preemption
when the others fill the KV pool. The prompts are random token ids: with random weights, text carries no
meaning, and the numerics are the same. Writes $OUT/batch_invariance_<shape>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.model_shapes import SHAPES, write_config_dir  # noqa: E402
from client import AsyncClient  # noqa: E402
from pagedserve.bench.offline_engine import start_engine  # noqa: E402
from pagedserve.cli import parse_args  # noqa: E402

TARGET_PROMPT_LEN, TARGET_OUTPUT_LEN, TARGET_SEED = 300, 64, 1234


def workload(num_targets: int, num_others: int, vocab: int, seed: int) -> list[dict]:
    """The requests in arrival order: target copies (greedy and seeded alternately) among random others."""
    rng = random.Random(seed)
    target_prompt = [rng.randrange(vocab) for _ in range(TARGET_PROMPT_LEN)]
    targets = [{"kind": "greedy" if i % 2 == 0 else "seeded", "prompt": target_prompt,
                "params": {"max_tokens": TARGET_OUTPUT_LEN, "ignore_eos": True, "logprobs": 0,
                           **({"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": TARGET_SEED})}}
               for i in range(num_targets)]
    others = [{"kind": "other", "prompt": [rng.randrange(vocab) for _ in range(rng.randint(16, 1500))],
               "params": {"max_tokens": rng.randint(8, 256), "ignore_eos": True, "temperature": 1.0,
                          "seed": rng.randrange(2**31)}}
              for _ in range(num_others)]
    requests = targets + others
    rng.shuffle(requests)
    return requests


async def drive(target: str, requests: list[dict], rate: float, seed: int) -> dict:
    """Sends `requests` at Poisson arrivals of `rate` per second; the distinct target completions per kind."""
    rng = random.Random(seed)
    completions: dict[str, list] = {"greedy": [], "seeded": []}
    failed = 0

    async def one(client: AsyncClient, request: dict) -> None:
        nonlocal failed
        try:
            result = await client.generate(request["prompt"], **request["params"])
        except Exception:  # noqa: BLE001 - counted, the run goes on
            failed += 1
            return
        if request["kind"] != "other":
            out = result.outputs[0]
            completions[request["kind"]].append((out.token_ids, tuple(t.token.logprob for t in out.token_logprobs)))

    start = time.perf_counter()
    async with AsyncClient(target) as client:
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(one(client, request)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        stats = await client.stats()
    summary = {"elapsed_s": time.perf_counter() - start, "failed": failed, "preemptions": stats.num_preemptions,
               "prefix_cache_hit_rate": stats.prefix_cache_hit_rate}
    for kind, outs in completions.items():
        summary[kind] = {"copies": len(outs), "distinct_completions": len(set(outs)),
                         "distinct_token_sequences": len({tokens for tokens, _ in outs})}
    return summary


def run_mode(model_dir: Path, device: str, flags: list[str], requests: list[dict], rate: float, seed: int) -> dict:
    args = parse_args(["bench", "throughput", "--model", str(model_dir), "--load-format", "dummy", "--device", device,
                       "--dtype", "bfloat16", "--max-num-seqs", "256", "--max-num-batched-tokens", "2048",
                       "--max-model-len", "2048", "--ready-timeout", "900", *flags])
    with start_engine(args) as llm:
        return asyncio.run(drive(llm.target, requests, rate, seed))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--num-targets", type=int, default=1000)
    parser.add_argument("--num-others", type=int, default=1000)
    parser.add_argument("--request-rate", type=float, default=150.0)
    parser.add_argument("--modes", default="default,batch-invariant")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers than the shape's (smoke runs)")
    args = parser.parse_args()
    model_dir = write_config_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    if args.num_layers is not None:
        config = json.loads((model_dir / "config.json").read_text())
        config["num_hidden_layers"] = args.num_layers
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][: args.num_layers]
        (model_dir / "config.json").write_text(json.dumps(config))
    requests = workload(args.num_targets, args.num_others, SHAPES[args.shape]["vocab_size"], args.seed)
    summary = {"shape": args.shape, "device": args.device, "num_layers": args.num_layers, "num_targets": args.num_targets, "num_others": args.num_others,
               "request_rate": args.request_rate, "modes": {}}
    for mode in args.modes.split(","):
        flags = ["--batch-invariant"] if mode == "batch-invariant" else []
        summary["modes"][mode] = run_mode(model_dir, args.device, flags, requests, args.request_rate, args.seed)
        print(mode, json.dumps(summary["modes"][mode]), flush=True)
    out = Path(os.environ.get("OUT", ".")) / f"batch_invariance_{args.shape}.json"
    out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
