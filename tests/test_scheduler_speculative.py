"""Speculative decoding in the scheduler: n-gram drafts for eligible plain decodes only, slots for 1 + d
tokens, the budget and length caps, the batch-size switch, no plan while drafts are in flight; results with
0..d drafts accepted, a stop inside an accepted run, rejected drafts' blocks freed, accepted blocks cached;
no planning ahead while a small batch speculates; abort, worker loss and victim selection while drafts are in
flight; the engine's generation-token count; and the whole output the same as without speculation, on a fake
worker that verifies drafts and whose block tables must equal the scheduler's after every step. Pure Python."""

from __future__ import annotations

import pytest

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.request import FinishReason, Request
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler, SchedulerLimits
from scheduler_svc.core.speculative_config import SpeculativeConfig
from tests.fake_worker import FakeWorker

PERIOD = [11, 12, 13, 14, 15]


def cyclic_model(seed: int, tokens: list[int]) -> int:
    """Continues PERIOD after the last token (a model whose output repeats its context); after token 99 it says 7."""
    last = tokens[-1]
    if last == 99:
        return 7
    return PERIOD[(PERIOD.index(last) + 1) % len(PERIOD)] if last in PERIOD else PERIOD[0]


def make(k=3, disable_by_batch_size=8, block_size=4, num_gpu_blocks=64, max_num_batched_tokens=64,
         max_model_len=256, model=cyclic_model):
    limits = SchedulerLimits(8, max_num_batched_tokens, max_model_len)
    manager = BlockManager(block_size, num_gpu_blocks, 0)
    spec = None if k == 0 else SpeculativeConfig(k, 3, 1, disable_by_batch_size)
    scheduler = Scheduler(limits, manager, speculative=spec)
    return scheduler, FakeWorker(block_size, num_gpu_blocks, 0, model=model)


def request(request_id, prompt=(11, 12, 13, 14, 15, 11, 12), max_tokens=20, **params):
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, seed=1, **params), eos_token_ids=(0,))


def step(scheduler, worker):
    output = scheduler.schedule()
    sampled = worker.execute(output)
    updated = scheduler.update_from_output(output, sampled, worker.accepted_drafts)
    scheduler.block_manager.check_invariants()
    assert_worker_tables_match(scheduler, worker)
    return output, updated


def assert_worker_tables_match(scheduler, worker):
    """Every row the worker holds for a live request has the scheduler's block table for it."""
    for request_id, row in worker.rows.items():
        if scheduler.get_request(request_id) is not None:
            assert row.block_ids == scheduler.block_manager.block_table(request_id), request_id


def run(scheduler, worker, *requests):
    for r in requests:
        scheduler.add_request(r)
    plans = []
    while scheduler.has_unfinished_requests():
        plans.append(step(scheduler, worker)[0])
    return plans


def drafts_of(output):
    return {data.request_id: data.draft_token_ids for data in output.scheduled_requests if data.draft_token_ids}


def test_a_repeating_output_is_drafted_accepted_and_equals_the_output_without_speculation():
    plain, spec = request("a"), request("a")
    plain_plans = run(*make(k=0), plain)
    scheduler, worker = make(k=3)
    spec_plans = run(scheduler, worker, spec)
    assert spec.output_token_ids == plain.output_token_ids and len(spec.output_token_ids) == 20
    assert len(spec_plans) < len(plain_plans) / 2  # up to 4 tokens per step
    first_decode = spec_plans[1]
    assert drafts_of(first_decode) == {"a": (14, 15, 11)}
    (data,) = first_decode.scheduled_requests
    assert data.num_scheduled_tokens == 4 and first_decode.total_num_scheduled_tokens == 4
    stats = scheduler.spec_decode_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    per_pos = stats.num_accepted_tokens_per_pos
    assert per_pos[0] == stats.num_drafts and sum(per_pos) == stats.num_accepted_tokens and len(per_pos) == 3
    assert scheduler.block_manager.num_used_gpu_blocks == 0


def test_rejected_drafts_are_dropped_their_blocks_freed_and_accepted_blocks_cached():
    # The model ends the cycle with 99 -> 7 at position 8: drafts proposed from the prompt get rejected there.
    def model(seed, tokens):
        return 99 if len(tokens) == 8 else cyclic_model(seed, tokens)

    prompt = (11, 12, 13, 14, 15, 11)
    plain, spec = request("a", prompt, max_tokens=12), request("a", prompt, max_tokens=12)
    run(*make(k=0, model=model), plain)
    scheduler, worker = make(k=3, model=model)
    scheduler.add_request(spec)
    step(scheduler, worker)  # the prompt (6 tokens) and the first token, 12
    table_before = list(scheduler.block_manager.block_table("a"))
    output = scheduler.schedule()  # computes 12 (position 6) with drafts 13 14 15 (positions 7, 8, 9)
    assert drafts_of(output) == {"a": (13, 14, 15)}
    (data,) = output.scheduled_requests
    assert len(table_before) == 2 and len(data.new_block_ids) == 1  # a third block, for positions 8 and 9
    sampled = worker.execute(output)
    assert worker.accepted_drafts == {"a": 1}  # position 8 samples 99
    scheduler.update_from_output(output, sampled, worker.accepted_drafts)
    scheduler.block_manager.check_invariants()
    assert spec.output_token_ids == [12, 13, 99]
    assert spec.num_computed_tokens == 8  # 6 + 12 + the accepted draft 13
    assert scheduler.block_manager.block_table("a") == table_before  # the rejected drafts' block is freed
    assert_worker_tables_match(scheduler, worker)
    cached = set(scheduler.block_manager.cached_blocks().values())
    assert table_before[1] in cached  # positions 4..7, completed by the accepted draft
    output, _ = step(scheduler, worker)  # 99 at position 8: a new block, appended after the kept two
    (data,) = output.scheduled_requests
    assert len(data.new_block_ids) == 1 and len(scheduler.block_manager.block_table("a")) == 3
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)
    assert spec.output_token_ids == plain.output_token_ids
    assert scheduler.spec_decode_stats.num_accepted_tokens < scheduler.spec_decode_stats.num_draft_tokens


@pytest.mark.parametrize("num_accepted", [0, 1, 2, 3])
def test_accepted_counts_zero_to_all_advance_tokens_and_computed_alike(num_accepted):
    scheduler, worker = make(k=3)
    r = request("a", max_tokens=50)
    scheduler.add_request(r)
    step(scheduler, worker)
    output = scheduler.schedule()
    assert drafts_of(output) == {"a": (14, 15, 11)}
    worker.execute(output)
    computed_before = r.num_computed_tokens - 3
    scheduler.update_from_output(output, {"a": 42}, {"a": num_accepted})
    assert r.output_token_ids == [13, *(14, 15, 11)[:num_accepted], 42]
    assert r.num_computed_tokens == computed_before + num_accepted
    table = scheduler.block_manager.block_table("a")
    assert len(table) == scheduler.block_manager.num_blocks_for(r.num_computed_tokens)
    scheduler.block_manager.check_invariants()
    with pytest.raises(ValueError, match="4 drafts accepted of 0"):
        output = scheduler.schedule()
        scheduler.update_from_output(output, {"a": 1}, {"a": 4})  # 42 is new: no drafts


def test_a_stop_inside_an_accepted_run_ends_the_request_there():
    scheduler, worker = make(k=3)
    r = Request("a", [11, 12, 13, 14, 15, 11, 12], SamplingParams(max_tokens=50, seed=1, stop_token_ids=(15,)))
    scheduler.add_request(r)
    step(scheduler, worker)
    output, updated = step(scheduler, worker)
    assert drafts_of(output) == {"a": (14, 15, 11)} and worker.accepted_drafts == {"a": 3}
    assert updated == [r] and r.finish_reason is FinishReason.STOP
    assert r.output_token_ids == [13, 14, 15]  # 11 and the sampled token after it are dropped
    assert scheduler.block_manager.num_used_gpu_blocks == 0


def test_drafts_never_take_a_request_past_max_tokens_or_max_model_len():
    scheduler, worker = make(k=3)
    r = request("a", max_tokens=3)
    scheduler.add_request(r)
    step(scheduler, worker)
    output, _ = step(scheduler, worker)
    assert drafts_of(output) == {"a": (14,)}  # 1 token out, 1 sampled now: room for one draft
    assert r.output_token_ids == [13, 14, 15] and r.finish_reason is FinishReason.LENGTH
    scheduler, worker = make(k=3, max_model_len=10)
    r = request("b", max_tokens=50)
    scheduler.add_request(r)
    step(scheduler, worker)
    output, _ = step(scheduler, worker)
    assert drafts_of(output) == {"b": (14,)} and r.num_tokens == 10 and r.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("params", [dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
                                    dict(repetition_penalty=1.1), dict(logprobs=1), dict(min_tokens=5),
                                    dict(bad_words_token_ids=((3,),)), dict(structured_grammar="start: x"),
                                    dict(stop=("x",))])
def test_only_requests_that_sample_plainly_get_drafts(params):
    scheduler, worker = make(k=3)
    scheduler.add_request(request("plain"))
    scheduler.add_request(request("other", **params))
    step(scheduler, worker)
    output, _ = step(scheduler, worker)
    assert set(drafts_of(output)) == {"plain"}


def test_above_disable_by_batch_size_no_drafts():
    scheduler, worker = make(k=3, disable_by_batch_size=2)
    for name in "abc":
        scheduler.add_request(request(name))
    step(scheduler, worker)
    output, _ = step(scheduler, worker)
    assert drafts_of(output) == {}
    scheduler, worker = make(k=3, disable_by_batch_size=3)
    for name in "abc":
        scheduler.add_request(request(name))
    step(scheduler, worker)
    output, _ = step(scheduler, worker)
    assert set(drafts_of(output)) == {"a", "b", "c"}


def test_drafts_take_only_the_budget_left_after_decodes_and_the_waiting():
    scheduler, worker = make(k=3, max_num_batched_tokens=6)
    scheduler.add_request(request("a", prompt=(11, 12, 13, 14, 15, 11)))
    step(scheduler, worker)
    scheduler.add_request(request("b", prompt=(1, 2, 3, 4)))
    output = scheduler.schedule()
    counts = output.num_scheduled_tokens()
    assert counts["b"] == 4 and counts["a"] == 2 and drafts_of(output) == {"a": (13,)}  # 1 decode + 4 + 1 draft
    assert output.total_num_scheduled_tokens == 6


def test_a_request_with_drafts_in_flight_is_not_planned_until_its_result_is_applied():
    limits = SchedulerLimits(8, 64, 256)
    scheduler = Scheduler(limits, BlockManager(4, 64, 0), max_steps_in_flight=2,
                          speculative=SpeculativeConfig(3, 3, 1, 8))
    worker = FakeWorker(4, 64, 0, model=cyclic_model)
    r = request("a")
    scheduler.add_request(r)
    step(scheduler, worker)
    with_drafts = scheduler.schedule()
    assert drafts_of(with_drafts) == {"a": (14, 15, 11)}
    ahead = scheduler.schedule()
    assert ahead.total_num_scheduled_tokens == 0  # nothing to compute until the drafts are verified
    scheduler.update_from_output(with_drafts, worker.execute(with_drafts), worker.accepted_drafts)
    assert r.draft_token_ids == () and r.output_token_ids == [13, 14, 15, 11, 12]
    assert drafts_of(scheduler.schedule()) == {"a": (13, 14, 15)}


def async_scheduler(num_gpu_blocks=64, disable_by_batch_size=8, max_steps_in_flight=2):
    limits = SchedulerLimits(8, 64, 256)
    spec = SpeculativeConfig(3, 3, 1, disable_by_batch_size)
    scheduler = Scheduler(limits, BlockManager(4, num_gpu_blocks, 0), max_steps_in_flight, speculative=spec)
    return scheduler, FakeWorker(4, num_gpu_blocks, 0, model=cyclic_model)


def test_a_small_batch_that_speculates_is_not_planned_ahead():
    scheduler, _ = async_scheduler(disable_by_batch_size=2)
    for name in "ab":
        scheduler.add_request(request(name))
    scheduler.schedule()
    assert scheduler.num_running == 2 and scheduler.max_steps_ahead() == 1
    scheduler.add_request(request("c"))
    scheduler.schedule()
    assert scheduler.num_running == 3 and scheduler.max_steps_ahead() == 2  # above disable_by_batch_size
    plain = Scheduler(SchedulerLimits(8, 64, 256), BlockManager(4, 64, 0), max_steps_in_flight=2)
    plain.add_request(request("a"))
    plain.schedule()
    assert plain.max_steps_ahead() == 2


def counting_model(seed: int, tokens: list[int]) -> int:
    """An output that never repeats its context: each token is the one before plus one."""
    return tokens[-1] + 1


def test_a_small_batch_whose_tokens_never_recur_is_planned_ahead_until_a_proposal_appears():
    """No n-gram proposal for any running request: the engine may plan ahead (the host's work hides behind the
    GPU again); once a request's known tokens recur, it waits for each result so the next plan has drafts. The
    output is the same either way."""
    scheduler, worker = async_scheduler()
    a = request("a", prompt=(20, 21, 22, 23), max_tokens=6)
    scheduler.add_request(a)
    worker.model = counting_model
    plans = []
    while scheduler.has_unfinished_requests():
        assert scheduler.max_steps_ahead() == 2
        plans.append(step(scheduler, worker)[0])
    assert not any(drafts_of(plan) for plan in plans)
    assert a.output_token_ids == [24, 25, 26, 27, 28, 29]
    scheduler.add_request(request("b", prompt=(20, 21, 22, 20, 21)))  # "20 21" recurs: a proposal
    assert drafts_of(scheduler.schedule()) == {}  # its prefill: drafts come with its decodes
    assert scheduler.max_steps_ahead() == 1


def test_a_draft_model_waits_for_each_result_while_a_request_can_take_drafts():
    """A draft model proposes for any request that samples plainly; one returning logprobs never gets drafts."""
    limits = SchedulerLimits(8, 64, 256)
    spec = SpeculativeConfig(3, method="draft_model", model="/models/draft")
    scheduler = Scheduler(limits, BlockManager(4, 64, 0), max_steps_in_flight=2, speculative=spec)
    scheduler.add_request(request("a", prompt=(20, 21, 22, 23), logprobs=1))
    scheduler.schedule()
    assert scheduler.max_steps_ahead() == 2
    scheduler.add_request(request("b", prompt=(20, 21, 22, 23)))
    scheduler.schedule()
    assert scheduler.max_steps_ahead() == 1


def test_an_abort_while_drafts_are_in_flight_frees_everything_and_skips_the_result():
    scheduler, worker = async_scheduler()
    r = request("a")
    scheduler.add_request(r)
    step(scheduler, worker)
    with_drafts = scheduler.schedule()
    assert drafts_of(with_drafts) == {"a": (14, 15, 11)}
    assert scheduler.abort_request("a")
    assert scheduler.take_worker_cancels() == ["a"]  # its verification step may be dropped by the worker
    assert r.draft_token_ids == () and scheduler.block_manager.num_used_gpu_blocks == 0
    sampled = worker.execute(with_drafts)  # the worker ran it anyway
    assert scheduler.update_from_output(with_drafts, sampled, worker.accepted_drafts) == []
    assert r.output_token_ids == [13] and scheduler.spec_decode_stats.num_drafts == 0
    scheduler.block_manager.check_invariants()
    assert len(scheduler.block_manager.cached_blocks()) == 1  # positions 0..3; 4..7 was to be completed by 13


def test_a_worker_loss_while_drafts_are_in_flight_recomputes_without_them():
    plain = request("a")
    run(*make(k=0), plain)
    scheduler, worker = async_scheduler()
    r = request("a")
    scheduler.add_request(r)
    step(scheduler, worker)
    assert drafts_of(scheduler.schedule()) == {"a": (14, 15, 11)}
    (lost,) = scheduler.recover_from_worker_loss(BlockManager(4, 64, 0))
    assert (lost.request_id, lost.num_output_tokens, lost.num_lost_samples, lost.joined) == ("a", 1, 1, False)
    assert r.draft_token_ids == () and r.num_computed_tokens == 0 and r.output_token_ids == [13]
    assert scheduler.num_steps_in_flight == 0
    worker = FakeWorker(4, 64, 0, model=cyclic_model)
    first = scheduler.schedule()  # the prompt and 13 recomputed; drafts again once its next token is back
    assert drafts_of(first) == {} and first.num_scheduled_tokens() == {"a": 8}
    scheduler.update_from_output(first, worker.execute(first), worker.accepted_drafts)
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)
    assert r.output_token_ids == plain.output_token_ids


def test_a_request_with_drafts_in_flight_is_never_a_victim():
    # b (earlier, penalised: no drafts) decodes each step; a's drafts take the pool's last free block.
    scheduler, worker = async_scheduler(num_gpu_blocks=5)
    b = request("b", prompt=(1, 2, 3, 4, 5, 6, 7), max_tokens=5, presence_penalty=0.5)
    a = request("a", max_tokens=10)
    scheduler.add_request(b)
    scheduler.add_request(a)
    step(scheduler, worker)
    with_drafts = scheduler.schedule()
    assert drafts_of(with_drafts) == {"a": (14, 15, 11)} and scheduler.block_manager.num_free_gpu_blocks == 0
    ahead = scheduler.schedule()  # b's next decode needs a block: not a's, whose drafts are being verified
    assert ahead.preempted_request_ids == ("b",) and ahead.total_num_scheduled_tokens == 0
    assert a.draft_token_ids == (14, 15, 11) and scheduler.num_running == 1 and scheduler.num_waiting == 1
    sampled = worker.execute(with_drafts)
    accepted = worker.accepted_drafts
    worker.execute(ahead)  # the worker drops b's row (the engine sends a plan that carries block work)
    scheduler.update_from_output(with_drafts, sampled, accepted)
    assert a.output_token_ids == [13, 14, 15, 11, 12]
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)
    assert a.output_token_ids == [13, 14, 15, 11, 12, 13, 14, 15, 11, 12] and len(b.output_token_ids) == 5


def test_a_request_with_a_token_in_flight_gets_no_drafts():
    limits = SchedulerLimits(8, 64, 256)
    scheduler = Scheduler(limits, BlockManager(4, 64, 0), max_steps_in_flight=2,
                          speculative=SpeculativeConfig(3, 3, 1, 8))
    scheduler.add_request(request("a"))
    scheduler.schedule()  # the prompt: its first token is in flight
    assert drafts_of(scheduler.schedule()) == {}


def test_the_plan_codec_carries_drafts_out_and_accepted_counts_back():
    from protos.pagedserve.v1 import worker_pb2
    from scheduler_svc.worker_io.plan_codec import decode_step_result, encode_step_plan

    scheduler, worker = make(k=3)
    scheduler.add_request(request("a"))
    scheduler.add_request(request("b", prompt=(1, 2, 3)))
    step(scheduler, worker)
    output = scheduler.schedule()
    plan = encode_step_plan(output).plan
    (entry_a, entry_b) = plan.scheduled_requests
    assert plan.has_draft_tokens
    assert list(entry_a.draft_token_ids) == [14, 15, 11] and entry_a.num_scheduled_tokens == 4
    assert list(entry_b.draft_token_ids) == [] and entry_b.num_scheduled_tokens == 1
    result = worker_pb2.StepResult()
    result.sampled.request_ids.extend(["a", "b"])
    result.sampled.token_ids.extend([12, 5])
    result.sampled.logprobs.extend([0.0, 0.0])
    result.sampled.num_accepted_drafts.extend([3, 0])
    outcome = decode_step_result(result)
    assert outcome.sampled == {"a": 12, "b": 5} and outcome.accepted_drafts == {"a": 3}


class _FakeWorkerLink:
    """The engine's WorkerLink, with the fake worker running each plan when its result is asked for."""

    last_result_wait_s = 0.0

    def __init__(self, worker: FakeWorker, outputs: dict) -> None:
        self._worker, self._outputs = worker, outputs

    async def send_plan(self, plan) -> None:
        pass

    async def send_cancels(self, request_ids) -> None:
        pass

    async def receive_result(self, step_id: int):
        from protos.pagedserve.v1 import worker_pb2

        sampled = self._worker.execute(self._outputs[step_id])
        result = worker_pb2.StepResult()
        result.sampled.request_ids.extend(sampled)
        result.sampled.token_ids.extend(sampled.values())
        result.sampled.logprobs.extend([0.0] * len(sampled))
        result.sampled.num_accepted_drafts.extend(self._worker.accepted_drafts.get(rid, 0) for rid in sampled)
        return result


def test_the_engine_counts_as_generated_only_the_drafts_a_request_appended_and_never_plans_ahead():
    import asyncio

    from scheduler_svc.engine import Engine

    scheduler, worker = async_scheduler()  # max_steps_in_flight 2, but a small batch speculates
    outputs = {}
    schedule = scheduler.schedule
    steps_in_flight_when_planning = []

    def recorded_schedule():
        steps_in_flight_when_planning.append(scheduler.num_steps_in_flight)
        output = schedule()
        outputs[output.step_id] = output
        return output

    scheduler.schedule = recorded_schedule
    engine = Engine(scheduler, _FakeWorkerLink(worker, outputs), None, eos_token_ids=(0,))
    # 13, then 14 15 11 drafted and all accepted (and 12 sampled after them): the stop id 15 drops 11 and 12.
    r = Request("a", [11, 12, 13, 14, 15, 11, 12], SamplingParams(max_tokens=50, seed=1, stop_token_ids=(15,)))
    scheduler.add_request(r)

    async def run_until_finished():
        loop = asyncio.create_task(engine.run())
        while scheduler.has_unfinished_requests() or scheduler.num_steps_in_flight:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop

    asyncio.run(run_until_finished())
    assert scheduler.spec_decode_stats.num_accepted_tokens == 3
    assert r.output_token_ids == [13, 14, 15]
    assert engine.serving_metrics().num_generation_tokens == 3
    assert set(steps_in_flight_when_planning) == {0}


def test_the_outlook_searches_a_requests_tokens_once_per_token_count(monkeypatch):
    """The engine asks on every turn of its loop: the n-gram search runs again only after the tokens changed."""
    import scheduler_svc.core.draft_outlook as outlook

    searches = []
    search = outlook.propose_ngram_drafts
    monkeypatch.setattr(outlook, "propose_ngram_drafts",
                        lambda tokens, *a: searches.append(len(tokens)) or search(tokens, *a))
    scheduler, worker = async_scheduler()
    scheduler.add_request(request("a", prompt=(20, 21, 22, 23)))
    worker.model = counting_model
    step(scheduler, worker)
    for _ in range(3):
        assert scheduler.max_steps_ahead() == 2
    assert searches == [5]
    step(scheduler, worker)
    assert scheduler.max_steps_ahead() == 2 and searches == [5, 6]
