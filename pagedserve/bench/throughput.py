"""`pagedserve bench throughput`: offline throughput, as vLLM's `vllm bench throughput`.

    pagedserve bench throughput --model DIR --input-len 512 --output-len 256 --num-prompts 256
        [--n 1] [--num-iters-warmup 1] [--output-json result.json] [any `pagedserve serve` engine flag]

Every request is submitted at once to the offline engine (an `LLM`: a private `pagedserve serve` process
on a loopback port, the same code that serves online; offline_engine.py says why), with vLLM's sampling
for this benchmark (temperature 1.0, top_p 1.0, EOS ignored, exactly `--output-len` tokens). A tqdm bar
shows finished prompts and token speeds. Printed as vLLM's: "Throughput: X requests/s, Y total tokens/s,
Z output tokens/s"; `--output-json` holds vLLM's keys (elapsed_time, num_requests, total_num_tokens,
requests_per_second, tokens_per_second) and ours (the prompt and output token totals, output tokens/s).

`--num-iters-warmup N` (not in vLLM's throughput, which has none) first runs N passes of the same shape over
other random prompts: they pay one-time costs (kernel compilation, CUDA graph capture) outside the measured
pass. Other prompts, because prefix caching is on: the same ones again would skip nearly all of the prefill.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from client.sampling_params import SamplingParams
from client.types import GenerationResult
from pagedserve.bench.offline_engine import add_engine_arguments, refuse_below, start_engine
from pagedserve.bench.random_token_requests import BenchRequest, random_requests
from pagedserve.llm import LLM

HELP = "offline throughput of the engine (vLLM's `vllm bench throughput`)"


@dataclass(frozen=True)
class ThroughputResult:
    """One measured pass: its wall time and the tokens of its finished requests, counted from the results
    (prompt tokens once per request, output tokens over all n outputs), as vLLM counts them."""

    elapsed_time: float
    num_requests: int
    total_prompt_tokens: int
    total_output_tokens: int

    @property
    def total_num_tokens(self) -> int:
        return self.total_prompt_tokens + self.total_output_tokens

    @property
    def requests_per_second(self) -> float:
        return self.num_requests / self.elapsed_time

    @property
    def tokens_per_second(self) -> float:
        return self.total_num_tokens / self.elapsed_time

    @property
    def output_tokens_per_second(self) -> float:
        return self.total_output_tokens / self.elapsed_time

    def summary(self) -> str:
        return (f"Throughput: {self.requests_per_second:.2f} requests/s, {self.tokens_per_second:.2f} total "
                f"tokens/s, {self.output_tokens_per_second:.2f} output tokens/s\n"
                f"Total num prompt tokens:  {self.total_prompt_tokens}\n"
                f"Total num output tokens:  {self.total_output_tokens}")

    def to_json(self) -> dict:
        return {"elapsed_time": self.elapsed_time, "num_requests": self.num_requests,
                "total_num_tokens": self.total_num_tokens, "requests_per_second": self.requests_per_second,
                "tokens_per_second": self.tokens_per_second, "total_prompt_tokens": self.total_prompt_tokens,
                "total_output_tokens": self.total_output_tokens,
                "output_tokens_per_second": self.output_tokens_per_second}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    workload = parser.add_argument_group("workload (vLLM's names)")
    workload.add_argument("--dataset-name", choices=("random",), default="random",
                          help="random: prompts of random token ids (the online `bench serve` has the others)")
    workload.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=1024,
                          help="prompt tokens per request")
    workload.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128,
                          help="output tokens per request (EOS ignored: exactly this many)")
    workload.add_argument("--random-range-ratio", type=float, default=0.0,
                          help="lengths drawn uniformly from [len * (1 - r), len * (1 + r)]")
    workload.add_argument("--num-prompts", type=int, default=1000, help="requests, all submitted at once")
    workload.add_argument("--n", type=int, default=1, help="sequences generated per prompt")
    workload.add_argument("--num-iters-warmup", type=int, default=0,
                          help="unmeasured passes over other random prompts first (one-time costs)")
    workload.add_argument("--output-json", default=None, help="write the results to this JSON file")
    workload.add_argument("--disable-detokenize", action="store_true",
                          help="refused: the server detokenizes whenever the model has a tokenizer (a "
                               "--load-format dummy directory without one is never detokenized)")
    engine = parser.add_argument_group("engine (`pagedserve serve`'s flags; --seed also seeds the prompts)")
    add_engine_arguments(engine)


def run(args: argparse.Namespace) -> int:
    if args.disable_detokenize:
        raise SystemExit("pagedserve bench throughput: --disable-detokenize: not supported: the server detokenizes "
                         "whenever the model has a tokenizer")
    refuse_below("throughput", args, 1, "num_prompts", "input_len", "output_len", "n")
    refuse_below("throughput", args, 0, "num_iters_warmup")
    with start_engine(args) as llm:
        vocab_size = llm.model_info.vocab_size
        warmups = [random_requests(args.num_prompts, args.input_len, args.output_len, vocab_size,
                                   seed=args.seed + 1 + i, range_ratio=args.random_range_ratio)
                   for i in range(args.num_iters_warmup)]
        requests = random_requests(args.num_prompts, args.input_len, args.output_len, vocab_size, seed=args.seed,
                                   range_ratio=args.random_range_ratio)
        result = measure_throughput(llm, requests, n=args.n, warmups=warmups)
    print(result.summary(), flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result.to_json(), indent=4))
    return 0


def measure_throughput(llm: LLM, requests: list[BenchRequest], *, n: int = 1, temperature: float = 1.0,
                       warmups: list[list[BenchRequest]] = (), use_tqdm: bool = True) -> ThroughputResult:
    """Runs each warm-up pass, then `requests`, each pass all at once; the measured pass's result."""
    for warmup in warmups:
        llm.generate(*_prompts_and_params(warmup, n, temperature), use_tqdm=use_tqdm)
    prompts, params = _prompts_and_params(requests, n, temperature)
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    return ThroughputResult(elapsed_time=elapsed, num_requests=len(results),
                            total_prompt_tokens=sum(_prompt_tokens(result) for result in results),
                            total_output_tokens=sum(_output_tokens(result) for result in results))


def _prompts_and_params(requests: list[BenchRequest], n: int, temperature: float):
    params = [SamplingParams(n=n, temperature=temperature, top_p=1.0, ignore_eos=True, max_tokens=request.output_len)
              for request in requests]
    return [request.prompt_token_ids for request in requests], params


def _prompt_tokens(result: GenerationResult) -> int:
    return result.prompt_tokens if result.prompt_tokens is not None else len(result.prompt_token_ids or ())


def _output_tokens(result: GenerationResult) -> int:
    return sum(output.completion_tokens if output.completion_tokens is not None else len(output.token_ids)
               for output in result.outputs)

