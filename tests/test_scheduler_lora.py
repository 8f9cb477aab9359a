"""Multi-LoRA in the scheduler: the prefix cache never shares a block between adapters (or an adapter and the base
model, whose keys are unchanged), a step never holds more distinct adapters than max_loras (others wait in queue
order and all finish), and a request keeps its adapter slot when it is sent again after a preemption. Pure
Python, on the fake worker."""

from __future__ import annotations

import zlib

from scheduler_svc.core.block_hash import adapter_root_key, chain_block_key
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import Scheduler, SchedulerLimits
from tests.fake_worker import FakeWorker
from tests.test_scheduler import EOS, make_request, step

PROMPT = list(range(600, 618))  # 4 full blocks of 4, then 2 tokens
SLOTS = {None: 0, "a": 1, "b": 2, "c": 3}


def lora_request(request_id: str, lora_name: str | None, prompt=PROMPT, max_tokens=3) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, seed=3), (EOS,),
                   lora_name=lora_name, lora_slot=SLOTS[lora_name])


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
    assert new.lora_slot == request.lora_slot
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
    assert chain_block_key(adapter_root_key("a"), PROMPT[:4]) in keys
    assert len({keys[chain_block_key(root, PROMPT[:4])] for root in
                (None, adapter_root_key("a"), adapter_root_key("b"))}) == 3  # three different blocks


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
    for index, output in enumerate(outputs):
        names = {scheduler_lora(order, r.request_id) for r in (*output.new_requests, *output.scheduled_requests)}
        assert len(names - {None}) <= 2, (index, names)
        for new in output.new_requests:
            started.setdefault(new.request_id, index)
            assert new.lora_slot == SLOTS[scheduler_lora(order, new.request_id)]
    assert started["c1"] > started["b1"] and started["base2"] >= started["c1"] and started["a2"] >= started["c1"]
    assert set(started) == {request_id for request_id, _ in order}


def scheduler_lora(order, request_id):
    return dict(order)[request_id]


def test_a_preempted_request_is_sent_again_with_its_adapter_slot():
    scheduler, worker = make_lora_scheduler(max_loras=2, num_gpu_blocks=6, max_num_seqs=4)
    scheduler.add_request(lora_request("b", "b", prompt=list(range(100, 108)), max_tokens=12))
    scheduler.add_request(lora_request("c", "c", prompt=list(range(200, 208)), max_tokens=12))
    resent = []
    while scheduler.has_unfinished_requests():
        output, _ = step(scheduler, worker)
        resent += [(new.request_id, new.lora_slot) for new in output.new_requests]
    assert scheduler.num_preemptions > 0
    assert len(resent) > 2 and all(slot == SLOTS[request_id] for request_id, slot in resent)


def test_base_model_requests_ignore_max_loras():
    scheduler, worker = make_lora_scheduler(max_loras=1)
    scheduler.add_request(lora_request("a1", "a"))
    for index in range(3):
        scheduler.add_request(make_request(f"base{index}"))
    output, _ = step(scheduler, worker)
    assert len(output.new_requests) == 4
