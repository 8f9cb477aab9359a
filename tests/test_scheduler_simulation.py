"""The real Scheduler and BlockManager driven for thousands of random requests against the fake worker, with an
engine stand-in that does what the engine's request groups do: single sequences, parallel sampling (a
prefill-only root, then n forked children), beam search (beam rows in lockstep: fork, append_token, release),
priorities, stop strings and aborts at any moment. A pool small enough to force preemption, by recompute and by
swap. Checked after every step: block-manager invariants, worker rows in sync with the scheduler, no shared
block written (copy-on-write), every cached block holding what its key says; at the end: every request finished
or aborted with the tokens its seed dictates, every block free, and no request starved. Pure Python."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import pytest

from scheduler_svc.core.block_hash import chain_block_key
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from scheduler_svc.core.request_queue import scheduling_key
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from tests.fake_worker import VOCAB_SIZE, FakeWorker, beam_candidates_at, expected_output

EOS = 0
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
MAX_NUM_SEQS = 12
# No starvation, measured as steps in a row a request has work and is not scheduled. The earliest request with
# work in the scheduler's order (step_planner.py) waits only while requests after it, which run in parallel
# and each need at most MAX_MODEL_LEN tokens of work, release what it needs (seen: under 10 steps). Any other
# request also waits for everything before it: with strict priorities a worse priority waits while better ones
# keep coming, which stays bounded here because the arrivals (about 80% of what the pool serves, in bursts)
# leave lulls (seen: under 800 steps).
MAX_HEAD_OF_LINE_WAIT = 2 * MAX_MODEL_LEN
MAX_WAIT = 2000


@dataclass
class Group:
    """One client request: a single sequence, a fan-out (root then children), or a beam search."""

    kind: str
    members: list[str]  # live scheduler request ids
    max_tokens: int
    width: int = 1
    candidates: dict[str, list[int]] = field(default_factory=dict)  # beam rows that reported this round
    done: bool = False


class EngineStandIn:
    def __init__(self, rng: random.Random, scheduler: Scheduler, worker: FakeWorker) -> None:
        self.rng = rng
        self.scheduler = scheduler
        self.worker = worker
        self.groups: list[Group] = []
        self.owner: dict[str, Group] = {}  # live scheduler request id -> its group
        self.live: dict[str, Request] = {}  # every member of an unfinished group
        self.sequences: list[Request] = []  # every sampling request, for the output check
        self.cut_short: set[str] = set()
        self.system_prompts = [[rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randint(4, 36))] for _ in range(6)]
        self.key_tokens: dict[bytes, tuple[int, ...]] = {}  # every full-block key any request can produce
        self.keys_of: dict[str, list[bytes]] = {}
        self.num_forks = self.num_appends = self.num_beam_groups = self.num_fanouts = 0
        self.max_head_wait = 0  # longest run of steps the earliest request with work went unscheduled
        self.max_wait = 0  # the same for any request with work
        self._waits: dict[str, int] = {}  # request id -> steps in a row it had work and was not scheduled
        # Planned and run, result not applied yet (the scheduler plans step N+1 before N's result applies).
        self.in_flight: list[tuple[SchedulerOutput, dict[str, int], dict[str, list[int]]]] = []
        self.beam_candidates: dict[str, list[int]] = {}  # of the step whose result is being applied

    # ---- the engine's side ---------------------------------------------------------------------------

    def submit(self, index: int) -> None:
        rng = self.rng
        prompt = rng.choice(self.system_prompts)[:] if rng.random() < 0.6 else []
        prompt += [rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randint(0 if prompt else 1, 20))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 40),
            seed=rng.getrandbits(32),
            stop_token_ids=tuple(rng.sample(range(1, VOCAB_SIZE), rng.choice([0, 0, 1]))),
            ignore_eos=rng.random() < 0.3,
        )
        request = Request(f"req-{index}", prompt, params, (EOS,), priority=rng.choice([0, 1, 1, 2]))
        kind = rng.choices(["single", "fanout", "beam"], [6, 2, 1])[0]
        group = Group(kind, [], params.max_tokens)
        self.groups.append(group)
        if kind == "fanout":
            self.num_fanouts += 1
            group.width = rng.randint(2, 4)
            if request.num_prompt_tokens == 1:
                self._fork_children(group, request, parent_id=None)
                return
            request.prefill_only = True
        elif kind == "beam":
            self.num_beam_groups += 1
            group.width = rng.randint(1, 3)
            group.max_tokens = min(params.max_tokens, MAX_MODEL_LEN - request.num_prompt_tokens)
            request.num_beam_candidates = 2 * group.width
        else:
            self.sequences.append(request)
        self._join(group, request)
        self.scheduler.add_request(request)

    def _join(self, group: Group, request: Request) -> None:
        group.members.append(request.request_id)
        self.owner[request.request_id] = group
        self.live[request.request_id] = request

    def _leave(self, group: Group, request_id: str) -> None:
        group.members.remove(request_id)
        del self.owner[request_id]
        del self.live[request_id]
        group.candidates.pop(request_id, None)
        group.done = not group.members

    def _fork_children(self, group: Group, root: Request, parent_id: str | None) -> None:
        for i in range(group.width):
            params = dataclasses.replace(root.sampling_params, seed=root.sampling_params.seed + 7919 * (i + 1))
            child = Request(f"{root.request_id}#{i}", list(root.prompt_token_ids), params, (EOS,),
                            priority=root.priority)
            self.sequences.append(child)
            self._join(group, child)
            if parent_id is None:
                self.scheduler.add_request(child)
            else:
                self.scheduler.fork_request(parent_id, child, root.num_prompt_tokens - 1)
                self.num_forks += 1

    def on_update(self, request: Request) -> None:
        group = self.owner.get(request.request_id)
        if group is None:
            return
        if request.prefill_only:
            assert request.status is RequestStatus.RUNNING
            assert request.num_computed_tokens == request.num_prompt_tokens - 1
            self._fork_children(group, request, parent_id=request.request_id)
            assert self.scheduler.release_request(request.request_id)
            self._leave(group, request.request_id)
        elif request.num_beam_candidates:
            assert request.request_id not in group.candidates, "reported twice in one round"
            candidates = self.beam_candidates[request.request_id]
            assert candidates == beam_candidates_at(request.sampling_params.seed, request.num_tokens,
                                                    request.num_beam_candidates)
            group.candidates[request.request_id] = candidates
            if all(member in group.candidates for member in group.members):
                self._decide_beam_round(group)
        elif request.status.is_finished:
            self._leave(group, request.request_id)
        elif self.rng.random() < 0.005:  # the engine found a stop string
            assert self.scheduler.finish_request(request.request_id, FinishReason.STOP)
            self.cut_short.add(request.request_id)
            self._leave(group, request.request_id)

    def _decide_beam_round(self, group: Group) -> None:
        """Random choices in place of beam scores, with the beam search's shape: forks first, then appends,
        then releases; at most `width` beams run on; a beam ends at its length limit."""
        scheduler, rng = self.scheduler, self.rng
        beams = [scheduler.get_request(member) for member in group.members]
        generated = beams[0].num_output_tokens
        assert all(beam.num_output_tokens == generated for beam in beams), "beams out of lockstep"
        candidates, group.candidates = group.candidates, {}
        if generated + 1 >= group.max_tokens or rng.random() < 0.08:
            for beam in beams:
                assert scheduler.release_request(beam.request_id)
                self._leave(group, beam.request_id)
            return
        budget = group.width
        chosen: list[tuple[Request, list[int]]] = []
        for beam in beams:
            take = min(budget, rng.choice([0, 1, 1, 2]))
            budget -= take
            chosen.append((beam, rng.sample(candidates[beam.request_id], take)))
        if budget == group.width:  # nobody chosen: keep the first beam's best
            chosen[0] = (beams[0], candidates[beams[0].request_id][:1])
        for beam, tokens in chosen:
            for token in tokens[1:]:
                self.num_forks += 1
                child = Request(f"{beam.request_id}.{self.num_forks}", list(beam.prompt_token_ids),
                                beam.sampling_params, beam.eos_token_ids,
                                output_token_ids=list(beam.output_token_ids) + [token],
                                num_beam_candidates=beam.num_beam_candidates)
                scheduler.fork_request(beam.request_id, child, beam.num_computed_tokens)
                self._join(group, child)
        for beam, tokens in chosen:
            if tokens:
                scheduler.append_token(beam.request_id, tokens[0])
                self.num_appends += 1
            else:
                assert scheduler.release_request(beam.request_id)
                self._leave(group, beam.request_id)

    def abort_group(self, group: Group) -> None:
        for member in list(group.members):
            assert self.scheduler.abort_request(member)
            self.cut_short.add(member)
            self._leave(group, member)

    def random_live_group(self) -> Group | None:
        return self.owner[self.rng.choice(list(self.live))] if self.live else None

    # ---- one step, checked ---------------------------------------------------------------------------

    def step(self) -> SchedulerOutput:
        scheduler, worker, rng = self.scheduler, self.worker, self.rng
        with_work = [r for r in self._live_requests() if scheduler.num_tokens_to_compute(r)]
        output = scheduler.schedule()
        scheduled = output.num_scheduled_tokens()
        self._track_waits(with_work, scheduled)
        assert output.total_num_scheduled_tokens <= scheduler.limits.max_num_batched_tokens
        assert not set(output.preempted_request_ids) & set(scheduled)
        self._check_shared_writes(scheduled)
        self._remember_keys(scheduled)
        sampled = worker.execute(output)  # the worker runs plans in order, as soon as they arrive
        self._check_cached_blocks()
        running = {r.request_id for r in self._live_requests() if r.status is RequestStatus.RUNNING}
        assert set(worker.rows) <= running and len(worker.rows) <= MAX_NUM_SEQS
        if output.total_num_scheduled_tokens:
            self.in_flight.append((output, sampled, dict(worker.beam_candidates)))
            if scheduler.num_steps_in_flight < scheduler.max_steps_in_flight:
                return output  # plan the next step before this one's result applies
        if self.in_flight:
            self.apply_oldest_result()
        scheduler.block_manager.check_invariants()
        return output

    def apply_oldest_result(self) -> None:
        output, sampled, self.beam_candidates = self.in_flight.pop(0)
        scheduled = output.num_scheduled_tokens()
        if scheduled and self.rng.random() < 0.005:  # an abort lands while the step runs
            victim = self.rng.choice([self.owner[rid] for rid in scheduled if rid in self.owner] or [None])
            if victim is not None:
                self.abort_group(victim)
        updated = self.scheduler.update_from_output(output, sampled)
        for request in updated:
            if request.status is RequestStatus.RUNNING:  # the worker may hold tokens of steps still in flight
                row_tokens, known = self.worker.rows[request.request_id].token_ids, request.all_token_ids
                assert row_tokens[: len(known)] == known
                assert len(row_tokens) - len(known) <= request.num_pending_tokens
        for request in updated:
            self.on_update(request)

    def _live_requests(self):
        return self.live.values()

    def _track_waits(self, with_work: list[Request], scheduled: dict[str, int]) -> None:
        waits = {r.request_id: 0 if r.request_id in scheduled else self._waits.get(r.request_id, 0) + 1
                 for r in with_work}
        self._waits = waits
        if not with_work:
            return
        head = min(with_work, key=scheduling_key)
        self.max_head_wait = max(self.max_head_wait, waits[head.request_id])
        self.max_wait = max(self.max_wait, *waits.values())
        assert waits[head.request_id] <= MAX_HEAD_OF_LINE_WAIT, f"{head.request_id} is first in line but starves"

    def _check_shared_writes(self, scheduled: dict[str, int]) -> None:
        """Copy-on-write, from the block manager's side (it also sees forked children the worker does not):
        a token may go into a block someone else holds only if that holder has the same token there."""
        manager = self.scheduler.block_manager
        shared_writes = []
        for request_id, num_tokens in scheduled.items():
            request = self.scheduler.get_request(request_id)
            table, tokens = manager.block_table(request_id), request.all_token_ids
            # Counts advanced when the step was planned: this step writes the last num_tokens computed ones.
            for position in range(request.num_computed_tokens - num_tokens, request.num_computed_tokens):
                block_id = table[position // BLOCK_SIZE]
                if manager.gpu_ref_count(block_id) > 1:
                    shared_writes.append((request_id, block_id, position % BLOCK_SIZE, tokens[position]))
        if not shared_writes:
            return
        holders = {}
        for other in self._live_requests():
            for index, block_id in enumerate(manager.block_table(other.request_id)):
                holders.setdefault(block_id, []).append((other, index))
        for writer_id, block_id, slot, token in shared_writes:
            for other, index in holders[block_id]:
                if other.request_id != writer_id:
                    position = index * BLOCK_SIZE + slot
                    assert position < other.num_tokens and other.all_token_ids[position] == token, (
                        f"{writer_id} writes block {block_id} shared with {other.request_id}"
                    )

    def _remember_keys(self, scheduled: dict[str, int]) -> None:
        """Every key the block manager can register comes from a scheduled request's full blocks."""
        for request_id in scheduled:
            request = self.scheduler.get_request(request_id)
            keys = self.keys_of.setdefault(request_id, [])
            tokens = request.all_token_ids
            while (len(keys) + 1) * BLOCK_SIZE <= len(tokens):
                block = tuple(tokens[len(keys) * BLOCK_SIZE : (len(keys) + 1) * BLOCK_SIZE])
                keys.append(chain_block_key(keys[-1] if keys else None, block))
                self.key_tokens[keys[-1]] = block

    def _check_cached_blocks(self) -> None:
        for key, block_id in self.scheduler.block_manager.cached_blocks().items():
            assert tuple(self.worker.gpu_blocks[block_id]) == self.key_tokens[key], f"cached block {block_id} stale"


def run_simulation(
    num_requests: int, preemption_mode: str, enable_prefix_caching: bool, seed: int, enable_chunked_prefill=True,
    max_steps_in_flight: int = 1,
):
    rng = random.Random(seed)
    num_gpu_blocks, num_cpu_blocks = 40, 16
    limits = SchedulerLimits(
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=rng.choice([16, 24, 32, 48]) if enable_chunked_prefill else MAX_MODEL_LEN,
        max_model_len=MAX_MODEL_LEN,
        preemption_mode=preemption_mode,
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    manager = BlockManager(BLOCK_SIZE, num_gpu_blocks, num_cpu_blocks, enable_prefix_caching=enable_prefix_caching)
    scheduler = Scheduler(limits, manager, max_steps_in_flight=max_steps_in_flight)
    worker = FakeWorker(BLOCK_SIZE, num_gpu_blocks, num_cpu_blocks)
    engine = EngineStandIn(rng, scheduler, worker)
    num_swap_outs = num_copies = 0
    next_index = 0
    while next_index < num_requests or scheduler.has_unfinished_requests():
        num_arrivals = rng.choice([0] * 19 + [1, 1, 1, 2])  # ~80% of what the pool serves, in bursts
        for _ in range(min(num_arrivals, num_requests - next_index)):
            engine.submit(next_index)
            next_index += 1
        if rng.random() < 0.02 and engine.live:
            engine.abort_group(engine.random_live_group())
        output = engine.step()
        num_swap_outs += len(output.swap_out)
        num_copies += len(output.copy)

    while engine.in_flight:  # results of steps planned for requests that have all finished since
        engine.apply_oldest_result()
    worker.execute(scheduler.schedule())  # reports the last finished ids; the worker drops every row
    assert worker.rows == {}
    assert all(group.done for group in engine.groups)
    assert manager.num_free_gpu_blocks == num_gpu_blocks and manager.num_used_gpu_blocks == 0
    assert manager.num_free_cpu_blocks == num_cpu_blocks
    assert engine.max_wait <= MAX_WAIT, engine.max_wait
    for request in engine.sequences:
        assert request.status.is_finished, request.request_id
        expected = expected_output(request, MAX_MODEL_LEN)
        if request.request_id in engine.cut_short:
            assert request.output_token_ids == expected[: request.num_output_tokens], request.request_id
        else:
            assert request.output_token_ids == expected, request.request_id
    return engine, scheduler, num_swap_outs, num_copies


@pytest.mark.parametrize(("preemption_mode", "seed"), [("recompute", 11), ("swap", 12)])
def test_simulation_with_prefix_caching(preemption_mode, seed):
    engine, scheduler, num_swap_outs, num_copies = run_simulation(5000, preemption_mode, True, seed)
    assert scheduler.num_preemptions > 100
    assert num_copies > 100 and engine.num_forks > 1000 and engine.num_appends > 500
    assert scheduler.prefix_cache_hit_rate > 0.1
    if preemption_mode == "swap":
        assert num_swap_outs > 0


def test_simulation_without_prefix_caching():
    engine, scheduler, _, num_copies = run_simulation(1500, "recompute", False, 13)
    assert scheduler.num_preemptions > 30 and num_copies > 30
    assert scheduler.prefix_cache_query_tokens == 0 and scheduler.prefix_cache_hit_rate == 0.0


def test_simulation_without_chunked_prefill():
    engine, scheduler, num_swap_outs, _ = run_simulation(1000, "swap", True, 14, enable_chunked_prefill=False)
    assert scheduler.num_preemptions > 30 and num_swap_outs > 0


@pytest.mark.parametrize(("preemption_mode", "seed", "steps_in_flight"), [
    ("recompute", 15, 2), ("swap", 16, 2), ("recompute", 21, 3), ("swap", 22, 3)])
def test_simulation_planning_each_step_while_the_previous_one_runs(preemption_mode, seed, steps_in_flight):
    """Async scheduling: step N+1 (and N+2) are planned (and run by the worker) before step N's result
    applies. Same checks: rows, copy-on-write, cached blocks, every token the seed dictates, nothing starves
    or leaks."""
    engine, scheduler, num_swap_outs, num_copies = run_simulation(2000, preemption_mode, True, seed,
                                                                  max_steps_in_flight=steps_in_flight)
    assert scheduler.num_preemptions > 50 and num_copies > 50 and engine.num_forks > 500
    assert scheduler.prefix_cache_hit_rate > 0.1
    if preemption_mode == "swap":
        assert num_swap_outs > 0
