"""`pagedserve bench latency`: the latency of one batch end to end, as vLLM's `vllm bench latency`.

    pagedserve bench latency --model DIR --input-len 32 --output-len 128 --batch-size 8
        [--n 1] [--use-beam-search] [--num-iters-warmup 10] [--num-iters 30] [--output-json result.json]
        [any `pagedserve serve` engine flag]

Each iteration submits the same `--batch-size` prompts of random token ids at once to the offline engine (an
`LLM`: a private `pagedserve serve` process, offline_engine.py says why) and times until the last one
finishes, with vLLM's sampling for this benchmark (temperature 1.0, top_p 1.0, EOS ignored, exactly
`--output-len` tokens; `--use-beam-search`: beam search of width `--n`). As in vLLM the prompts are the same
every iteration, so with prefix caching on (the default) iterations after the first find their full blocks
cached; pass --no-enable-prefix-caching to prefill every time. tqdm bars count the iterations. Printed as
vLLM's: the average latency and its 10/25/50/75/90/99th percentiles (numpy's, linear); `--output-json`
holds {avg_latency, latencies, percentiles}.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from client.sampling_params import SamplingParams
from pagedserve.beam_search import BeamSearchParams
from pagedserve.bench.offline_engine import add_engine_arguments, refuse_below, start_engine
from pagedserve.bench.random_token_requests import random_requests
from pagedserve.llm import LLM

HELP = "latency of one batch end to end on the engine (vLLM's `vllm bench latency`)"
PERCENTILES = (10, 25, 50, 75, 90, 99)


@dataclass(frozen=True)
class LatencyResult:
    """Seconds from submitting the batch to its last request finishing, one per measured iteration."""

    latencies: tuple[float, ...]

    @property
    def avg_latency(self) -> float:
        return float(np.mean(self.latencies))

    @property
    def percentiles(self) -> dict[str, float]:
        return {str(p): float(np.percentile(self.latencies, p)) for p in PERCENTILES}

    def summary(self) -> str:
        lines = [f"Avg latency: {self.avg_latency} seconds"]
        lines += [f"{p}% percentile latency: {value} seconds" for p, value in self.percentiles.items()]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"avg_latency": self.avg_latency, "latencies": list(self.latencies), "percentiles": self.percentiles}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    workload = parser.add_argument_group("workload (vLLM's names)")
    workload.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    workload.add_argument("--output-len", type=int, default=128,
                          help="output tokens per request (EOS ignored: exactly this many)")
    workload.add_argument("--batch-size", type=int, default=8, help="requests submitted at once per iteration")
    workload.add_argument("--n", type=int, default=1, help="sequences per prompt (the beam width with beam search)")
    workload.add_argument("--use-beam-search", action="store_true", help="beam search of width --n")
    workload.add_argument("--num-iters-warmup", type=int, default=10, help="iterations run before measuring")
    workload.add_argument("--num-iters", type=int, default=30, help="iterations measured")
    workload.add_argument("--output-json", default=None, help="write the latencies to this JSON file")
    engine = parser.add_argument_group("engine (`pagedserve serve`'s flags; --seed also seeds the prompts)")
    add_engine_arguments(engine)


def run(args: argparse.Namespace) -> int:
    refuse_below("latency", args, 1, "input_len", "output_len", "batch_size", "n", "num_iters")
    refuse_below("latency", args, 0, "num_iters_warmup")
    with start_engine(args) as llm:
        requests = random_requests(args.batch_size, args.input_len, args.output_len, llm.model_info.vocab_size,
                                   seed=args.seed)
        prompts = [request.prompt_token_ids for request in requests]
        result = measure_latency(llm, prompts, output_len=args.output_len, n=args.n,
                                 use_beam_search=args.use_beam_search, num_iters_warmup=args.num_iters_warmup,
                                 num_iters=args.num_iters)
    print(result.summary(), flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result.to_json(), indent=4))
    return 0


def measure_latency(llm: LLM, prompts: list[list[int]], *, output_len: int, n: int = 1, use_beam_search: bool = False,
                    num_iters_warmup: int = 10, num_iters: int = 30) -> LatencyResult:
    from tqdm.auto import tqdm

    if use_beam_search:
        params = BeamSearchParams(beam_width=n, max_tokens=output_len, ignore_eos=True)

        def one_batch() -> None:
            llm.beam_search(prompts, params)
    else:
        sampling = SamplingParams(n=n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)

        def one_batch() -> None:
            llm.generate(prompts, sampling, use_tqdm=False)

    for _ in tqdm(range(num_iters_warmup), desc="Warmup iterations"):
        one_batch()
    latencies = []
    for _ in tqdm(range(num_iters), desc="Profiling iterations"):
        start = time.perf_counter()
        one_batch()
        latencies.append(time.perf_counter() - start)
    return LatencyResult(tuple(latencies))
