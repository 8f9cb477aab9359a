"""The planner's fast path for plain decodes (`StepPlanner._schedule_plain_decodes`) plans exactly what its general
loop plans: random workloads drive two schedulers, one with the fast path and one without
(`plain_decode_run=False`), through the same calls, and every plan must be equal, step by step. The workloads
are the scheduler simulation's (fan-outs, forks, beam rows, priorities, aborts, preemption by recompute and
swap, a pool small enough that decodes run out of blocks mid-step, planning ahead) and an n-gram speculation
one (drafts for plain decodes, rows with drafts in flight); each run also checks that the fast path planned
most decodes and handed over to the general loop in the middle of the running queue. Pure Python."""

from __future__ import annotations

import copy
import random

import pytest

import tests.test_scheduler_simulation as simulation
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler, SchedulerLimits
from scheduler_svc.core.speculative_config import SpeculativeConfig
from scheduler_svc.core.step_planner import StepPlanner
from tests.fake_worker import FakeWorker
from tests.test_scheduler_speculative import PERIOD, cyclic_model


class TwinScheduler:
    """Forwards every call to a scheduler with the fast path (whose results it returns: its requests are the
    caller's) and to one without it (given copies of the requests it is handed), and asserts that both plan the
    same steps and report the same requests."""

    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager, **kwargs) -> None:
        self.reference = Scheduler(limits, copy.deepcopy(block_manager), plain_decode_run=False, **kwargs)
        self.fast = Scheduler(limits, block_manager, **kwargs)
        self.num_plans = 0

    def __getattr__(self, name):  # reads (limits, block_manager, counters) and calls with nothing to compare
        return getattr(self.fast, name)

    def add_request(self, request: Request) -> None:
        self.reference.add_request(copy.deepcopy(request))
        self.fast.add_request(request)

    def fork_request(self, parent_id: str, child: Request, num_shared_tokens: int) -> None:
        self.reference.fork_request(parent_id, copy.deepcopy(child), num_shared_tokens)
        self.fast.fork_request(parent_id, child, num_shared_tokens)

    def _both(self, name: str, *args):
        expected = getattr(self.reference, name)(*args)
        result = getattr(self.fast, name)(*args)
        assert result == expected, (name, args)
        return result

    def append_token(self, request_id: str, token_id: int) -> None:
        self._both("append_token", request_id, token_id)

    def abort_request(self, request_id: str) -> bool:
        return self._both("abort_request", request_id)

    def finish_request(self, request_id: str, reason) -> bool:
        return self._both("finish_request", request_id, reason)

    def release_request(self, request_id: str) -> bool:
        return self._both("release_request", request_id)

    def take_worker_cancels(self) -> list[str]:
        return self._both("take_worker_cancels")

    def schedule(self):
        expected = self.reference.schedule()
        output = self.fast.schedule()
        assert output == expected, f"plan {output.step_id} differs"
        self.num_plans += 1
        return output

    def update_from_output(self, output, sampled, accepted_drafts=None, proposed_drafts=None):
        expected = self.reference.update_from_output(output, sampled, accepted_drafts, proposed_drafts)
        updated = self.fast.update_from_output(output, sampled, accepted_drafts, proposed_drafts)
        assert [r.request_id for r in updated] == [r.request_id for r in expected]
        for mine, theirs in zip(updated, expected):
            assert (mine.output_token_ids, mine.num_computed_tokens, mine.status) == (
                theirs.output_token_ids, theirs.num_computed_tokens, theirs.status)
        return updated


class FastPathUse:
    """Over every fast-path call: decodes and idle requests it took, and calls that left part of a non-empty
    running queue to the general loop after taking some (the hand-over in the middle)."""

    def __init__(self, monkeypatch) -> None:
        self.num_taken = self.num_handovers = 0
        original = StepPlanner._schedule_plain_decodes

        def counted(planner, in_progress):
            index = original(planner, in_progress)
            self.num_taken += index
            self.num_handovers += 0 < index < len(planner._state.running)
            return index

        monkeypatch.setattr(StepPlanner, "_schedule_plain_decodes", counted)


@pytest.mark.parametrize(("preemption_mode", "seed", "steps_in_flight", "prefix_caching"), [
    ("recompute", 31, 1, True), ("swap", 32, 2, True), ("recompute", 36, 3, False), ("swap", 34, 3, True)])
def test_simulated_workloads_plan_the_same_with_and_without_the_fast_path(
        monkeypatch, preemption_mode, seed, steps_in_flight, prefix_caching):
    twins = []

    def twin(limits, manager, **kwargs):
        twins.append(TwinScheduler(limits, manager, **kwargs))
        return twins[-1]

    monkeypatch.setattr(simulation, "Scheduler", twin)
    use = FastPathUse(monkeypatch)
    engine, scheduler, num_swap_outs, num_copies = simulation.run_simulation(
        600, preemption_mode, prefix_caching, seed, max_steps_in_flight=steps_in_flight)
    assert scheduler.num_plans > 1000 and scheduler.num_preemptions > 10 and engine.num_forks > 100
    assert use.num_taken > 5000 and use.num_handovers > 500


@pytest.mark.parametrize(("seed", "speculative", "steps_in_flight", "preemption_mode", "token_budget", "max_prompt_len"), [
    (41, True, 1, "recompute", 40, 24), (42, True, 3, "swap", 40, 24), (43, False, 3, "recompute", 40, 24),
    (44, False, 2, "swap", 40, 24), (45, False, 2, "recompute", 3, 2)])
def test_decode_heavy_workloads_plan_the_same_with_and_without_the_fast_path(
        monkeypatch, seed, speculative, steps_in_flight, preemption_mode, token_budget, max_prompt_len):
    """Mostly decodes, planned ahead as the engine does (up to `max_steps_ahead`), with what can interrupt a run
    of them: forks of plain running requests (the parent's next decode writes a shared block: copy-on-write),
    n-gram drafts (the cyclic model makes them come true, or not after its token 99; requests with stop
    strings are never drafted), a pool that runs out of blocks mid-step, a token budget smaller than the
    decodes (3 tokens, for short prompts), arrivals and aborts."""
    use = FastPathUse(monkeypatch)
    rng = random.Random(seed)
    block_size, num_gpu_blocks, num_cpu_blocks = 4, 40, 12
    limits = SchedulerLimits(10, token_budget, 96, preemption_mode=preemption_mode)
    scheduler = TwinScheduler(limits, BlockManager(block_size, num_gpu_blocks, num_cpu_blocks),
                              max_steps_in_flight=steps_in_flight,
                              speculative=SpeculativeConfig(3, 3, 1, 6) if speculative else None)
    worker = FakeWorker(block_size, num_gpu_blocks, num_cpu_blocks, model=cyclic_model)
    in_flight: list[tuple] = []
    submitted: list[str] = []
    num_drafted = num_copies = 0  # copies: of a block shared with a fork, by a row the worker holds
    for index in range(1500):
        if rng.random() < 0.25:
            prompt = [rng.choice(PERIOD + [99, 40, 41]) for _ in range(rng.randint(1, max_prompt_len))]
            params = SamplingParams(max_tokens=rng.randint(1, 60), seed=index,
                                    stop=("x",) if rng.random() < 0.2 else ())
            submitted.append(f"q{index}")
            scheduler.add_request(Request(submitted[-1], prompt, params, eos_token_ids=(0,)))
        running = [r for rid in submitted[-40:] if (r := scheduler.get_request(rid)) and r.status is RequestStatus.RUNNING]
        parent = rng.choice(running) if running and rng.random() < 0.1 else None
        if parent is not None:
            child = Request(f"{parent.request_id}.{index}", list(parent.prompt_token_ids), parent.sampling_params,
                            parent.eos_token_ids, output_token_ids=list(parent.output_token_ids))
            num_shared = min(parent.num_computed_tokens, child.num_tokens - 1)
            if num_shared > 0 and not parent.draft_token_ids:
                submitted.append(child.request_id)
                scheduler.fork_request(parent.request_id, child, num_shared)
        if rng.random() < 0.02 and submitted:
            scheduler.abort_request(rng.choice(submitted))  # False once it finished
        if len(in_flight) < scheduler.max_steps_ahead():
            output = scheduler.schedule()
            num_drafted += sum(bool(data.draft_token_ids) for data in output.scheduled_requests)
            num_copies += sum(bool(data.replaced_blocks) for data in output.scheduled_requests)
            sampled = worker.execute(output)
            if output.total_num_scheduled_tokens:
                in_flight.append((output, sampled, dict(worker.accepted_drafts)))
                if len(in_flight) < scheduler.max_steps_ahead():
                    continue
        if in_flight:
            scheduler.update_from_output(*in_flight.pop(0))
        scheduler.block_manager.check_invariants()
    assert num_copies > 5 and (scheduler.num_preemptions > 100 or token_budget < 40)  # few rows fit the small one
    assert num_drafted > 50 if speculative else num_drafted == 0
    assert use.num_taken > 3000 and use.num_handovers > 100
