"""The workloads `bench serve` sends: vLLM's random and prefix_repetition datasets, ShareGPT from a local file,
and sharegpt-like, ShareGPT's shape without a download.

Who owns what: a dataset builds a list of SampleRequest before the benchmark starts (all tokenizer work is
done then, none while requests are timed). Prompts are text when a text tokenizer is known (built from
word_list.WORDS and cut at a token boundary) and token ids otherwise (random ids below the vocab size).

sharegpt-like lengths: log-normal, with the means the vLLM paper reports for ShareGPT (Kwon et al.,
"Efficient Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023, Fig. 11:
mean input 161.31 tokens, mean output 337.99 tokens). The paper gives no spread; sigma 1.0 (ours) gives a
long tail like the paper's histograms. Draws are clipped as vLLM filters ShareGPT: at least 4 tokens each,
input at most 1024 and input + output at most 2048.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedserve.bench.prompt_tokenizer import PromptTokens
from pagedserve.bench.word_list import WORDS

SHAREGPT_MEAN_INPUT_LEN = 161.31
SHAREGPT_MEAN_OUTPUT_LEN = 337.99
SHAREGPT_LOG_SIGMA = 1.0
MIN_LEN, MAX_INPUT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
DATASET_NAMES = ("random", "sharegpt", "sharegpt-like", "prefix_repetition", "prefix-repetition", "multi-turn")


@dataclass(frozen=True)
class SampleRequest:
    """One request of the workload: `prompt` (text, or token ids for a model without tokenizer), `prompt_len`
    its length in tokens, `expected_output_len` the max_tokens it asks for."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset-name", default="random", choices=DATASET_NAMES,
                        help="random: random prompts of --random-input-len; sharegpt-like: ShareGPT's lengths "
                             "(built in, or --dataset-path FILE); sharegpt: --dataset-path FILE; "
                             "prefix_repetition: shared prefixes with random suffixes; multi-turn: conversations "
                             "whose turns grow one history (multi_turn.py, the --multi-turn-* flags)")
    parser.add_argument("--dataset-path", default=None, help="a local ShareGPT JSON file (ShareGPT_V3 format)")
    parser.add_argument("--num-prompts", type=int, default=1000, help="number of requests")
    parser.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (random dataset)")
    parser.add_argument("--random-output-len", type=int, default=128, help="max tokens (random dataset)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths drawn uniformly from [len * (1 - r), len * (1 + r)], 0 <= r < 1")
    parser.add_argument("--sharegpt-output-len", type=int, default=None,
                        help="max tokens of every sharegpt request (default: the answer's length)")
    parser.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="tokens of each prefix")
    parser.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="random tokens after it")
    parser.add_argument("--prefix-repetition-num-prefixes", type=int, default=10, help="distinct prefixes")
    parser.add_argument("--prefix-repetition-output-len", type=int, default=128, help="max tokens")


class PromptBuilder:
    """Random prompts of exact token lengths from a seeded generator."""

    def __init__(self, tokens: PromptTokens, rng: np.random.Generator) -> None:
        self._tokens = tokens
        self._rng = rng

    def token_ids(self, length: int) -> list[int]:
        if self._tokens.tokenizer is None:
            return [int(i) for i in self._rng.integers(0, self._tokens.vocab_size, size=length)]
        words = max(length, 1)
        while True:
            text = " ".join(self._rng.choice(WORDS, size=words))
            ids = self._tokens.tokenizer.encode(text)
            if len(ids) >= length:
                return ids[:length]
            words *= 2

    def prompt(self, token_ids: list[int]) -> str | list[int]:
        return token_ids if self._tokens.tokenizer is None else self._tokens.tokenizer.decode(token_ids)


def sample_requests(args: argparse.Namespace, tokens: PromptTokens) -> list[SampleRequest]:
    """The workload the flags describe, reproducible for one --seed."""
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    rng = np.random.default_rng(args.seed)
    builder = PromptBuilder(tokens, rng)
    if args.dataset_name == "random":
        return _random(args, builder, rng)
    if args.dataset_name in ("prefix_repetition", "prefix-repetition"):
        return _prefix_repetition(args, builder, rng)
    if args.dataset_path is not None:
        return _sharegpt_file(args, tokens, rng)
    if args.dataset_name == "sharegpt":
        raise ValueError("--dataset-name sharegpt reads --dataset-path FILE (or use sharegpt-like, built in)")
    return _sharegpt_like(args, builder, rng)


def uniform_lengths(length: int, range_ratio: float, count: int, rng: np.random.Generator) -> list[int]:
    """vLLM's random lengths: integers uniform in [floor(len * (1 - r)), ceil(len * (1 + r))]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low, high = math.floor(length * (1 - range_ratio)), math.ceil(length * (1 + range_ratio))
    return [int(n) for n in rng.integers(max(low, 1), max(high, 1) + 1, size=count)]


def _random(args, builder: PromptBuilder, rng) -> list[SampleRequest]:
    input_lens = uniform_lengths(args.random_input_len, args.random_range_ratio, args.num_prompts, rng)
    output_lens = uniform_lengths(args.random_output_len, args.random_range_ratio, args.num_prompts, rng)
    return [SampleRequest(builder.prompt(builder.token_ids(n)), n, m) for n, m in zip(input_lens, output_lens)]


def _prefix_repetition(args, builder: PromptBuilder, rng) -> list[SampleRequest]:
    if args.prefix_repetition_num_prefixes < 1:
        raise ValueError("--prefix-repetition-num-prefixes must be at least 1")
    prefixes = [builder.token_ids(args.prefix_repetition_prefix_len)
                for _ in range(args.prefix_repetition_num_prefixes)]
    requests = []
    for index in range(args.num_prompts):
        ids = prefixes[index % len(prefixes)] + builder.token_ids(args.prefix_repetition_suffix_len)
        requests.append(SampleRequest(builder.prompt(ids), len(ids), args.prefix_repetition_output_len))
    return [requests[i] for i in rng.permutation(len(requests))]


def sharegpt_like_lengths(count: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(input, output) token lengths: log-normal with ShareGPT's mean lengths, clipped as vLLM filters."""
    def draw(mean: float) -> np.ndarray:
        mu = math.log(mean) - SHAREGPT_LOG_SIGMA ** 2 / 2  # a log-normal's mean is exp(mu + sigma^2 / 2)
        return rng.lognormal(mu, SHAREGPT_LOG_SIGMA, size=count)

    inputs = np.clip(np.rint(draw(SHAREGPT_MEAN_INPUT_LEN)), MIN_LEN, MAX_INPUT_LEN).astype(int)
    outputs = np.rint(draw(SHAREGPT_MEAN_OUTPUT_LEN)).astype(int)
    outputs = np.clip(outputs, MIN_LEN, MAX_TOTAL_LEN - inputs)
    return [(int(n), int(m)) for n, m in zip(inputs, outputs)]


def _sharegpt_like(args, builder: PromptBuilder, rng) -> list[SampleRequest]:
    requests = []
    for input_len, output_len in sharegpt_like_lengths(args.num_prompts, rng):
        output_len = args.sharegpt_output_len or output_len
        requests.append(SampleRequest(builder.prompt(builder.token_ids(input_len)), input_len, output_len))
    return requests


def _sharegpt_file(args, tokens: PromptTokens, rng) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: each conversation's first turn is the prompt and its second the answer whose
    length is max_tokens; pairs with fewer than 4 tokens either side, a prompt over 1024 or a total over 2048
    are skipped."""
    if tokens.tokenizer is None:
        raise ValueError("--dataset-path needs a text tokenizer: pass --tokenizer")
    conversations = json.loads(Path(args.dataset_path).read_text())
    pairs = [c["conversations"] for c in conversations if len(c.get("conversations", ())) >= 2]
    requests = []
    for index in rng.permutation(len(pairs)):
        prompt, answer = pairs[index][0]["value"], pairs[index][1]["value"]
        prompt_len = len(tokens.tokenizer.encode(prompt))
        output_len = args.sharegpt_output_len or len(tokens.tokenizer.encode(answer))
        if prompt_len < MIN_LEN or output_len < MIN_LEN or prompt_len > MAX_INPUT_LEN \
                or prompt_len + output_len > MAX_TOTAL_LEN:
            continue
        requests.append(SampleRequest(prompt, prompt_len, output_len))
        if len(requests) == args.num_prompts:
            break
    if len(requests) < args.num_prompts:
        raise ValueError(f"{args.dataset_path}: {len(requests)} usable conversations, --num-prompts asks "
                         f"{args.num_prompts}")
    return requests
