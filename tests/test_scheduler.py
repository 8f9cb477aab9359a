"""Scheduler: continuous batching, chunked prefill (and decodes first while a prompt is chunked), budgets,
priorities, preemption by recompute and by swap, forks (fan-out roots, copy-on-write), beam rows, aborts from
every state, token-level stops; every plan runs on a fake worker that checks it. Pure Python. The long random
simulation is in test_scheduler_simulation.py."""

from __future__ import annotations

import zlib

import pytest

from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
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
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
    max_steps_in_flight=1,
) -> tuple[Scheduler, FakeWorker]:
    limits = SchedulerLimits(
        max_num_seqs, max_num_batched_tokens, max_model_len, preemption_mode,
        enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=enable_chunked_prefill,
    )
    manager = BlockManager(block_size, num_gpu_blocks, num_cpu_blocks, enable_prefix_caching=enable_prefix_caching)
    scheduler = Scheduler(limits, manager, max_steps_in_flight=max_steps_in_flight)
    return scheduler, FakeWorker(block_size, num_gpu_blocks, num_cpu_blocks)


def make_request(request_id, prompt_len=4, max_tokens=16, priority=0, **params) -> Request:
    """A request whose prompt no other request id shares (so the prefix cache stays out of the way)."""
    prompt = [prompt_token(request_id, i) for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, seed=7, **params)
    return Request(request_id, prompt, params, (EOS,), priority=priority)


def prompt_token(request_id: str, position: int) -> int:
    return 1000 * (1 + zlib.crc32(request_id.encode()) % 1000) + position


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
    b_prompt = tuple(prompt_token("b", i) for i in range(3))
    assert (new_b.request_id, new_b.token_ids, new_b.num_computed_tokens) == ("b", b_prompt, 0)
    assert out1.total_num_scheduled_tokens == 4
    assert {r.request_id for r in updated} == {"a", "b"}


def test_next_step_is_planned_while_the_previous_one_runs():
    """Async scheduling: step 1 is planned before step 0's result; a decode takes its input token from the
    worker's row; a request whose token in flight may be its last is not planned; a stop found in step 1's
    result drops the token step 2 (already planned) sampled for it."""
    scheduler, worker = make_scheduler(max_steps_in_flight=2)
    scheduler.add_request(make_request("a", prompt_len=5, max_tokens=2))
    scheduler.add_request(make_request("b", prompt_len=5, max_tokens=16))
    out0 = scheduler.schedule()
    sampled0 = worker.execute(out0)
    out1 = scheduler.schedule()  # step 0 still in flight
    assert dict(out1.num_scheduled_tokens()) == {"a": 1, "b": 1} and out1.completing_request_ids == ("a", "b")
    with pytest.raises(RuntimeError):
        scheduler.schedule()  # two steps in flight already
    sampled1 = worker.execute(out1)
    updated = scheduler.update_from_output(out0, sampled0)
    assert [(r.request_id, r.num_output_tokens, r.num_pending_tokens) for r in updated] == [("a", 1, 1), ("b", 1, 1)]
    out2 = scheduler.schedule()  # a's token in flight is its last (max_tokens 2): only b
    assert dict(out2.num_scheduled_tokens()) == {"b": 1}
    sampled2 = worker.execute(out2)
    sampled1 = dict(sampled1, b=EOS)  # b stops in step 1...
    updated = scheduler.update_from_output(out1, sampled1)
    assert {r.request_id: r.status for r in updated} == {
        "a": RequestStatus.FINISHED_LENGTH, "b": RequestStatus.FINISHED_STOPPED}
    assert scheduler.update_from_output(out2, sampled2) == []  # ...so its token from step 2 is dropped
    b = updated[1]
    assert b.output_token_ids == [sampled0["b"], EOS] and b.num_pending_tokens == 0
    assert scheduler.block_manager.num_free_gpu_blocks == 64
    assert set(scheduler.schedule().finished_request_ids) == {"a", "b"}


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


def test_recompute_preemption_requeues_the_latest_request_and_resumes_it_after_its_cached_blocks():
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
    # Its first (full) block was still cached: uncached blocks are handed out before cached ones.
    assert (resumed.num_computed_tokens, resumed.num_scheduled_tokens) == (2, 3)
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


# ---- chunked prefill ---------------------------------------------------------------------------------------


def test_running_decodes_get_a_token_every_step_while_a_long_prompt_is_chunked():
    scheduler, worker = make_scheduler(
        block_size=16, num_gpu_blocks=128, max_num_seqs=17, max_num_batched_tokens=32, max_model_len=512
    )
    decodes = [f"decode-{i}" for i in range(16)]
    for request_id in decodes:
        scheduler.add_request(make_request(request_id, prompt_len=2, max_tokens=100, ignore_eos=True))
    step(scheduler, worker)
    # A better priority puts the long prompt ahead of every decode in line.
    scheduler.add_request(make_request("long", prompt_len=4 * 32, max_tokens=1, priority=-1))
    chunks = []
    while scheduler.get_request("long") is not None:
        output, _ = step(scheduler, worker)
        counts = output.num_scheduled_tokens()
        assert [counts.get(request_id) for request_id in decodes] == [1] * 16
        chunks.append(counts["long"])
    assert chunks == [16] * 8  # the budget left after the decodes, every step


def test_without_chunked_prefill_a_prompt_is_scheduled_whole_or_waits():
    scheduler, worker = make_scheduler(
        max_num_batched_tokens=64, max_model_len=64, max_num_seqs=16, enable_chunked_prefill=False
    )
    for i in range(8):
        scheduler.add_request(make_request(f"decode-{i}", prompt_len=2, max_tokens=3, ignore_eos=True))
    step(scheduler, worker)
    scheduler.add_request(make_request("long", prompt_len=60, max_tokens=1))
    scheduled_long = []
    while scheduler.get_request("long") is not None:
        output, _ = step(scheduler, worker)  # 8 decode tokens leave 56: not enough for the 60-token prompt
        scheduled_long.append(output.num_scheduled_tokens().get("long"))
    assert scheduled_long == [None, None, 60]


def test_limits_refuse_a_budget_below_max_model_len_without_chunked_prefill():
    with pytest.raises(ValueError, match="max_num_batched_tokens.*max_model_len"):
        SchedulerLimits(8, 32, 64, enable_chunked_prefill=False)
    SchedulerLimits(8, 64, 64, enable_chunked_prefill=False)
    SchedulerLimits(8, 32, 64)


# ---- priority ----------------------------------------------------------------------------------------------


def test_waiting_requests_start_by_priority_then_arrival():
    scheduler, worker = make_scheduler(max_num_seqs=1)
    for request_id, priority in [("low-1", 1), ("high", 0), ("low-2", 1), ("urgent", -5)]:
        scheduler.add_request(make_request(request_id, max_tokens=1, priority=priority))
    order = []
    while scheduler.has_unfinished_requests():
        output, _ = step(scheduler, worker)
        order += [new.request_id for new in output.new_requests]
    assert order == ["urgent", "high", "low-1", "low-2"]


def test_preemption_victims_are_the_worst_priority_then_the_latest_arrival():
    scheduler, worker = make_scheduler(block_size=2, num_gpu_blocks=8)
    for request_id, priority in [("worst-old", 2), ("best", 0), ("worst-new", 2), ("middle", 1)]:
        scheduler.add_request(make_request(request_id, prompt_len=3, max_tokens=4, priority=priority))
    step(scheduler, worker)  # 2 blocks each: the pool is full
    step(scheduler, worker)  # the 4th token still fits
    output, _ = step(scheduler, worker)  # everyone needs a third block
    assert output.preempted_request_ids == ("worst-new", "worst-old")
    assert output.num_scheduled_tokens() == {"best": 1, "middle": 1}


def fill_pool_with_two_low_priority_requests():
    scheduler, worker = make_scheduler(block_size=4, num_gpu_blocks=8)
    for request_id in ("low-1", "low-2"):
        scheduler.add_request(make_request(request_id, prompt_len=12, max_tokens=4, priority=1))
    step(scheduler, worker)  # 3 blocks each: 2 free
    return scheduler, worker


def test_a_waiting_request_of_better_priority_preempts_worse_running_ones():
    scheduler, worker = fill_pool_with_two_low_priority_requests()
    scheduler.add_request(make_request("urgent", prompt_len=12, max_tokens=1, priority=0))  # 3 blocks
    output, _ = step(scheduler, worker)
    assert output.preempted_request_ids == ("low-2",) and output.new_requests == ()
    output, _ = step(scheduler, worker)
    assert [new.request_id for new in output.new_requests] == ["urgent"]


def test_a_waiting_request_of_equal_priority_waits_its_turn():
    scheduler, worker = fill_pool_with_two_low_priority_requests()
    peer = make_request("peer", prompt_len=12, max_tokens=1, priority=1)
    scheduler.add_request(peer)
    output = None
    while peer.status is RequestStatus.WAITING:
        output, _ = step(scheduler, worker)
        assert output.preempted_request_ids == ()
    assert output.finished_request_ids == ("low-1", "low-2")  # it started once the others finished


# ---- forks: fan-out roots and copy-on-write ----------------------------------------------------------------


def make_root(request_id: str, prompt_len: int, **params) -> Request:
    root = make_request(request_id, prompt_len=prompt_len, **params)
    root.prefill_only = True
    return root


def make_child(root: Request, index: int, **params) -> Request:
    params = SamplingParams(**{"max_tokens": 20, "seed": 100 + index, "ignore_eos": True, **params})
    return Request(f"{root.request_id}#{index}", list(root.prompt_token_ids), params, (EOS,))


def test_fan_out_of_four_shares_the_prompt_blocks_and_copies_the_partial_block_on_first_write():
    scheduler, worker = make_scheduler(block_size=16, num_gpu_blocks=64, max_num_batched_tokens=512,
                                       max_model_len=1024)
    manager = scheduler.block_manager
    root = make_root("root", prompt_len=500)
    scheduler.add_request(root)
    output, updated = step(scheduler, worker)
    assert output.num_scheduled_tokens() == {"root": 499}  # the prompt but its last token: nothing sampled
    assert updated == [root] and root.status is RequestStatus.RUNNING and root.output_token_ids == []

    root_table = manager.block_table("root")
    full, partial = root_table[:31], root_table[31]
    children = [make_child(root, i) for i in range(4)]
    for child in children:
        scheduler.fork_request("root", child, num_shared_tokens=499)
    assert scheduler.release_request("root")
    assert all(manager.block_table(child.request_id) == root_table for child in children)
    assert [manager.gpu_ref_count(b) for b in root_table] == [4] * 32 and manager.num_used_gpu_blocks == 32

    output, _ = step(scheduler, worker)
    assert output.finished_request_ids == ("root",)
    assert [(new.request_id, new.num_computed_tokens, new.num_scheduled_tokens) for new in output.new_requests] == [
        (child.request_id, 499, 1) for child in children
    ]
    # Three children write into copies; the fourth, by then the last holder, writes into the original.
    assert len(output.copy) == 3 and {src for src, _ in output.copy} == {partial}
    last_blocks = [manager.block_table(child.request_id)[31] for child in children]
    assert set(last_blocks) == {partial} | {dst for _, dst in output.copy} and len(set(last_blocks)) == 4
    assert all(manager.block_table(child.request_id)[:31] == full for child in children)
    assert [manager.gpu_ref_count(b) for b in full] == [4] * 31 and manager.num_used_gpu_blocks == 35

    while scheduler.has_unfinished_requests():
        step(scheduler, worker)
    for child in children:
        assert child.output_token_ids == expected_output(child, max_model_len=1024)
    assert len({tuple(child.output_token_ids) for child in children}) == 4
    assert scheduler.num_finished_requests == 4  # the released root is not counted
    assert manager.num_used_gpu_blocks == 0


def test_fork_of_a_waiting_root_gives_a_child_that_shares_nothing_and_waits():
    scheduler, worker = make_scheduler()
    root = make_root("root", prompt_len=1)  # nothing to compute: never scheduled
    scheduler.add_request(root)
    scheduler.add_request(make_request("other", max_tokens=1))
    output, _ = step(scheduler, worker)
    assert list(output.num_scheduled_tokens()) == ["other"]  # the idle root blocks nobody
    child = make_child(root, 0)
    scheduler.fork_request("root", child, num_shared_tokens=0)
    assert child.status is RequestStatus.WAITING and scheduler.block_manager.block_table(child.request_id) == []
    scheduler.release_request("root")
    output, _ = step(scheduler, worker)
    assert [(new.request_id, new.num_computed_tokens, new.num_scheduled_tokens) for new in output.new_requests] == [
        ("root#0", 0, 1)
    ]


@pytest.mark.parametrize("other_arrives_first", [True, False])
def test_a_forked_child_without_a_worker_row_waits_for_one_or_takes_it_from_a_later_arrival(other_arrives_first):
    scheduler, worker = make_scheduler(max_num_seqs=2)
    root = make_root("root", prompt_len=9)
    other = make_request("other", max_tokens=2)
    for request in (other, root) if other_arrives_first else (root, other):
        scheduler.add_request(request)
    step(scheduler, worker)
    for i in range(2):
        scheduler.fork_request("root", make_child(root, i), num_shared_tokens=8)
    scheduler.release_request("root")
    output, _ = step(scheduler, worker)
    if other_arrives_first:  # "other" keeps the second row until it finishes
        assert [new.request_id for new in output.new_requests] == ["root#0"] and output.preempted_request_ids == ()
        assert scheduler.get_request("root#1").status is RequestStatus.RUNNING
        output, _ = step(scheduler, worker)  # "other" finished in the last step
        assert [new.request_id for new in output.new_requests] == ["root#1"]
    else:  # the children are ahead of "other" in line
        assert [new.request_id for new in output.new_requests] == ["root#0", "root#1"]
        assert output.preempted_request_ids == ("other",)


def test_fork_refuses_a_child_whose_shared_tokens_differ_or_exceed_what_the_parent_computed():
    scheduler, worker = make_scheduler()
    root = make_root("root", prompt_len=9)
    scheduler.add_request(root)
    step(scheduler, worker)
    with pytest.raises(ValueError):
        scheduler.fork_request("root", make_child(root, 0), num_shared_tokens=9)
    stranger = make_request("stranger", prompt_len=9)
    with pytest.raises(ValueError):
        scheduler.fork_request("root", stranger, num_shared_tokens=4)
    with pytest.raises(ValueError):
        scheduler.fork_request("nobody", make_child(root, 1), num_shared_tokens=0)
    assert scheduler.get_request("root#0") is None and scheduler.get_request("stranger") is None


# ---- beam rows ---------------------------------------------------------------------------------------------


def test_a_beam_row_returns_candidates_and_runs_on_with_the_tokens_the_engine_appends():
    scheduler, worker = make_scheduler(block_size=4)
    beam = make_request("beam", prompt_len=6)
    beam.num_beam_candidates = 3
    scheduler.add_request(beam)
    output, updated = step(scheduler, worker)
    assert output.new_requests[0].num_beam_candidates == 3
    assert updated == [beam] and beam.output_token_ids == [] and beam.num_computed_tokens == 6
    first, second, _ = worker.beam_candidates["beam"]

    shared_partial = scheduler.block_manager.block_table("beam")[1]  # slots 0-1 of 4 used
    sibling = Request("beam.1", list(beam.prompt_token_ids), beam.sampling_params, (EOS,),
                      output_token_ids=[second], num_beam_candidates=3)
    scheduler.fork_request("beam", sibling, num_shared_tokens=6)
    scheduler.append_token("beam", first)
    output, updated = step(scheduler, worker)
    (scheduled,) = output.scheduled_requests
    (copy,) = output.copy
    assert (scheduled.request_id, scheduled.new_token_ids, scheduled.num_scheduled_tokens) == ("beam", (first,), 1)
    assert copy[0] == shared_partial and scheduled.replaced_blocks == ((1, copy[1]),)
    (new,) = output.new_requests
    assert new.token_ids == (*beam.prompt_token_ids, second) and new.num_computed_tokens == 6
    assert new.block_ids[1] == shared_partial  # the sibling is its last holder: it writes in place
    assert worker.rows["beam"].token_ids == beam.all_token_ids == [*beam.prompt_token_ids, first]
    assert {r.request_id for r in updated} == {"beam", "beam.1"} and set(worker.beam_candidates) == {"beam", "beam.1"}

    output, _ = step(scheduler, worker)
    assert output.total_num_scheduled_tokens == 0  # both wait for the engine's next choice


def test_append_token_is_for_live_beam_rows_within_their_limits():
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("sampling"))
    beam = make_request("beam", max_tokens=1)
    beam.num_beam_candidates = 2
    scheduler.add_request(beam)
    step(scheduler, worker)
    with pytest.raises(ValueError):
        scheduler.append_token("sampling", 5)
    with pytest.raises(ValueError):
        scheduler.append_token("nobody", 5)
    scheduler.append_token("beam", 5)
    with pytest.raises(ValueError):
        scheduler.append_token("beam", 6)  # max_tokens reached: the beam search must end it


def beam_row(request_id: str, prompt_len: int) -> Request:
    request = make_request(request_id, prompt_len=prompt_len, max_tokens=2)
    request.num_beam_candidates = 2
    return request


@pytest.mark.parametrize(
    ("case", "limits"),
    [
        ("waiting sibling needs blocks", {"max_num_batched_tokens": 64}),
        ("running sibling needs blocks", {"max_num_batched_tokens": 8}),
        ("waiting sibling needs the worker row", {"max_num_seqs": 1, "num_gpu_blocks": 16}),
        ("forked sibling needs the worker row", {"max_num_seqs": 1, "num_gpu_blocks": 16}),
    ],
)
def test_an_idle_beam_holding_what_its_sibling_needs_is_preempted_instead_of_deadlocking(case, limits):
    """Beams advance in lockstep: one that has its candidates waits, holding blocks and a row, until its
    siblings have theirs. If a sibling cannot start without those, the idle beam must give them up."""
    scheduler, worker = make_scheduler(**{"block_size": 4, "num_gpu_blocks": 6, "max_num_seqs": 4, **limits})
    first = beam_row("first", prompt_len=12)  # 3 blocks
    scheduler.add_request(first)
    if case == "forked sibling needs the worker row":
        while first.num_computed_tokens < 12:
            step(scheduler, worker)
        sibling = Request("sibling", list(first.prompt_token_ids), first.sampling_params, (EOS,),
                          output_token_ids=[5], num_beam_candidates=2)
        scheduler.fork_request("first", sibling, num_shared_tokens=12)
    else:
        sibling = beam_row("sibling", prompt_len=16)  # 4 blocks: does not fit beside the first
        scheduler.add_request(sibling)
    reported: set[str] = set()
    preempted: set[str] = set()
    for _ in range(8):
        output, updated = step(scheduler, worker)
        reported |= {request.request_id for request in updated}
        preempted |= set(output.preempted_request_ids)
        if "sibling" in reported:
            break
    assert "sibling" in reported and preempted == {"first"}


# ---- abort from every state --------------------------------------------------------------------------------


def test_abort_from_every_state_frees_every_block_and_reports_every_id():
    scheduler, worker = make_scheduler(block_size=4, num_gpu_blocks=12, num_cpu_blocks=16, max_num_seqs=5,
                                       max_num_batched_tokens=16, preemption_mode="swap")
    root = make_root("root", prompt_len=10, max_tokens=8)
    beam = make_request("beam", prompt_len=3, max_tokens=8)
    beam.num_beam_candidates = 2
    scheduler.add_request(root)
    scheduler.add_request(beam)
    scheduler.add_request(make_request("swapped", prompt_len=6, max_tokens=8, priority=3))
    step(scheduler, worker)
    for i in range(2):
        scheduler.fork_request("root", make_child(root, i, max_tokens=8), num_shared_tokens=9)
    scheduler.append_token("beam", worker.beam_candidates["beam"][0])
    scheduler.add_request(make_request("chunked", prompt_len=40, max_tokens=2, priority=1))
    scheduler.add_request(make_request("waiting", prompt_len=4, priority=2))
    for _ in range(3):
        step(scheduler, worker)
    scheduler.fork_request("root", make_child(root, 2, max_tokens=8), num_shared_tokens=9)  # no free row
    scheduler.append_token("beam", 7)  # not yet sent to the worker

    states = {
        "root": (RequestStatus.RUNNING, 9),  # a fan-out root waiting to be released
        "root#0": (RequestStatus.RUNNING, 12),  # forked children with worker rows
        "root#1": (RequestStatus.RUNNING, 12),
        "root#2": (RequestStatus.RUNNING, 9),  # forked, no worker row yet
        "beam": (RequestStatus.RUNNING, 4),
        "swapped": (RequestStatus.SWAPPED, 6),
        "chunked": (RequestStatus.RUNNING, 14),  # mid-prefill
        "waiting": (RequestStatus.WAITING, 0),
    }
    for request_id, state in states.items():
        request = scheduler.get_request(request_id)
        assert (request.status, request.num_computed_tokens) == state, request_id
    assert "root#2" not in worker.rows and scheduler.block_manager.num_free_cpu_blocks < 16
    for request_id in states:
        assert scheduler.abort_request(request_id)
        scheduler.block_manager.check_invariants()
    manager = scheduler.block_manager
    assert manager.num_used_gpu_blocks == 0 and manager.num_free_cpu_blocks == 16
    output = scheduler.schedule()
    assert set(output.finished_request_ids) == set(states) and output.total_num_scheduled_tokens == 0
    worker.execute(output)
    assert worker.rows == {}


# ---- stats -------------------------------------------------------------------------------------------------


def test_stats_count_used_blocks_and_releases_are_not_finishes():
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=9, max_tokens=2))
    root = make_root("root", prompt_len=5)
    scheduler.add_request(root)
    step(scheduler, worker)
    assert scheduler.num_used_gpu_blocks == 3 + 1 and scheduler.num_running == 2 and scheduler.num_steps == 1
    scheduler.release_request("root")
    step(scheduler, worker)
    assert scheduler.num_finished_requests == 1 and scheduler.num_used_gpu_blocks == 0
