"""`bench serve`'s workload, without a server: vLLM's random lengths in [len(1-r), len(1+r)], prompts of the
exact token length asked for (text cut at a token boundary, or random ids below the vocab size), prefix
repetition sharing its prefixes, sharegpt-like lengths with ShareGPT's means and vLLM's clipping, a local
ShareGPT file read as vLLM does, seeded arrival times at the asked rate, and --goodput parsed or refused by
name."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from pagedserve.bench.arrivals import send_offsets
from pagedserve.bench.prompt_tokenizer import PromptTokens
from pagedserve.bench.serve_datasets import (SHAREGPT_MEAN_INPUT_LEN, SHAREGPT_MEAN_OUTPUT_LEN, add_dataset_arguments,
                                             sample_requests, sharegpt_like_lengths)
from pagedserve.bench.serve_metrics import parse_goodput


class CharTokenizer:
    """One token per character (ids are code points): lengths are easy to check."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids) -> str:
        return "".join(chr(i) for i in token_ids)


TEXT = PromptTokens(CharTokenizer(), None, "test")
IDS_ONLY = PromptTokens(None, 50, "test")


def workload(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_dataset_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(list(flags))


def test_random_lengths_stay_in_the_range_and_prompts_have_them_exactly():
    args = workload("--num-prompts", "200", "--random-input-len", "40", "--random-output-len", "10",
                    "--random-range-ratio", "0.5")
    requests = sample_requests(args, TEXT)
    assert {len(CharTokenizer().encode(r.prompt)) == r.prompt_len for r in requests} == {True}
    assert min(r.prompt_len for r in requests) == 20 and max(r.prompt_len for r in requests) == 60
    assert {r.expected_output_len for r in requests} <= set(range(5, 16))
    assert len({r.prompt for r in requests}) == 200, "prompts differ (no accidental prefix-cache hits)"
    assert sample_requests(args, TEXT) == requests, "one seed, one workload"


def test_without_a_tokenizer_prompts_are_random_ids_below_the_vocab_size():
    requests = sample_requests(workload("--num-prompts", "20", "--random-input-len", "30"), IDS_ONLY)
    assert all(len(r.prompt) == r.prompt_len == 30 for r in requests)
    assert max(max(r.prompt) for r in requests) < 50 and len({tuple(r.prompt) for r in requests}) == 20


def test_prefix_repetition_shares_each_prefix_among_its_requests():
    args = workload("--dataset-name", "prefix-repetition", "--num-prompts", "12", "--prefix-repetition-prefix-len",
                    "16", "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "3",
                    "--prefix-repetition-output-len", "5")
    requests = sample_requests(args, IDS_ONLY)
    assert {(r.prompt_len, r.expected_output_len) for r in requests} == {(24, 5)}
    prefixes = [tuple(r.prompt[:16]) for r in requests]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))
    assert len({tuple(r.prompt) for r in requests}) == 12


def test_sharegpt_like_lengths_have_sharegpts_means_and_vllms_bounds():
    lengths = sharegpt_like_lengths(20000, np.random.default_rng(0))
    inputs, outputs = np.array(lengths).T
    assert inputs.min() >= 4 and inputs.max() <= 1024 and outputs.min() >= 4 and (inputs + outputs).max() <= 2048
    # Clipping trims the long tail, so the means land a little under the unclipped ones.
    assert 0.85 * SHAREGPT_MEAN_INPUT_LEN < inputs.mean() < 1.02 * SHAREGPT_MEAN_INPUT_LEN
    assert 0.85 * SHAREGPT_MEAN_OUTPUT_LEN < outputs.mean() < 1.02 * SHAREGPT_MEAN_OUTPUT_LEN
    requests = sample_requests(workload("--dataset-name", "sharegpt-like", "--num-prompts", "50"), TEXT)
    assert [(r.prompt_len, r.expected_output_len) for r in requests] == sharegpt_like_lengths(
        50, np.random.default_rng(0))


def test_a_sharegpt_file_gives_first_turn_prompts_and_answer_lengths(tmp_path):
    def conversation(human: str, gpt: str) -> dict:
        return {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}

    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([conversation("hi", "too short prompt"), conversation("what is up?", "fine!!"),
                                {"conversations": [{"from": "human", "value": "no answer"}]},
                                conversation("tell me more", "ok")]))  # the answer is under 4 tokens
    args = workload("--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "1")
    (request,) = sample_requests(args, TEXT)
    assert (request.prompt, request.prompt_len, request.expected_output_len) == ("what is up?", 11, 6)
    with pytest.raises(ValueError, match="1 usable conversations"):
        sample_requests(workload("--dataset-path", str(path), "--dataset-name", "sharegpt-like",
                                 "--num-prompts", "2"), TEXT)


def test_arrivals_follow_the_rate_and_inf_sends_everything_at_once():
    assert send_offsets(5, float("inf"), 1.0, np.random.default_rng(0)) == [0.0] * 5
    offsets = send_offsets(1000, 20.0, 1.0, np.random.default_rng(0))
    assert offsets == sorted(offsets) and offsets[-1] == pytest.approx(1000 / 20.0)
    gaps = np.diff(offsets)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.1)  # exponential gaps: CV 1
    even = np.diff(send_offsets(1000, 20.0, 100.0, np.random.default_rng(0)))
    assert np.std(even) / np.mean(even) < 0.2  # high burstiness: nearly even
    assert send_offsets(10, 5.0, 0.5, np.random.default_rng(3)) == send_offsets(10, 5.0, 0.5, np.random.default_rng(3))
    with pytest.raises(ValueError, match="--burstiness"):
        send_offsets(3, 1.0, 0.0, np.random.default_rng(0))


def test_goodput_pairs_parse_and_bad_ones_name_the_flag():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000.5"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.5}
    for bad in ("ttft", "itl:5", "tpot:fast", "e2el:-1"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput([bad])


# ---- multi-turn ----------------------------------------------------------------------------------------------

def multi_turn_workload(*flags: str) -> argparse.Namespace:
    from pagedserve.bench.multi_turn import add_multi_turn_arguments

    parser = argparse.ArgumentParser()
    add_multi_turn_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(list(flags))


def test_multi_turn_conversations_have_their_own_prefix_and_turns_of_the_asked_lengths():
    from pagedserve.bench.multi_turn import sample_conversations

    args = multi_turn_workload("--multi-turn-num-conversations", "3", "--multi-turn-num-turns", "4",
                               "--multi-turn-prefix-len", "40", "--multi-turn-input-len", "7")
    conversations = sample_conversations(args, TEXT)
    assert len(conversations) == 3 and len({c.prefix for c in conversations}) == 3
    assert all(len(c.prefix) == 40 and [len(u) for u in c.user_turns] == [7] * 4 for c in conversations)
    assert conversations == sample_conversations(args, TEXT)  # one --seed, one workload
    with pytest.raises(ValueError, match="text tokenizer"):
        sample_conversations(args, IDS_ONLY)
    with pytest.raises(ValueError, match="--multi-turn-num-turns must be at least 1"):
        sample_conversations(multi_turn_workload("--multi-turn-num-turns", "0"), TEXT)
    with pytest.raises(ValueError, match="--max-active-conversations must be at least 1, got -1"):
        sample_conversations(multi_turn_workload("--max-active-conversations", "-1"), TEXT)


def test_each_turn_appends_the_answer_and_a_new_message_and_waits_for_the_previous_answer():
    import asyncio

    from pagedserve.bench.multi_turn import TURN_SEPARATOR, Conversation, send_conversations
    from pagedserve.bench.request_outcome import RequestInput, RequestOutcome

    conversations = [Conversation(f"P{i}", ("u1", "u2", "u3"), 2, 2, 5) for i in range(4)]
    sent: list[str] = []
    active = {"now": 0, "most": 0}

    async def backend(request: RequestInput) -> RequestOutcome:
        active["now"] += 1
        active["most"] = max(active["most"], active["now"])
        sent.append(request.prompt)
        await asyncio.sleep(0.01)
        active["now"] -= 1
        outcome = RequestOutcome(prompt_len=request.prompt_len, success=True, output_tokens=1)
        outcome.generated_text = f"<a{len(request.prompt)}>"
        return outcome

    template = RequestInput("m", "", 0, 5, False, {})
    outcomes, _ = asyncio.run(send_conversations(backend, conversations, template, 2, [0.0] * 4))
    assert len(outcomes) == 12 and all(o.success for o in outcomes)
    assert active["most"] == 2  # --max-active-conversations
    first = "P0" + TURN_SEPARATOR + "u1"
    second = first + f"<a{len(first)}>" + TURN_SEPARATOR + "u2"
    third = second + f"<a{len(second)}>" + TURN_SEPARATOR + "u3"
    assert [first, second, third] == [prompt for prompt in sent if prompt.startswith("P0")]
    assert sent.index(second) > sent.index(first) and sent.index(third) > sent.index(second)
    assert [o.prompt_len for o in outcomes[:3]] == [4, 7, 10]  # the history's tokens: prompt + answer + message


def test_the_servers_prefill_is_its_prompt_tokens_minus_its_cached_tokens_per_engine():
    from pagedserve.bench.multi_turn import PrefillCounters, metrics_prefill_counters, prefill_record

    page = "\n".join(['# TYPE vllm:prompt_tokens counter',
                      'vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0',
                      'vllm:prompt_tokens_total{engine="1",model_name="m"} 300.0',
                      '# TYPE vllm:prefix_cache_hits counter',
                      'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 32.0',
                      'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 64.0', ""])
    after = metrics_prefill_counters(page)
    assert after == {"0": PrefillCounters(100, 32), "1": PrefillCounters(300, 64)}
    record = prefill_record({"0": PrefillCounters(40, 0), "1": PrefillCounters(0, 0)}, after)
    assert (record["prompt_tokens"], record["cached_tokens"], record["computed_prefill_tokens"]) == (360, 96, 264)
    assert record["per_engine"]["0"] == {"prompt_tokens": 60, "cached_tokens": 32, "computed_prefill_tokens": 28}
    lone = metrics_prefill_counters('vllm:prompt_tokens_total{model_name="m"} 5.0\n')
    assert lone == {"all": PrefillCounters(5, 0)}
