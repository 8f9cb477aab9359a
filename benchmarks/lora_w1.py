"""W1 and lone-request TPOT with LoRA adapters, against the base model in the same run. One command on a lent GPU:

    python benchmarks/lora_w1.py [--shape llama-3.1-8b] [--num-requests 256] [--skip-plain-engine]

The model is the shape's config with random weights (--load-format dummy, bf16, as benchmarks/offline_throughput.py
runs W1), and NUM_ADAPTERS PEFT adapters of rank RANK on all seven projections of every layer, written here with
random weights (pagedserve/testing/tiny_lora.py `write_random_adapter`: what `save_pretrained` writes). One engine with
`--enable-lora --max-loras NUM_ADAPTERS --max-lora-rank RANK --lora-modules ...` runs, each pass after a warm-up pass
over other prompts (Triton's and cuBLAS's one-time costs; other prompts, as prefix caching is on):

- `w1_base`: W1 (256 requests x 512 random prompt tokens x 256 output tokens, greedy, EOS ignored) on the base model;
- `w1_adapters`: the same W1 with request i on adapter i % NUM_ADAPTERS (every step holds all of them);
- `tpot_base` / `tpot_adapter`: the TPOT (median and p90 inter-chunk time) of one request on the idle engine, without
  and with an adapter;

then (unless --skip-plain-engine) an engine without --enable-lora runs `w1_base` and `tpot_base` again: what serving
LoRA costs base requests (the decode graphs then carry the delta kernels, which skip slot -1 rows). Ratios:
adapters over base in the same engine, and the LoRA engine's base over the plain engine's. JSON to
$OUT/lora_w1_<shape>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.model_shapes import SHAPES, write_config_dir  # noqa: E402
from benchmarks.offline_throughput import OUTPUT_LEN, prompts  # noqa: E402
from client import AsyncClient  # noqa: E402
from pagedserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from pagedserve.bench.offline_engine import engine_options  # noqa: E402
from pagedserve.cli import parse_args  # noqa: E402
from pagedserve.testing.tiny_lora import write_random_adapter  # noqa: E402

NUM_ADAPTERS, RANK = 8, 16


def timed_pass(llm: LLM, requests: list[list[int]], adapters: list[str | None]) -> dict:
    """One W1 pass, all requests at once; `adapters[i]`: request i's adapter name (None: the base model)."""
    params = SamplingParams(temperature=0.0, top_p=1.0, ignore_eos=True, max_tokens=OUTPUT_LEN)
    lora = [None if name is None else LoRARequest(name, index + 1) for index, name in enumerate(adapters)]
    start = time.perf_counter()
    results = llm.generate(requests, params, use_tqdm=False, lora_request=lora)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(output.token_ids) for result in results for output in result.outputs)
    return {"elapsed_s": elapsed, "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / elapsed}


async def lone_request_tpot(target: str, prompt: list[int], lora_name: str | None) -> dict:
    """TPOT of one stream on the idle engine: median and p90 of its inter-chunk times, in ms."""
    stamps = []
    async with AsyncClient(target) as client:
        async for _ in client.generate_stream(prompt, max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True,
                                              lora_name=lora_name or ""):
            stamps.append(time.perf_counter())
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    return {"tpot_median_ms": 1e3 * statistics.median(gaps), "tpot_p90_ms": 1e3 * gaps[int(0.9 * len(gaps))]}


def run_engine(shape: str, model_dir: Path, requests: list[list[int]], adapters: dict[str, Path] | None,
               device: str = "cuda") -> dict:
    """W1 (and TPOT) on the base model, then, with `adapters` (served with --enable-lora), with them."""
    args = parse_args(["bench", "throughput", "--model", str(model_dir), "--load-format", "dummy", "--device", device,
                       "--dtype", "bfloat16", "--max-num-seqs", "256", "--max-num-batched-tokens", "16384",
                       "--max-model-len", "1024", "--swap-space", "1", "--ready-timeout", "900"])
    options = engine_options(args)
    if adapters is not None:
        options.update(enable_lora=True, lora_modules={name: str(path) for name, path in adapters.items()},
                       max_loras=len(adapters), max_lora_rank=RANK)
    vocab = SHAPES[shape]["vocab_size"]
    warmup = prompts(len(requests), vocab, seed=1)
    lone = prompts(1, vocab, seed=2)[0]
    base = [None] * len(requests)
    results = {}
    started = time.perf_counter()
    with LLM(str(model_dir), ready_timeout=args.ready_timeout, **options) as llm:
        results["ready_s"] = time.perf_counter() - started
        timed_pass(llm, warmup, base)
        results["w1_base"] = timed_pass(llm, requests, base)
        results["tpot_base"] = asyncio.run(lone_request_tpot(llm.target, lone, None))
        if adapters is not None:
            names = list(adapters)
            spread = [names[index % len(names)] for index in range(len(requests))]
            timed_pass(llm, prompts(len(requests), vocab, seed=3), spread)
            results["w1_adapters"] = timed_pass(llm, prompts(len(requests), vocab, seed=4), spread)
            results["tpot_adapter"] = asyncio.run(lone_request_tpot(llm.target, lone, names[0]))
    print(json.dumps(results), flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--skip-plain-engine", action="store_true", help="no second engine without --enable-lora")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (not a measurement)")
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    work = Path(tempfile.mkdtemp())
    model_dir = write_config_dir(args.shape, work / args.shape)
    # bf16 files (the served dtype); B small, so that the delta stays small beside a layer's random output.
    adapters = {f"lora{index}": write_random_adapter(SHAPES[args.shape], work / f"lora{index}", RANK, seed=index,
                                                     b_scale=0.01, dtype=torch.bfloat16)
                for index in range(NUM_ADAPTERS)}
    requests = prompts(args.num_requests, SHAPES[args.shape]["vocab_size"])
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else args.device
    summary = {"device": device, "shape": args.shape, "num_adapters": NUM_ADAPTERS, "rank": RANK,
               "num_requests": args.num_requests,
               "lora_engine": run_engine(args.shape, model_dir, requests, adapters, args.device)}
    lora = summary["lora_engine"]
    summary["ratios"] = {
        "w1_adapters_over_base": lora["w1_adapters"]["output_tokens_per_s"] / lora["w1_base"]["output_tokens_per_s"],
        "tpot_adapter_over_base": lora["tpot_adapter"]["tpot_median_ms"] / lora["tpot_base"]["tpot_median_ms"],
    }
    if not args.skip_plain_engine:
        plain = summary["plain_engine"] = run_engine(args.shape, model_dir, requests, None, args.device)
        summary["ratios"]["w1_base_lora_engine_over_plain"] = (lora["w1_base"]["output_tokens_per_s"]
                                                               / plain["w1_base"]["output_tokens_per_s"])
        summary["ratios"]["tpot_base_lora_engine_over_plain"] = (lora["tpot_base"]["tpot_median_ms"]
                                                                 / plain["tpot_base"]["tpot_median_ms"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"lora_w1_{args.shape}.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
