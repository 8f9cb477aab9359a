"""A draft model on the worker: it computes every token the target computes (prefill chunks, prefix-cache starts,
verified drafts) in its own pool, and when a plan asks, proposes k tokens after each sampled row's newest token:
exactly the draft model's own greedy continuation of the row's tokens (checked against a worker that serves the
draft model alone). With the target itself as its draft, the proposals are the target's own next tokens, so a
step given them keeps them all; for a request that samples too (proposals drawn from q with its seeded noise,
verified by exact rejection sampling)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import worker_pb2
from worker_svc.config import WorkerConfig
from worker_svc.worker import Worker

BLOCK = 4  # small blocks: proposals cross into blocks the rows do not have yet (the scratch blocks)
K = 3
PROMPTS = {"a": [5, 9, 2, 7, 3, 5, 9], "b": [11, 4, 8, 30, 31, 2, 2, 9, 40, 41, 17]}
BLOCKS = {"a": list(range(0, 8)), "b": list(range(8, 16))}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"target": make_tiny_model(root, "llama", seed=3),
            "draft": make_tiny_model(root, "qwen2", seed=5, num_hidden_layers=2)}


def make_worker(model, draft=None) -> Worker:
    worker = Worker(WorkerConfig(scheduler_address="", model=str(model), num_kv_blocks=32, swap_space=0.01))
    setup = worker_pb2.WorkerSetup(block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=32)
    if draft is not None:
        setup.draft_model.CopyFrom(worker_pb2.DraftModelSetup(model=str(draft), num_speculative_tokens=K))
    worker.setup(setup)
    return worker


def new(request_id, tokens=None, num_scheduled=None, num_computed=0, **sampling) -> worker_pb2.NewRequest:
    tokens = PROMPTS[request_id] if tokens is None else tokens
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": 1, **sampling}
    return worker_pb2.NewRequest(
        request_id=request_id, token_ids=tokens, block_ids=BLOCKS[request_id], num_computed_tokens=num_computed,
        num_scheduled_tokens=num_scheduled or len(tokens) - num_computed, num_prompt_tokens=len(tokens),
        sampling=worker_pb2.WorkerSamplingParams(**sampling, num_logprobs=-1, num_prompt_logprobs=-1))


def scheduled(request_id, drafts=(), num_tokens=1) -> worker_pb2.ScheduledRequest:
    return worker_pb2.ScheduledRequest(request_id=request_id, num_scheduled_tokens=num_tokens + len(drafts),
                                       draft_token_ids=list(drafts))


def plan(*requests, new_requests=(), propose=K) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(new_requests=list(new_requests), scheduled_requests=list(requests),
                               has_draft_tokens=any(r.draft_token_ids for r in requests), propose_draft_tokens=propose)


def proposals_of(sampled: worker_pb2.SampledTokens) -> dict[str, list[int]]:
    flat, out, start = list(sampled.proposed_draft_token_ids), {}, 0
    assert len(sampled.num_proposed_draft_tokens) == len(sampled.request_ids)
    for request_id, count in zip(sampled.request_ids, sampled.num_proposed_draft_tokens):
        out[request_id], start = flat[start : start + count], start + count
    assert start == len(flat)
    return out


def greedy_continuation(worker_alone: Worker, tokens: list[int], count: int, **sampling) -> list[int]:
    """`count` tokens the model decodes greedily (or with `sampling`) after `tokens`, on a worker serving that
    model alone."""
    request_id = f"ref{len(tokens)}-{tokens[-1]}"
    first = worker_pb2.NewRequest(**{**_fields(new("a", tokens, **sampling)), "request_id": request_id})
    out = list(worker_alone.execute(plan(new_requests=[first], propose=0)).sampled.token_ids)
    for _ in range(count - 1):
        out += worker_alone.execute(plan(scheduled(request_id), propose=0)).sampled.token_ids
    worker_alone.execute(worker_pb2.StepPlan(finished_request_ids=[request_id]))
    return out


def _fields(message) -> dict:
    return {field.name: value for field, value in message.ListFields()}


def test_proposals_are_the_draft_models_greedy_continuation_through_chunks_drafts_and_two_rows(models):
    """a and b: b's prompt in two chunks (the first samples nothing, proposes nothing), then both verify the
    proposals they were given (a all of them, the last one made wrong every other step; b the first two); after
    every step each sampled row's proposals equal the draft model alone's greedy continuation of its tokens."""
    worker, alone = make_worker(models["target"], models["draft"]), make_worker(models["draft"])
    known = {request_id: list(tokens) for request_id, tokens in PROMPTS.items()}
    drafts_sent: dict[str, list[int]] = {}
    next_plan = plan(new_requests=[new("a"), new("b", num_scheduled=6)])
    checked = 0
    for step in range(6):
        result = worker.execute(next_plan).sampled
        assert list(result.request_ids) == (["a"] if step == 0 else ["a", "b"])
        accepted = list(result.num_accepted_drafts) or [0] * len(result.request_ids)
        for request_id, token, kept in zip(result.request_ids, result.token_ids, accepted):
            known[request_id] += drafts_sent.get(request_id, [])[:kept] + [token]
        proposed = proposals_of(result)
        for request_id, tokens in proposed.items():
            assert tokens == greedy_continuation(alone, known[request_id], K), (step, request_id)
            checked += 1
        drafts_sent = {"a": proposed["a"], "b": proposed.get("b", [])[:2]}
        if step % 2:
            drafts_sent["a"] = drafts_sent["a"][:-1] + [(drafts_sent["a"][-1] + 1) % 50]
        b = scheduled("b", num_tokens=len(PROMPTS["b"]) - 6) if step == 0 else scheduled("b", drafts_sent["b"])
        next_plan = plan(scheduled("a", drafts_sent["a"]), b)
    assert checked == 11


def test_the_target_as_its_own_draft_proposes_its_own_tokens_and_they_are_all_kept(models):
    worker = make_worker(models["target"], models["target"])
    alone = make_worker(models["target"])
    reference = greedy_continuation(alone, PROMPTS["a"], 1 + 4 * (K + 1))
    result = worker.execute(plan(new_requests=[new("a")])).sampled
    output = list(result.token_ids)
    for _ in range(4):
        drafts = proposals_of(result)["a"]
        result = worker.execute(plan(scheduled("a", drafts))).sampled
        assert list(result.num_accepted_drafts) == [K]
        output += drafts + list(result.token_ids)
    assert output == reference


SAMPLED = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "min_p": 0.01, "seed": 11}


def verified_run(worker: Worker, num_steps: int) -> tuple[list[int], list[int]]:
    """Request a (SAMPLED) on `worker`: a first step, then `num_steps` steps verifying the proposals of the one
    before. Its output and each step's kept drafts."""
    result = worker.execute(plan(new_requests=[new("a", **SAMPLED)])).sampled
    output, kept = list(result.token_ids), []
    for _ in range(num_steps):
        drafts = proposals_of(result)["a"]
        assert worker.runner.draft.proposed is not None  # q kept for the step that verifies them
        result = worker.execute(plan(scheduled("a", drafts))).sampled
        kept += list(result.num_accepted_drafts)
        output += drafts[: kept[-1]] + list(result.token_ids)
    return output, kept


def test_a_sampled_row_proposes_from_q_and_the_target_as_its_own_draft_gives_its_seeded_tokens(models):
    """With temperature, top-k, top-p and min_p: the draft draws with the request's seeded noise, so the target
    as its own draft proposes the tokens the target alone samples, q = p keeps them all (the rejection rule),
    and the output is the target alone's, which is not its greedy output."""
    worker, alone = make_worker(models["target"], models["target"]), make_worker(models["target"])
    output, kept = verified_run(worker, 4)
    assert kept == [K] * 4
    assert output == greedy_continuation(alone, PROMPTS["a"], len(output), **SAMPLED)
    assert output != greedy_continuation(alone, PROMPTS["a"], len(output))


def test_a_sampled_row_with_another_draft_repeats_its_tokens_and_keeps_some_drafts(models):
    """Another random model as the draft: two fresh workers given the same plans give the same tokens and keep
    the same drafts (all the randomness is keyed by the seed and position), some of them."""
    first = verified_run(make_worker(models["target"], models["draft"]), 6)
    assert first == verified_run(make_worker(models["target"], models["draft"]), 6)
    assert 0 < sum(first[1]) < 6 * K, first[1]


def test_a_prefix_cache_start_and_a_swap_reach_the_draft_pool(models):
    """b starts with a's first block computed (a prefix hit: neither model computes it again), then a is
    swapped out and back into other blocks: the proposals stay the draft model's continuation, so the draft's
    pool holds, swaps and shares the same blocks as the target's."""
    worker, alone = make_worker(models["target"], models["draft"]), make_worker(models["draft"])
    first = worker.execute(plan(new_requests=[new("a")])).sampled
    a_known = PROMPTS["a"] + list(first.token_ids)
    b_tokens = a_known[:4] + [44, 45, 46]
    b = worker_pb2.NewRequest(**{**_fields(new("b", b_tokens, num_computed=4)),
                                 "block_ids": BLOCKS["a"][:1] + BLOCKS["b"][1:]})
    result = worker.execute(plan(new_requests=[b])).sampled
    assert proposals_of(result)["b"] == greedy_continuation(alone, b_tokens + [result.token_ids[0]], K)
    worker.execute(worker_pb2.StepPlan(preempted_request_ids=["a"], swap_out=[worker_pb2.BlockMove(src=0, dst=0),
                                                                               worker_pb2.BlockMove(src=1, dst=1)]))
    moved = worker_pb2.NewRequest(**{**_fields(new("a", a_known, num_computed=7)), "block_ids": [20, 21, 22]})
    result = worker.execute(worker_pb2.StepPlan(new_requests=[moved], propose_draft_tokens=K, swap_in=[
        worker_pb2.BlockMove(src=0, dst=20), worker_pb2.BlockMove(src=1, dst=21)])).sampled
    assert proposals_of(result)["a"] == greedy_continuation(alone, a_known + [result.token_ids[0]], K)


def test_a_plan_asking_for_proposals_is_neither_overlapped_nor_launched_behind(models):
    worker = make_worker(models["target"], models["draft"])
    worker.execute(plan(new_requests=[new("a")], propose=0))
    assert worker.can_overlap(plan(scheduled("a"), propose=0))
    assert not worker.can_overlap(plan(scheduled("a")))
    in_flight = worker.launch(plan(scheduled("a")))
    assert not worker.can_overlap(plan(scheduled("a"), propose=0))
    worker.finish(in_flight)
    assert worker.can_overlap(plan(scheduled("a"), propose=0))


def test_proposals_without_a_draft_model_are_refused(models):
    worker = make_worker(models["target"])
    with pytest.raises(ValueError, match="draft"):
        worker.execute(plan(new_requests=[new("a")]))
    np.testing.assert_equal(worker.batch.num_drafts, 0)
