"""Speculative decoding with a draft model, in the scheduler: a step asks the workers for proposals while the
batch is small, the proposals come back with the result, and the request's next plain decode takes them as
its drafts (capped like n-gram drafts), only while the request still has the tokens they were proposed after.
Pure Python, on the fake worker that verifies drafts (tests/test_scheduler_speculative.py's)."""

from __future__ import annotations

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.scheduler import Scheduler, SchedulerLimits
from scheduler_svc.core.speculative_config import SpeculativeConfig
from tests.fake_worker import FakeWorker
from tests.test_scheduler_speculative import cyclic_model, drafts_of, make, request, run

K = 3


def draft_model_config(disable_by_batch_size=8) -> SpeculativeConfig:
    return SpeculativeConfig(K, disable_by_batch_size=disable_by_batch_size, method="draft_model", model="/draft")


def propose(tokens: list[int], k: int, wrong_after: int | None) -> tuple[int, ...]:
    """A draft model: the cyclic model's greedy continuation, wrong from draft `wrong_after` on."""
    out = []
    for index in range(k):
        token = cyclic_model(0, tokens + out)
        out.append(token + 100 if wrong_after is not None and index >= wrong_after else token)
    return tuple(out)


def step_with_proposals(scheduler, worker, wrong_after=None):
    output = scheduler.schedule()
    sampled = worker.execute(output)
    proposed = {}
    if output.propose_draft_tokens:
        for request_id in sampled:
            request = scheduler.get_request(request_id)
            accepted = worker.accepted_drafts.get(request_id, 0)
            known = request.all_token_ids + list(request.draft_token_ids[:accepted]) + [sampled[request_id]]
            proposed[request_id] = propose(known, output.propose_draft_tokens, wrong_after)
    scheduler.update_from_output(output, sampled, worker.accepted_drafts, proposed)
    scheduler.block_manager.check_invariants()
    return output


def test_the_draft_models_proposals_become_the_next_decodes_drafts_and_the_output_is_unchanged():
    plain = request("a")
    run(*make(k=0), plain)
    for wrong_after in (None, 1, 0):
        scheduler, worker = _with_draft_model(draft_model_config())
        spec = request("a")
        scheduler.add_request(spec)
        plans = []
        while scheduler.has_unfinished_requests():
            plans.append(step_with_proposals(scheduler, worker, wrong_after))
        assert spec.output_token_ids == plain.output_token_ids
        assert all(plan.propose_draft_tokens == K for plan in plans)
        drafted = [drafts_of(plan).get("a") for plan in plans[1:]]
        assert drafted[0] == propose(plain.prompt_token_ids + plain.output_token_ids[:1], K, wrong_after)
        stats = scheduler.spec_decode_stats
        assert stats.num_drafts > 0
        # Right proposals are all kept; with the second one wrong, only the first of each; none when all wrong.
        kept = {None: stats.num_draft_tokens, 1: stats.num_drafts, 0: 0}[wrong_after]
        assert stats.num_accepted_tokens == kept


def test_no_proposals_asked_above_the_batch_size_and_a_stale_proposal_is_not_used():
    scheduler, worker = _with_draft_model(draft_model_config(disable_by_batch_size=1))
    a, b = request("a"), request("b")
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = step_with_proposals(scheduler, worker)
    assert first.propose_draft_tokens == 0 and a.proposed_after == -1
    scheduler.abort_request("b")
    second = step_with_proposals(scheduler, worker)
    assert second.propose_draft_tokens == K and a.proposed_after == a.num_tokens
    a.proposed_after -= 1  # as if proposed after older tokens (a step planned ahead appended one since)
    third = scheduler.schedule()
    assert drafts_of(third) == {} and third.propose_draft_tokens == K


def _with_draft_model(config):
    scheduler = Scheduler(SchedulerLimits(8, 64, 256), BlockManager(4, 64, 0), speculative=config)
    return scheduler, FakeWorker(4, 64, 0, model=cyclic_model)
