"""The `random` dataset of the offline benchmarks: prompts of random token ids, each with its output length.

As vLLM's random dataset, lengths are drawn uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)]
and tokens uniformly from the vocabulary. Token ids go to the engine as they are (vLLM decodes them to text
and re-encodes it, which moves the length by a few tokens; ids keep it exact and need no tokenizer, so a
`--load-format dummy` model directory holding only config.json works). Ids start at 3: below are the
special tokens (BOS/EOS/padding) of most vocabularies. The same seed gives the same requests, which is what
`benchmarks/offline_throughput.py` relies on to hand Hugging Face's peers the engine's prompts.
"""

from __future__ import annotations

import random
from typing import NamedTuple

FIRST_ORDINARY_TOKEN_ID = 3


class BenchRequest(NamedTuple):
    prompt_token_ids: list[int]
    output_len: int


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int, *, seed: int = 0,
                    range_ratio: float = 0.0) -> list[BenchRequest]:
    """`num_prompts` requests; ValueError naming the argument that cannot give one."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, not {num_prompts}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must lie in [0, 1), not {range_ratio}")
    for name, length in (("input_len", input_len), ("output_len", output_len)):
        if length < 1:
            raise ValueError(f"{name} must be at least 1, not {length}")
    if vocab_size <= FIRST_ORDINARY_TOKEN_ID:
        raise ValueError(f"vocab_size {vocab_size} leaves no ordinary token ids")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        prompt_len, generated_len = (_length(rng, input_len, range_ratio), _length(rng, output_len, range_ratio))
        prompt = [rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab_size) for _ in range(prompt_len)]
        requests.append(BenchRequest(prompt, generated_len))
    return requests


def _length(rng: random.Random, length: int, range_ratio: float) -> int:
    if range_ratio == 0.0:
        return length
    return rng.randint(max(1, int(length * (1 - range_ratio))), int(length * (1 + range_ratio)))
