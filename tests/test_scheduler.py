"""Scheduler: continuous batching, chunked prefill, budgets, preemption by recompute and by swap, aborts,
token-level stops, and a long simulation against a fake worker that checks every plan. Pure Python."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.request import FinishReason, Request, RequestStatus
from scheduler_svc.sampling_params import SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from tests.fake_worker import FakeWorker, expected_output

EOS = 0


def make_scheduler(
    *,
    block_size=4,
    num_gpu_blocks=64,
    num_cpu_blocks=0,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=256,
    preemption_mode="recompute",
) -> tuple[Scheduler, FakeWorker]:
    limits = SchedulerLimits(max_num_seqs, max_num_batched_tokens, max_model_len, preemption_mode)
    manager = BlockManager(block_size, num_gpu_blocks, num_cpu_blocks)
    return Scheduler(limits, manager), FakeWorker(block_size, num_gpu_blocks, num_cpu_blocks)


def make_request(request_id, prompt_len=4, max_tokens=16, **params) -> Request:
    prompt = [100 + i for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, seed=7, **params), (EOS,))


def step(scheduler: Scheduler, worker: FakeWorker, sampled_override=None) -> tuple[SchedulerOutput, list[Request]]:
    """schedule -> fake worker -> update; the worker checks the plan against its rows and KV contents."""
    output = scheduler.schedule()
    sampled = worker.execute(output)
    if sampled_override is not None:
        sampled = {rid: sampled_override for rid in sampled}
    updated = scheduler.update_from_output(output, sampled)
    scheduler.block_manager.check_invariants()
    return output, updated


# ---- continuous batching -------------------------------------------------------------------------------------


def test_request_added_while_others_run_joins_the_next_step():
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=5))
    out0, _ = step(scheduler, worker)
    assert [n.request_id for n in out0.new_requests] == ["a"] and out0.new_requests[0].num_scheduled_tokens == 5

    scheduler.add_request(make_request("b", prompt_len=3))
    out1, updated = step(scheduler, worker)
    assert [(s.request_id, s.num_scheduled_tokens) for s in out1.scheduled_requests] == [("a", 1)]
    new_b = out1.new_requests[0]
    assert (new_b.request_id, new_b.token_ids, new_b.num_computed_tokens) == ("b", (100, 101, 102), 0)
    assert out1.total_num_scheduled_tokens == 4
    assert {r.request_id for r in updated} == {"a", "b"}


def test_finished_request_leaves_at_once_and_is_reported_in_the_next_output_only():
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=8, max_tokens=1))
    scheduler.add_request(make_request("b", prompt_len=8, max_tokens=5))
    _, updated = step(scheduler, worker)
    a = next(r for r in updated if r.request_id == "a")
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 1
    assert scheduler.get_request("a") is None and scheduler.num_running == 1
    assert scheduler.block_manager.num_free_gpu_blocks == 64 - 2  # only b holds blocks: 8 tokens
    out1, _ = step(scheduler, worker)
    assert out1.finished_request_ids == ("a",) and list(out1.num_scheduled_tokens()) == ["b"]
    out2, _ = step(scheduler, worker)
    assert out2.finished_request_ids == ()


# ---- budgets -----------------------------------------------------------------------------------------------


def test_long_prompt_is_chunked_under_the_token_budget_and_samples_only_at_its_end():
    scheduler, worker = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("long", prompt_len=20))
    scheduler.add_request(make_request("short", prompt_len=6))
    plans = []
    for _ in range(3):
        output, updated = step(scheduler, worker)
        plans.append((output.num_scheduled_tokens(), [r.request_id for r in updated]))
    assert plans[0] == ({"long": 8}, [])
    assert plans[1] == ({"long": 8}, [])
    # The prompt's last 4 tokens, then the leftover budget starts the next prompt as a chunk.
    assert plans[2] == ({"long": 4, "short": 4}, ["long"])
    output, updated = step(scheduler, worker)
    assert output.num_scheduled_tokens() == {"long": 1, "short": 2}
    assert {r.request_id for r in updated} == {"long", "short"}
    assert scheduler.get_request("long").num_computed_tokens == 21


def test_max_num_seqs_caps_the_running_requests():
    scheduler, worker = make_scheduler(max_num_seqs=2)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", max_tokens=2 if i == 0 else 8))
    out0, _ = step(scheduler, worker)
    assert [n.request_id for n in out0.new_requests] == ["r0", "r1"] and scheduler.num_waiting == 2
    out1, _ = step(scheduler, worker)  # r0 finishes here
    assert out1.new_requests == () and scheduler.num_running == 1
    out2, _ = step(scheduler, worker)
    assert [n.request_id for n in out2.new_requests] == ["r2"] and scheduler.num_running == 2


# ---- preemption --------------------------------------------------------------------------------------------


def fill_pool_with_two_decoders(preemption_mode, num_cpu_blocks=0, a_max_tokens=3):
    """block_size 2, 4 GPU blocks: a and b (3-token prompts) each hold 2 blocks after one step; at step 2,
    a needs a third block and b (latest arrived) must make room."""
    scheduler, worker = make_scheduler(
        block_size=2, num_gpu_blocks=4, num_cpu_blocks=num_cpu_blocks, preemption_mode=preemption_mode
    )
    scheduler.add_request(make_request("a", prompt_len=3, max_tokens=a_max_tokens))
    scheduler.add_request(make_request("b", prompt_len=3, max_tokens=4))
    step(scheduler, worker)
    step(scheduler, worker)
    return scheduler, worker


def test_recompute_preemption_requeues_the_latest_request_and_resumes_it_from_scratch():
    scheduler, worker = fill_pool_with_two_decoders("recompute")
    b = scheduler.get_request("b")
    b_tokens = b.all_token_ids
    out2, _ = step(scheduler, worker)  # a gets b's blocks, a then finishes
    assert out2.preempted_request_ids == ("b",) and out2.num_scheduled_tokens() == {"a": 1}
    assert out2.swap_out == ()
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.all_token_ids == b_tokens and scheduler.num_preemptions == 1

    out3, _ = step(scheduler, worker)
    assert out3.finished_request_ids == ("a",)
    (resumed,) = out3.new_requests
    assert resumed.request_id == "b" and resumed.token_ids == tuple(b_tokens)
    assert (resumed.num_computed_tokens, resumed.num_scheduled_tokens) == (0, 5)
    assert len(resumed.block_ids) == 3
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)
    assert b.output_token_ids == expected_output(b, max_model_len=256)


def test_swap_preemption_moves_blocks_out_and_back_and_resumes_with_computed_tokens():
    scheduler, worker = fill_pool_with_two_decoders("swap", num_cpu_blocks=4)
    b = scheduler.get_request("b")
    b_gpu_table = scheduler.block_manager.block_table("b")
    out2, _ = step(scheduler, worker)
    assert out2.preempted_request_ids == ("b",) and out2.num_scheduled_tokens() == {"a": 1}
    assert [gpu for gpu, _ in out2.swap_out] == b_gpu_table and out2.swap_in == ()
    b_cpu_table = [cpu for _, cpu in out2.swap_out]
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 4 and scheduler.num_swapped == 1
    b_tokens = b.all_token_ids

    out3, _ = step(scheduler, worker)  # a finished last step: its blocks let b come back
    assert out3.swap_out == () and [cpu for cpu, _ in out3.swap_in] == b_cpu_table
    (resumed,) = out3.new_requests
    assert resumed.token_ids == tuple(b_tokens)
    assert (resumed.num_computed_tokens, resumed.num_scheduled_tokens) == (4, 1)
    assert list(resumed.block_ids[:2]) == [gpu for _, gpu in out3.swap_in] and len(resumed.block_ids) == 3
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)
    assert b.output_token_ids == expected_output(b, max_model_len=256)
    assert scheduler.block_manager.num_free_cpu_blocks == 4


def test_recompute_preempted_request_goes_back_before_later_waiting_requests():
    scheduler, worker = fill_pool_with_two_decoders("recompute")
    scheduler.add_request(make_request("c", prompt_len=1, max_tokens=1))
    out2, _ = step(scheduler, worker)  # b preempted: nothing is admitted in a step that preempts
    assert out2.preempted_request_ids == ("b",) and out2.new_requests == ()
    out3, _ = step(scheduler, worker)
    assert [new.request_id for new in out3.new_requests] == ["b", "c"]


def test_waiting_requests_do_not_overtake_a_swapped_request():
    scheduler, worker = fill_pool_with_two_decoders("swap", num_cpu_blocks=4, a_max_tokens=4)
    scheduler.add_request(make_request("w", prompt_len=1, max_tokens=1))
    out2, _ = step(scheduler, worker)
    assert out2.preempted_request_ids == ("b",)
    out3, _ = step(scheduler, worker)  # a holds 3 of 4 blocks: b cannot come back, w would fit but waits
    assert out3.new_requests == () and out3.num_scheduled_tokens() == {"a": 1}
    assert scheduler.get_request("w").status is RequestStatus.WAITING
    out4, _ = step(scheduler, worker)
    assert out4.finished_request_ids == ("a",) and out4.swap_in
    assert [new.request_id for new in out4.new_requests] == ["b", "w"]


def test_requests_swapped_out_in_one_step_come_back_in_arrival_order():
    scheduler, worker = make_scheduler(block_size=2, num_gpu_blocks=6, num_cpu_blocks=8, preemption_mode="swap")
    for request_id, prompt_len in [("a", 4), ("b", 4), ("c", 2), ("d", 2)]:  # 2 + 2 + 1 + 1 blocks: full
        scheduler.add_request(make_request(request_id, prompt_len=prompt_len, max_tokens=2))
    step(scheduler, worker)
    out1, _ = step(scheduler, worker)  # a and b each need a block: d, then c, make room; a and b finish
    assert out1.preempted_request_ids == ("d", "c") and len(out1.swap_out) == 2
    out2, _ = step(scheduler, worker)
    assert [new.request_id for new in out2.new_requests] == ["c", "d"]


def test_swap_preemption_falls_back_to_recompute_when_the_swap_pool_is_full():
    scheduler, worker = fill_pool_with_two_decoders("swap", num_cpu_blocks=1)
    out2, _ = step(scheduler, worker)
    assert out2.preempted_request_ids == ("b",) and out2.swap_out == ()
    b = scheduler.get_request("b")
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0


def test_request_that_cannot_grow_preempts_itself_when_it_arrived_last():
    scheduler, worker = make_scheduler(block_size=2, num_gpu_blocks=4)
    scheduler.add_request(make_request("a", prompt_len=3, max_tokens=4))  # 2 blocks, room for one more token
    scheduler.add_request(make_request("b", prompt_len=4, max_tokens=4))  # 2 blocks, full
    step(scheduler, worker)
    out1, _ = step(scheduler, worker)
    assert out1.preempted_request_ids == ("b",) and out1.num_scheduled_tokens() == {"a": 1}


# ---- aborts ------------------------------------------------------------------------------------------------


def test_abort_frees_blocks_from_every_queue_and_is_reported_next_step():
    scheduler, worker = fill_pool_with_two_decoders("swap", num_cpu_blocks=4)
    scheduler.add_request(make_request("w", max_tokens=2))
    step(scheduler, worker)  # b swapped out, w waits behind it
    assert scheduler.get_request("b").status is RequestStatus.SWAPPED
    assert scheduler.block_manager.num_free_cpu_blocks == 2
    assert scheduler.abort_request("b") and scheduler.block_manager.num_free_cpu_blocks == 4
    assert scheduler.abort_request("w")
    assert scheduler.abort_request("a") is False  # finished by max_tokens in the last step
    assert not scheduler.abort_request("unknown")
    output = scheduler.schedule()
    assert set(output.finished_request_ids) == {"a", "b", "w"} and output.total_num_scheduled_tokens == 0
    assert not scheduler.has_unfinished_requests()

    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("r", prompt_len=9))
    step(scheduler, worker)
    assert scheduler.block_manager.num_free_gpu_blocks == 61
    assert scheduler.abort_request("r") and scheduler.block_manager.num_free_gpu_blocks == 64
    assert scheduler.schedule().finished_request_ids == ("r",)


def test_abort_between_schedule_and_update_drops_the_sampled_token():
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a"))
    output = scheduler.schedule()
    sampled = worker.execute(output)
    scheduler.abort_request("a")
    assert scheduler.update_from_output(output, sampled) == []
    assert scheduler.schedule().finished_request_ids == ("a",)


# ---- stops -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "token", "status"),
    [
        ({}, EOS, RequestStatus.FINISHED_STOPPED),
        ({"ignore_eos": True}, EOS, RequestStatus.RUNNING),
        ({"stop_token_ids": (42,)}, 42, RequestStatus.FINISHED_STOPPED),
        ({"stop_token_ids": (42,), "ignore_eos": True}, 42, RequestStatus.FINISHED_STOPPED),
        ({}, 42, RequestStatus.RUNNING),
        ({"max_tokens": 1}, 42, RequestStatus.FINISHED_LENGTH),
        ({"max_tokens": 1}, EOS, RequestStatus.FINISHED_STOPPED),  # a stop wins over the length
    ],
)
def test_token_level_stop_conditions(params, token, status):
    scheduler, worker = make_scheduler()
    params.setdefault("max_tokens", 16)
    scheduler.add_request(make_request("a", **params))
    _, (a,) = step(scheduler, worker, sampled_override=token)
    assert a.status is status and a.output_token_ids == [token]
    if status.is_finished:
        assert scheduler.block_manager.num_free_gpu_blocks == 64


def test_reaching_max_model_len_finishes_with_length():
    scheduler, worker = make_scheduler(max_model_len=6)
    scheduler.add_request(make_request("a", prompt_len=4, max_tokens=100))
    step(scheduler, worker, sampled_override=5)
    _, (a,) = step(scheduler, worker, sampled_override=5)
    assert a.num_tokens == 6 and a.finish_reason is FinishReason.LENGTH


def test_finish_request_for_a_stop_string_frees_and_reports():
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a"))
    step(scheduler, worker)
    assert scheduler.finish_request("a", FinishReason.STOP)
    assert not scheduler.finish_request("a", FinishReason.STOP)
    assert scheduler.block_manager.num_free_gpu_blocks == 64
    assert scheduler.schedule().finished_request_ids == ("a",)


# ---- protocol ----------------------------------------------------------------------------------------------


def test_schedule_refuses_to_plan_before_the_previous_step_is_applied():
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a"))
    output = scheduler.schedule()
    with pytest.raises(RuntimeError):
        scheduler.schedule()
    with pytest.raises(ValueError):
        scheduler.update_from_output(output, {})  # the prompt's end was reached: a token is owed
    scheduler.update_from_output(output, worker.execute(output))
    scheduler.schedule()


def test_add_request_refuses_what_could_never_run():
    scheduler, _ = make_scheduler(block_size=4, num_gpu_blocks=4, max_model_len=32)
    with pytest.raises(ValueError):
        scheduler.add_request(make_request("too-long", prompt_len=33))
    with pytest.raises(ValueError):
        scheduler.add_request(make_request("too-big", prompt_len=10, max_tokens=8))  # 17 slots > 16
    scheduler.add_request(make_request("fits", prompt_len=10, max_tokens=7))
    with pytest.raises(ValueError):
        scheduler.add_request(make_request("fits", prompt_len=1))


# ---- simulation --------------------------------------------------------------------------------------------


def random_request(rng: random.Random, index: int) -> Request:
    prompt_len = rng.choice([rng.randint(1, 12), rng.randint(12, 60)])
    params = SamplingParams(
        max_tokens=rng.randint(1, 40),
        seed=rng.getrandbits(32),
        stop_token_ids=tuple(rng.sample(range(1, 50), rng.choice([0, 0, 1]))),
        ignore_eos=rng.random() < 0.3,
    )
    return Request(f"req-{index}", [rng.randrange(50) for _ in range(prompt_len)], params, (EOS,))


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_simulation_every_request_finishes_with_the_right_tokens_and_all_blocks_come_back(preemption_mode):
    rng = random.Random(1234)
    max_model_len = 64
    scheduler, worker = make_scheduler(
        block_size=4,
        num_gpu_blocks=40,
        num_cpu_blocks=12,
        max_num_seqs=12,
        max_num_batched_tokens=32,
        max_model_len=max_model_len,
        preemption_mode=preemption_mode,
    )
    pending = [random_request(rng, i) for i in range(2000)]
    pending.reverse()
    requests: list[Request] = []
    cut_short: set[str] = set()  # aborted, or finished by the simulated stop-string check
    num_swap_outs = 0

    while pending or scheduler.has_unfinished_requests():
        for _ in range(min(rng.randint(0, 2), len(pending))):
            requests.append(pending.pop())
            scheduler.add_request(requests[-1])
        if rng.random() < 0.02:
            live = [r for r in requests[-40:] if not r.status.is_finished]
            if live:
                victim = rng.choice(live)
                assert scheduler.abort_request(victim.request_id)
                cut_short.add(victim.request_id)

        output = scheduler.schedule()
        assert output.total_num_scheduled_tokens <= 32
        assert not set(output.preempted_request_ids) & set(output.num_scheduled_tokens())
        num_swap_outs += len(output.swap_out)
        sampled = worker.execute(output)
        running_ids = {r.request_id for r in requests if r.status is RequestStatus.RUNNING}
        assert set(worker.rows) == running_ids and len(running_ids) <= 12
        for updated in scheduler.update_from_output(output, sampled):
            if not updated.status.is_finished and rng.random() < 0.005:
                assert scheduler.finish_request(updated.request_id, FinishReason.STOP)
                cut_short.add(updated.request_id)
        scheduler.block_manager.check_invariants()
        for request in requests[-40:]:
            if request.status is RequestStatus.RUNNING:
                assert worker.rows[request.request_id].token_ids == request.all_token_ids

    final = scheduler.schedule()  # reports the last finished ids; the worker drops every row
    worker.execute(final)
    assert worker.rows == {}
    manager = scheduler.block_manager
    assert manager.num_free_gpu_blocks == manager.num_gpu_blocks
    assert manager.num_free_cpu_blocks == manager.num_cpu_blocks
    assert scheduler.num_preemptions > 50
    if preemption_mode == "swap":
        assert num_swap_outs > 0
    for request in requests:
        assert request.status.is_finished
        expected = expected_output(request, max_model_len)
        if request.request_id in cut_short:
            assert request.output_token_ids == expected[: request.num_output_tokens]
        else:
            assert request.output_token_ids == expected, request.request_id
