"""Multi-LoRA in the scheduler: the prefix cache never shares a block between adapters (or an adapter and the base
model, whose keys are unchanged), a step never holds more distinct adapters than max_loras (others wait in queue
order and all finish), and the GPU slots (lora_slots.py): every row's slot holds its adapter in every step (an
adapter in use is never evicted, LRU otherwise), a preempted request resumes in a slot holding its adapter, and
a worker loss has the slots loaded again. Pure Python, on the fake worker."""

from __future__ import annotations

import zlib

import pytest

from scheduler_svc.core.block_hash import adapter_root_key, chain_block_key
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.lora_slots import LoraLoadData, LoraSlots
from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler, SchedulerLimits
from tests.fake_worker import FakeWorker
from tests.test_scheduler import EOS, make_request, step

PROMPT = list(range(600, 618))  # 4 full blocks of 4, then 2 tokens


def lora_request(request_id: str, lora_name: str | None, prompt=PROMPT, max_tokens=3, generation=0) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, seed=3), (EOS,),
                   lora_name=lora_name, lora_path="" if lora_name is None else f"/adapters/{lora_name}",
                   lora_generation=generation)


class SlotMirror:
    """What the worker's slots hold, from the plans' lora_loads, and each row's slot: `check` asserts that every
    row of a step runs with a slot holding its own adapter (loaded in this plan or earlier, never overwritten
    since), and that a step holds at most max_loras adapters."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.held: dict[int, str] = {}
        self.row_slot: dict[str, int] = {}
        self.loads: list[LoraLoadData] = []

    def check(self, output, lora_of) -> None:
        for load in output.lora_loads:
            assert 1 <= load.slot <= self.max_loras and load.path == f"/adapters/{load.name}"
            self.held[load.slot] = load.name
            self.loads.append(load)
        for new in output.new_requests:
            self.row_slot[new.request_id] = new.lora_slot
            assert (new.lora_slot == 0) == (lora_of(new.request_id) is None)
        names = set()
        for request_id in [*(n.request_id for n in output.new_requests),
                           *(s.request_id for s in output.scheduled_requests)]:
            if lora_of(request_id) is not None:
                assert self.held[self.row_slot[request_id]] == lora_of(request_id), (request_id, self.held)
                names.add(lora_of(request_id))
        assert len(names) <= self.max_loras


def make_lora_scheduler(max_loras=1, num_gpu_blocks=64, max_num_seqs=8) -> tuple[Scheduler, FakeWorker]:
    limits = SchedulerLimits(max_num_seqs, 64, 256, max_loras=max_loras)
    manager = BlockManager(4, num_gpu_blocks, 0, enable_prefix_caching=True)
    return Scheduler(limits, manager), FakeWorker(4, num_gpu_blocks, 0)


def run_to_completion(scheduler, worker, outputs=None) -> None:
    while scheduler.has_unfinished_requests():
        output, _ = step(scheduler, worker)
        if outputs is not None:
            outputs.append(output)


def first_step_computed(scheduler, worker, request) -> int:
    scheduler.add_request(request)
    output, _ = step(scheduler, worker)
    (new,) = output.new_requests
    assert (new.lora_slot > 0) == (request.lora_name is not None)
    run_to_completion(scheduler, worker)
    return new.num_computed_tokens


def test_the_prefix_cache_never_shares_blocks_across_adapters():
    scheduler, worker = make_lora_scheduler(max_loras=3)
    assert first_step_computed(scheduler, worker, lora_request("a1", "a")) == 0
    assert first_step_computed(scheduler, worker, lora_request("b1", "b")) == 0  # same prompt, other adapter
    assert first_step_computed(scheduler, worker, lora_request("base1", None)) == 0  # the base model's own
    assert first_step_computed(scheduler, worker, lora_request("a2", "a")) == 16  # its own adapter's blocks
    assert first_step_computed(scheduler, worker, lora_request("b2", "b")) == 16
    assert first_step_computed(scheduler, worker, lora_request("base2", None)) == 16
    keys = scheduler.block_manager.cached_blocks()
    assert chain_block_key(None, PROMPT[:4]) in keys  # the base model's keys are those without LoRA
    assert chain_block_key(adapter_root_key("a", "/adapters/a"), PROMPT[:4]) in keys
    assert len({keys[chain_block_key(root, PROMPT[:4])] for root in
                (None, adapter_root_key("a", "/adapters/a"), adapter_root_key("b", "/adapters/b"))}) == 3


def test_a_step_never_holds_more_adapters_than_max_loras_and_the_others_wait_in_order():
    """a, b, c (one adapter each) and base requests arrive together with max_loras 2: c waits for a or b to
    finish, and nothing behind c overtakes it, not even the base model's request; everyone finishes."""
    scheduler, worker = make_lora_scheduler(max_loras=2)
    order = [("a1", "a"), ("b1", "b"), ("base1", None), ("c1", "c"), ("base2", None), ("a2", "a")]
    for request_id, lora_name in order:
        prompt = [zlib.crc32(request_id.encode()) % 500 + i for i in range(6)]
        scheduler.add_request(lora_request(request_id, lora_name, prompt=prompt, max_tokens=2 + 3 * (lora_name == "a")))
    outputs = []
    run_to_completion(scheduler, worker, outputs)
    started = {}
    mirror = SlotMirror(max_loras=2)
    for index, output in enumerate(outputs):
        mirror.check(output, dict(order).get)
        for new in output.new_requests:
            started.setdefault(new.request_id, index)
    assert started["c1"] > started["b1"] and started["base2"] >= started["c1"] and started["a2"] >= started["c1"]
    assert set(started) == {request_id for request_id, _ in order}


def scheduler_lora(order, request_id):
    return dict(order)[request_id]


def test_a_preempted_request_is_sent_again_in_a_slot_holding_its_adapter():
    scheduler, worker = make_lora_scheduler(max_loras=2, num_gpu_blocks=6, max_num_seqs=4)
    scheduler.add_request(lora_request("b", "b", prompt=list(range(100, 108)), max_tokens=12))
    scheduler.add_request(lora_request("c", "c", prompt=list(range(200, 208)), max_tokens=12))
    mirror, num_new = SlotMirror(max_loras=2), 0
    while scheduler.has_unfinished_requests():
        output, _ = step(scheduler, worker)
        mirror.check(output, lambda request_id: request_id)
        num_new += len(output.new_requests)
    assert scheduler.num_preemptions > 0 and num_new > 2
    assert len(mirror.loads) == 2  # both adapters stayed in their slots: nothing was loaded twice


def test_one_slot_serves_three_adapters_in_arrival_order_each_loaded_when_its_turn_comes():
    """max_loras 1: a, b, c, then a again arrive together; each waits for the one before to finish (no
    overtaking, the base request behind them too), the one slot is reloaded for each, and a's second request
    reloads a (b and c took the slot in between)."""
    scheduler, worker = make_lora_scheduler(max_loras=1)
    order = [("a1", "a"), ("b1", "b"), ("c1", "c"), ("base1", None), ("a2", "a")]
    for index, (request_id, lora_name) in enumerate(order):
        scheduler.add_request(lora_request(request_id, lora_name, prompt=[50 * index + i for i in range(1, 7)]))
    mirror, started, outputs = SlotMirror(max_loras=1), {}, []
    run_to_completion(scheduler, worker, outputs)
    for index, output in enumerate(outputs):
        mirror.check(output, dict(order).get)
        for new in output.new_requests:
            started.setdefault(new.request_id, index)
    assert [load.name for load in mirror.loads] == ["a", "b", "c", "a"]
    assert started["a1"] < started["b1"] < started["c1"] <= started["base1"] <= started["a2"]
    assert set(started) == {request_id for request_id, _ in order}


def test_a_worker_loss_has_the_slots_loaded_again():
    scheduler, worker = make_lora_scheduler(max_loras=2)
    scheduler.add_request(lora_request("a1", "a", max_tokens=8))
    output, _ = step(scheduler, worker)
    assert [load.name for load in output.lora_loads] == ["a"]
    output, _ = step(scheduler, worker)
    assert not output.lora_loads  # a sits in its slot
    scheduler.recover_from_worker_loss(BlockManager(4, 64, 0, enable_prefix_caching=True))
    worker = FakeWorker(4, 64, 0)
    output, _ = step(scheduler, worker)
    assert [(load.slot, load.name) for load in output.lora_loads] == [(1, "a")]
    assert [new.lora_slot for new in output.new_requests] == [1]
    run_to_completion(scheduler, worker)


def test_the_slot_lru_evicts_the_least_recently_used_adapter_no_running_request_uses():
    slots = LoraSlots(2)
    a, b, c, d = (("a", "/a", 0), ("b", "/b", 0), ("c", "/c", 0), ("d", "/d", 0))
    assert slots.assign(a, {a}) == (1, LoraLoadData(1, "a", "/a"))
    assert slots.assign(b, {a, b}) == (2, LoraLoadData(2, "b", "/b"))
    assert slots.assign(a, {a}) == (1, None)  # held: no load; a is now the most recently used
    assert slots.assign(c, {c}) == (2, LoraLoadData(2, "c", "/c"))  # b was the least recently used
    assert slots.assign(d, {a, d}) == (2, LoraLoadData(2, "d", "/d"))  # c is older, but a is in use: not a
    assert slots.slot_of(a) == 1 and slots.slot_of(c) is None
    with pytest.raises(RuntimeError, match="no LoRA slot"):  # same name, another directory: another adapter
        slots.assign(("a", "/elsewhere", 0), {a, d})
    with pytest.raises(RuntimeError, match="no LoRA slot"):  # same name and directory, loaded again: another
        slots.assign(("a", "/a", 1), {a, d})
    slots.forget()
    assert slots.assign(a, {a}) == (1, LoraLoadData(1, "a", "/a"))
    assert slots.assign(("a", "/a", 2), {("a", "/a", 2)}) == (2, LoraLoadData(2, "a", "/a", 2))


def test_an_adapter_loaded_again_under_its_name_and_path_shares_no_blocks_and_is_loaded_into_a_slot_again():
    """A reload is a new generation (api/lora_registry.py): its files may hold other weights, so neither the
    prefix cache nor the slot of the earlier generation may serve it."""
    scheduler, worker = make_lora_scheduler(max_loras=2)
    assert first_step_computed(scheduler, worker, lora_request("a1", "a", generation=1)) == 0
    assert first_step_computed(scheduler, worker, lora_request("a2", "a", generation=1)) == 16
    scheduler.add_request(lora_request("a3", "a", generation=2))
    output, _ = step(scheduler, worker)
    assert [(load.name, load.path, load.generation) for load in output.lora_loads] == [("a", "/adapters/a", 2)]
    assert output.new_requests[0].num_computed_tokens == 0  # nothing of generation 1's KV
    run_to_completion(scheduler, worker)
    keys = scheduler.block_manager.cached_blocks()
    roots = [adapter_root_key("a", "/adapters/a", generation) for generation in (0, 1, 2)]
    assert len(set(roots)) == 3 and roots[0] == adapter_root_key("a", "/adapters/a")
    assert all(chain_block_key(root, PROMPT[:4]) in keys for root in roots[1:])


def test_base_model_requests_ignore_max_loras():
    scheduler, worker = make_lora_scheduler(max_loras=1)
    scheduler.add_request(lora_request("a1", "a"))
    for index in range(3):
        scheduler.add_request(make_request(f"base{index}"))
    output, _ = step(scheduler, worker)
    assert len(output.new_requests) == 4
