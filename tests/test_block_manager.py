"""BlockManager and BlockPool: block tables grow by whole blocks, allocation is all-or-nothing, swapping moves
a table between pools, and ref counts always equal the number of holders (unit tests + a hypothesis state
machine). Pure Python, no torch."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.block_pool import BlockPool
from scheduler_svc.request import Request
from scheduler_svc.sampling_params import SamplingParams


def make_request(request_id: str, num_computed_tokens: int = 0) -> Request:
    request = Request(request_id, [1, 2, 3], SamplingParams())
    request.num_computed_tokens = num_computed_tokens
    return request


def test_allocate_slots_grows_the_table_by_whole_blocks_and_returns_only_new_ones():
    manager = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0)
    request = make_request("a")
    first = manager.allocate_slots(request, 5)  # 5 tokens -> 2 blocks
    assert len(first) == 2 and manager.block_table("a") == first
    request.num_computed_tokens = 5
    assert manager.allocate_slots(request, 3) == []  # 8 tokens still fit in 2 blocks
    request.num_computed_tokens = 8
    grown = manager.allocate_slots(request, 1)
    assert len(grown) == 1 and manager.block_table("a") == first + grown
    assert manager.num_free_gpu_blocks == 5
    manager.check_invariants()


def test_allocate_slots_returns_none_and_allocates_nothing_when_the_pool_is_short():
    manager = BlockManager(block_size=4, num_gpu_blocks=3, num_cpu_blocks=0)
    manager.allocate_slots(make_request("a"), 8)
    assert manager.allocate_slots(make_request("b"), 5) is None
    assert manager.block_table("b") == [] and manager.num_free_gpu_blocks == 1
    assert manager.can_allocate(4) and not manager.can_allocate(5)
    manager.check_invariants()


def test_free_returns_every_block_and_ignores_requests_without_blocks():
    manager = BlockManager(block_size=2, num_gpu_blocks=4, num_cpu_blocks=4)
    manager.allocate_slots(make_request("a"), 7)
    manager.free("a")
    manager.free("never-seen")
    assert manager.num_free_gpu_blocks == 4 and manager.block_table("a") == []
    manager.check_invariants()


def test_swap_out_then_in_moves_the_table_between_pools():
    manager = BlockManager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=4)
    request = make_request("a", num_computed_tokens=0)
    gpu_before = manager.allocate_slots(request, 9)  # 3 blocks
    request.num_computed_tokens = 9

    moves_out = manager.swap_out("a")
    assert [gpu for gpu, _ in moves_out] == gpu_before
    cpu_blocks = [cpu for _, cpu in moves_out]
    assert len(set(cpu_blocks)) == 3
    assert manager.is_swapped("a") and manager.block_table("a") == []
    assert manager.num_free_gpu_blocks == 4 and manager.num_free_cpu_blocks == 1
    with pytest.raises(ValueError):
        manager.allocate_slots(request, 1)
    manager.check_invariants()

    assert manager.can_swap_in("a", num_tokens=12) and not manager.can_swap_in("a", num_tokens=17)
    moves_in = manager.swap_in("a")
    assert [cpu for cpu, _ in moves_in] == cpu_blocks  # table order kept
    assert manager.block_table("a") == [gpu for _, gpu in moves_in]
    assert manager.num_free_gpu_blocks == 1 and manager.num_free_cpu_blocks == 4
    assert not manager.is_swapped("a")
    manager.check_invariants()


def test_swap_out_refused_when_the_swap_pool_lacks_room():
    manager = BlockManager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=2)
    manager.allocate_slots(make_request("a"), 9)
    assert not manager.can_swap_out("a")
    with pytest.raises(ValueError):
        manager.swap_out("a")
    assert len(manager.block_table("a")) == 3
    manager.check_invariants()


def test_swap_in_refused_when_the_gpu_pool_lacks_room():
    manager = BlockManager(block_size=4, num_gpu_blocks=3, num_cpu_blocks=3)
    manager.allocate_slots(make_request("a"), 12)
    manager.swap_out("a")
    manager.allocate_slots(make_request("b"), 5)
    assert not manager.can_swap_in("a")
    with pytest.raises(ValueError):
        manager.swap_in("a")
    manager.free("a")  # frees the swap table
    assert manager.num_free_cpu_blocks == 3
    manager.check_invariants()


def test_pool_reuses_the_oldest_freed_block_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.release([b])
    pool.release([a])
    assert pool.allocate(2) == [b, a]


def test_pool_refuses_releasing_a_free_block():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.release([0])


def test_check_invariants_catches_a_table_holding_a_free_block():
    manager = BlockManager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=0)
    manager.allocate_slots(make_request("a"), 4)
    manager._gpu_tables["a"].append(manager._gpu_tables["a"][0])  # a block held twice, ref count 1
    with pytest.raises(AssertionError):
        manager.check_invariants()


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / free / swap-out / swap-in, checked against a model: each live request's
    computed token count and whether it is swapped out."""

    BLOCK_SIZE = 4

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(self.BLOCK_SIZE, num_gpu_blocks=12, num_cpu_blocks=6)
        self.requests: dict[str, Request] = {}
        self.swapped: set[str] = set()
        self.next_id = 0

    def blocks_for(self, request: Request) -> int:
        return -(-request.num_computed_tokens // self.BLOCK_SIZE)

    def on_gpu(self) -> list[str]:
        return sorted(set(self.requests) - self.swapped)

    @rule(num_tokens=st.integers(1, 30))
    def allocate(self, num_tokens):
        request = make_request(f"r{self.next_id}")
        self.next_id += 1
        free_before = self.manager.num_free_gpu_blocks
        new_blocks = self.manager.allocate_slots(request, num_tokens)
        if new_blocks is None:
            assert self.manager.num_free_gpu_blocks == free_before
            assert self.manager.block_table(request.request_id) == []
            return
        request.num_computed_tokens = num_tokens
        self.requests[request.request_id] = request
        assert len(new_blocks) == self.blocks_for(request)

    @precondition(lambda self: self.on_gpu())
    @rule(data=st.data(), num_tokens=st.integers(1, 9))
    def append(self, data, num_tokens):
        request = self.requests[data.draw(st.sampled_from(self.on_gpu()))]
        table_before = self.manager.block_table(request.request_id)
        new_blocks = self.manager.allocate_slots(request, num_tokens)
        if new_blocks is None:
            assert self.manager.block_table(request.request_id) == table_before
            return
        request.num_computed_tokens += num_tokens
        assert self.manager.block_table(request.request_id) == table_before + new_blocks

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        del self.requests[request_id]
        self.swapped.discard(request_id)
        self.manager.free(request_id)
        assert self.manager.block_table(request_id) == [] and not self.manager.is_swapped(request_id)

    @precondition(lambda self: self.on_gpu())
    @rule(data=st.data())
    def swap_out(self, data):
        request_id = data.draw(st.sampled_from(self.on_gpu()))
        if not self.manager.can_swap_out(request_id):
            return
        table = self.manager.block_table(request_id)
        moves = self.manager.swap_out(request_id)
        assert [gpu for gpu, _ in moves] == table
        assert self.manager.block_table(request_id) == []
        self.swapped.add(request_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.swapped)))
        if not self.manager.can_swap_in(request_id):
            return
        moves = self.manager.swap_in(request_id)
        assert len(moves) == self.blocks_for(self.requests[request_id])
        assert self.manager.block_table(request_id) == [gpu for _, gpu in moves]
        self.swapped.discard(request_id)

    @invariant()
    def ref_counts_match_holders(self):
        self.manager.check_invariants()
        gpu_held = sum(self.blocks_for(self.requests[rid]) for rid in self.on_gpu())
        cpu_held = sum(self.blocks_for(self.requests[rid]) for rid in self.swapped)
        assert self.manager.num_free_gpu_blocks == self.manager.num_gpu_blocks - gpu_held
        assert self.manager.num_free_cpu_blocks == self.manager.num_cpu_blocks - cpu_held

    def teardown(self):
        for request_id in list(self.requests):
            self.manager.free(request_id)
        self.manager.check_invariants()
        assert self.manager.num_free_gpu_blocks == self.manager.num_gpu_blocks
        assert self.manager.num_free_cpu_blocks == self.manager.num_cpu_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase
