"""`bench serve --dataset-name multi-turn`: chat-like conversations whose turns grow one history, the workload
where routing a conversation to the replica that caches its prefix pays (docs/scale_out.md).

The shape follows vLLM's multi-turn benchmark (benchmarks/multi_turn/benchmark_serving_multi_turn.py and its
generate_multi_turn.json: a number of conversations, each with its own prefix, turns of a given number of
user tokens and answer tokens, at most --max-active-conversations at once). Ours is a dataset of `bench
serve`, so every backend, latency figure and the JSON record stay the same; and it is synthetic (no text file).

Who owns what: a Conversation holds what is known before the run (its prefix text and each turn's user
message, built with the tokenizer up front); the history grows while it runs: turn k's prompt is turn k-1's
prompt, its answer (the text the server streamed) and the new user message. Turns of one conversation are
sent one after another (the next waits for the answer), conversations concurrently. The server's prefill work
is read from its counters before and after (ServerPrefill): the prompt tokens it was sent minus those its
prefix cache served, per engine when the server has several.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from dataclasses import dataclass

import numpy as np

from pagedserve.bench.prompt_tokenizer import PromptTokens
from pagedserve.bench.request_outcome import RequestInput, RequestOutcome
from pagedserve.bench.serve_datasets import PromptBuilder

TURN_SEPARATOR = "\n\n"


def add_multi_turn_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--multi-turn-num-conversations", type=int, default=16,
                        help="multi-turn: conversations (each a prefix of its own and its turns)")
    parser.add_argument("--multi-turn-num-turns", type=int, default=5, help="multi-turn: user turns per conversation")
    parser.add_argument("--multi-turn-prefix-len", type=int, default=256,
                        help="multi-turn: tokens of each conversation's opening (a system prompt or document)")
    parser.add_argument("--multi-turn-input-len", type=int, default=64, help="multi-turn: tokens of each user turn")
    parser.add_argument("--multi-turn-output-len", type=int, default=64, help="multi-turn: max tokens of each answer")
    parser.add_argument("--max-active-conversations", type=int, default=None,
                        help="multi-turn: most conversations in flight at once (vLLM's name; default all)")


@dataclass(frozen=True)
class Conversation:
    """One conversation's fixed parts: its opening text and each turn's user message (text), the answers' max
    tokens, and the token counts of those parts (prompt lengths before the server's count arrives)."""

    prefix: str
    user_turns: tuple[str, ...]
    prefix_len: int
    user_len: int
    output_len: int


def sample_conversations(args: argparse.Namespace, tokens: PromptTokens) -> list[Conversation]:
    """The conversations the flags describe, reproducible for one --seed. Text only: each turn appends the
    answer's text to the history, which needs a text tokenizer."""
    if tokens.tokenizer is None:
        raise ValueError("--dataset-name multi-turn needs a text tokenizer (the history is text): pass --tokenizer")
    for name in ("num_conversations", "num_turns", "prefix_len", "input_len", "output_len"):
        if getattr(args, f"multi_turn_{name}") < 1:
            raise ValueError(f"--multi-turn-{name.replace('_', '-')} must be at least 1")
    if args.max_active_conversations is not None and args.max_active_conversations < 1:
        raise ValueError(f"--max-active-conversations must be at least 1, got {args.max_active_conversations}")
    builder = PromptBuilder(tokens, np.random.default_rng(args.seed))
    return [Conversation(prefix=builder.prompt(builder.token_ids(args.multi_turn_prefix_len)),
                         user_turns=tuple(builder.prompt(builder.token_ids(args.multi_turn_input_len))
                                          for _ in range(args.multi_turn_num_turns)),
                         prefix_len=args.multi_turn_prefix_len, user_len=args.multi_turn_input_len,
                         output_len=args.multi_turn_output_len)
            for _ in range(args.multi_turn_num_conversations)]


async def send_conversations(backend, conversations: list[Conversation], request: RequestInput,
                             max_active: int | None, offsets: list[float]) -> tuple[list[RequestOutcome], float]:
    """Runs every conversation (conversation i starts at offsets[i], when one of `max_active` slots is free),
    its turns in order; `request` is the template (model, sampling) every turn copies. Returns the outcomes,
    conversation by conversation and turn by turn, and the wall time. A failed turn ends its conversation (the
    next turn has no answer to append); its remaining turns are recorded as failed."""
    limit = asyncio.Semaphore(max_active) if max_active else contextlib.nullcontext()

    async def converse(conversation: Conversation, offset: float) -> list[RequestOutcome]:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        outcomes: list[RequestOutcome] = []
        history, history_len = conversation.prefix, conversation.prefix_len
        async with limit:
            for user in conversation.user_turns:
                if outcomes and not outcomes[-1].success:
                    outcomes.append(RequestOutcome(prompt_len=0).fail("an earlier turn of its conversation failed"))
                    continue
                prompt = history + TURN_SEPARATOR + user
                prompt_len = history_len + conversation.user_len
                outcome = await backend(RequestInput(request.model, prompt, prompt_len, conversation.output_len,
                                                     request.ignore_eos, request.sampling))
                outcomes.append(outcome)
                history = prompt + outcome.generated_text
                history_len = outcome.prompt_len + (outcome.output_tokens or 0)
        return outcomes

    start = time.perf_counter()
    per_conversation = await asyncio.gather(*(converse(c, o) for c, o in zip(conversations, offsets)))
    duration = time.perf_counter() - start
    return [outcome for outcomes in per_conversation for outcome in outcomes], duration


@dataclass(frozen=True)
class PrefillCounters:
    """One engine's counters since it started: prompt tokens it was sent, and those its prefix cache served."""

    prompt_tokens: int
    cached_tokens: int

    def minus(self, earlier: PrefillCounters) -> PrefillCounters:
        return PrefillCounters(self.prompt_tokens - earlier.prompt_tokens, self.cached_tokens - earlier.cached_tokens)


def grpc_prefill_counters(client) -> dict[str, PrefillCounters]:
    """Per engine ("0", "1", ...; "all" from a lone scheduler), from GetStats."""
    stats = client.stats()
    if stats.engines:
        return {str(entry.engine): PrefillCounters(entry.stats.num_prompt_tokens, entry.stats.prefix_cache_hit_tokens)
                for entry in stats.engines}
    return {"all": PrefillCounters(stats.num_prompt_tokens, stats.prefix_cache_hit_tokens)}


def metrics_prefill_counters(metrics_text: str) -> dict[str, PrefillCounters]:
    """Per engine (the `engine` label; "all" without one), from a /metrics page's vllm:prompt_tokens_total and
    vllm:prefix_cache_hits_total."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total"):
                engine = sample.labels.get("engine", "all")
                values.setdefault(engine, {})[sample.name] = sample.value
    return {engine: PrefillCounters(int(counts.get("vllm:prompt_tokens_total", 0)),
                                    int(counts.get("vllm:prefix_cache_hits_total", 0)))
            for engine, counts in sorted(values.items())}


def prefill_record(before: dict[str, PrefillCounters], after: dict[str, PrefillCounters]) -> dict:
    """The JSON record's `server_prefill`: the run's prompt tokens, cached tokens and computed prefill tokens
    (prompt minus cached), in total and per engine."""
    per_engine = {engine: after[engine].minus(before.get(engine, PrefillCounters(0, 0))) for engine in after}

    def entry(counters: PrefillCounters) -> dict:
        return {"prompt_tokens": counters.prompt_tokens, "cached_tokens": counters.cached_tokens,
                "computed_prefill_tokens": counters.prompt_tokens - counters.cached_tokens}

    total = PrefillCounters(sum(c.prompt_tokens for c in per_engine.values()),
                            sum(c.cached_tokens for c in per_engine.values()))
    return {**entry(total), "per_engine": {engine: entry(counters) for engine, counters in per_engine.items()}}
