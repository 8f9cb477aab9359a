"""BlockManager and BlockPool: block tables grow by whole blocks, allocation is all-or-nothing, swapping moves a
table between pools, forks share blocks and copy-on-write gives a writer its own copy of a shared block; unit
tests plus a hypothesis state machine that checks ref counts, free lists, block contents and the prefix cache
after every random allocate / append / fork / free / swap-out / swap-in / prefix-hit. Pure Python, no torch."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler_svc.core.block_hash import chain_block_key
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams


def make_request(request_id: str, num_computed_tokens: int = 0, tokens: list[int] | None = None) -> Request:
    """A request with 64 known tokens of its own (no prefix shared with another id) unless `tokens` says."""
    start = 1000 * (1 + zlib.crc32(request_id.encode()) % 1000)
    prompt = tokens if tokens is not None else [start + i for i in range(64)]
    request = Request(request_id, prompt, SamplingParams())
    request.num_computed_tokens = num_computed_tokens
    return request


def test_allocate_slots_grows_the_table_by_whole_blocks_and_returns_only_new_ones():
    manager = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0)
    request = make_request("a")
    first = manager.allocate_slots(request, 5).new_block_ids  # 5 tokens -> 2 blocks
    assert len(first) == 2 and manager.block_table("a") == list(first)
    request.num_computed_tokens = 5
    assert manager.allocate_slots(request, 3).new_block_ids == ()  # 8 tokens still fit in 2 blocks
    request.num_computed_tokens = 8
    grown = manager.allocate_slots(request, 1).new_block_ids
    assert len(grown) == 1 and manager.block_table("a") == list(first + grown)
    assert manager.num_free_gpu_blocks == 5 and manager.num_used_gpu_blocks == 3
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
    request = make_request("a")
    gpu_before = list(manager.allocate_slots(request, 9).new_block_ids)  # 3 blocks
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


def test_pool_reuses_the_oldest_freed_block_first_and_worthless_blocks_before_that():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.release([b])
    pool.release([a])
    pool.release([d], reuse_first=True)
    assert pool.allocate(3) == [d, b, a]


def test_pool_acquire_takes_a_free_block_out_of_the_free_list_and_shares_a_held_one():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.release([a, b])
    pool.acquire([b, c])
    assert pool.ref_count(b) == 1 and pool.ref_count(c) == 2 and pool.free_block_ids() == [a]
    pool.release([c])
    assert pool.ref_count(c) == 1 and pool.num_free_blocks == 1


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


def test_check_invariants_catches_a_cached_block_that_holds_another_key():
    manager = BlockManager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=0)
    manager.allocate_slots(make_request("a"), 8)
    (first, second) = manager.block_table("a")
    cache = manager._prefix_cache
    key = cache.key_of(first)
    cache.evict(first)
    cache.evict(second)
    cache.add(key, second)  # the first block's key on the second block
    with pytest.raises(AssertionError):
        manager.check_invariants()


# ---- forks and copy-on-write -----------------------------------------------------------------------------


def forked_pair(num_parent_tokens: int, num_shared_tokens: int) -> tuple[BlockManager, Request, Request]:
    """A parent that computed `num_parent_tokens`, and a child sharing its first `num_shared_tokens`."""
    manager = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=8)
    parent = make_request("parent")
    manager.allocate_slots(parent, num_parent_tokens)
    parent.num_computed_tokens = num_parent_tokens
    child = make_request("child", tokens=parent.prompt_token_ids[:num_shared_tokens] + [7, 7, 7, 7])
    manager.fork("parent", "child", num_shared_tokens)
    child.num_computed_tokens = num_shared_tokens
    return manager, parent, child


def test_fork_shares_the_parents_first_blocks():
    manager, _, _ = forked_pair(num_parent_tokens=10, num_shared_tokens=6)
    parent_table, child_table = manager.block_table("parent"), manager.block_table("child")
    assert child_table == parent_table[:2]
    assert [manager.gpu_ref_count(b) for b in parent_table] == [2, 2, 1]
    assert manager.num_used_gpu_blocks == 3
    manager.check_invariants()


def test_writing_into_a_shared_partial_block_copies_it_first():
    manager, parent, child = forked_pair(num_parent_tokens=6, num_shared_tokens=6)
    shared_full, shared_partial = manager.block_table("parent")
    allocation = manager.allocate_slots(child, 1)  # token 6 goes into slot 2 of the shared partial block
    (copy,) = allocation.copies
    assert copy[0] == shared_partial and allocation.replaced_blocks == ((1, copy[1]),)
    assert manager.block_table("child") == [shared_full, copy[1]]
    assert manager.gpu_ref_count(shared_partial) == 1 and manager.gpu_ref_count(shared_full) == 2
    # The parent is now the block's only holder: it writes in place.
    assert manager.allocate_slots(parent, 1).copies == ()
    manager.check_invariants()


def test_fork_on_a_block_boundary_needs_no_copy():
    manager, _, child = forked_pair(num_parent_tokens=8, num_shared_tokens=8)
    allocation = manager.allocate_slots(child, 1)
    assert allocation.copies == () and len(allocation.new_block_ids) == 1


def test_writing_alone_into_a_full_cached_block_of_the_parent_uncaches_it():
    manager, _, child = forked_pair(num_parent_tokens=8, num_shared_tokens=6)  # block 1 is full for the parent
    shared_partial = manager.block_table("child")[1]
    assert shared_partial in manager.cached_blocks().values()
    manager.free("parent")
    assert manager.allocate_slots(child, 1).copies == ()  # the child holds it alone: no copy
    assert shared_partial not in manager.cached_blocks().values()  # but it no longer holds the parent's tokens
    manager.check_invariants()


def test_swap_out_of_a_shared_table_copies_every_block_and_keeps_the_gpu_blocks_for_the_other_holder():
    manager, _, _ = forked_pair(num_parent_tokens=10, num_shared_tokens=6)
    child_table = manager.block_table("child")
    moves = manager.swap_out("child")
    assert [gpu for gpu, _ in moves] == child_table and len({cpu for _, cpu in moves}) == 2
    assert all(manager.gpu_ref_count(b) == 1 for b in child_table)
    moves_in = manager.swap_in("child")
    assert not {gpu for _, gpu in moves_in} & set(manager.block_table("parent"))
    manager.check_invariants()


# ---- the state machine -----------------------------------------------------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Random operations on one BlockManager, with a stand-in worker: the machine keeps each block's content
    (a token id per slot), applies every copy, swap and write the manager's answers call for, and checks that
    every live request still reads its own tokens, that nothing writes into a block someone else holds, and
    that every cached block holds the tokens its key stands for."""

    BLOCK_SIZE = 4
    NUM_GPU_BLOCKS = 16

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(self.BLOCK_SIZE, num_gpu_blocks=self.NUM_GPU_BLOCKS, num_cpu_blocks=8)
        self.gpu = [[None] * self.BLOCK_SIZE for _ in range(self.NUM_GPU_BLOCKS)]
        self.cpu = [[None] * self.BLOCK_SIZE for _ in range(8)]
        self.requests: dict[str, Request] = {}
        self.swapped: set[str] = set()
        self.sequences: list[list[int]] = [[1, 2, 3, 1, 2, 3, 1, 2]]  # prefixes new requests may start with
        self.key_tokens: dict[bytes, tuple[int, ...]] = {}
        self.next_id = 0

    def on_gpu(self) -> list[str]:
        return sorted(set(self.requests) - self.swapped)

    def remember(self, tokens: list[int]) -> None:
        self.sequences.append(tokens)
        parent = None
        for start in range(0, len(tokens) - self.BLOCK_SIZE + 1, self.BLOCK_SIZE):
            parent = chain_block_key(parent, tokens[start : start + self.BLOCK_SIZE])
            self.key_tokens[parent] = tuple(tokens[start : start + self.BLOCK_SIZE])

    def new_request(self, tokens: list[int]) -> Request:
        request = Request(f"r{self.next_id}", tokens, SamplingParams())
        self.next_id += 1
        self.remember(tokens)
        return request

    def compute(self, request: Request, num_new_tokens: int, allocation) -> None:
        """What the worker does with an allocation: copies, then the cache write of the new tokens."""
        for src, dst in allocation.copies:
            self.gpu[dst] = list(self.gpu[src])
        table, tokens = self.manager.block_table(request.request_id), request.all_token_ids
        for position in range(request.num_computed_tokens, request.num_computed_tokens + num_new_tokens):
            block_id = table[position // self.BLOCK_SIZE]
            assert self.manager.gpu_ref_count(block_id) == 1, "wrote into a shared block"
            self.gpu[block_id][position % self.BLOCK_SIZE] = tokens[position]
        request.num_computed_tokens += num_new_tokens

    @rule(data=st.data(), tail=st.lists(st.integers(1, 3), min_size=0, max_size=14))
    def admit(self, data, tail):
        """A request starting from a known sequence's prefix (a likely prefix-cache hit) plus a random tail."""
        base = data.draw(st.sampled_from(self.sequences))
        tokens = base[: data.draw(st.integers(0, len(base)))] + tail
        if not tokens:
            return
        request = self.new_request(tokens)
        prefix = self.manager.find_cached_prefix(request, request.num_tokens - 1)
        assert prefix.num_tokens < request.num_tokens and prefix.num_tokens % self.BLOCK_SIZE == 0
        num_new = data.draw(st.integers(1, request.num_tokens - prefix.num_tokens))
        free_before = self.manager.num_free_gpu_blocks
        allocation = self.manager.allocate_slots(request, num_new, cached_prefix=prefix)
        if allocation is None:
            assert self.manager.num_free_gpu_blocks == free_before
            assert self.manager.block_table(request.request_id) == []
            return
        assert self.manager.block_table(request.request_id)[: len(prefix.block_ids)] == list(prefix.block_ids)
        request.num_computed_tokens = prefix.num_tokens
        self.compute(request, num_new, allocation)
        self.requests[request.request_id] = request

    @precondition(lambda self: self.on_gpu())
    @rule(data=st.data(), new_tokens=st.lists(st.integers(1, 3), max_size=5), num_new=st.integers(1, 9))
    def append(self, data, new_tokens, num_new):
        request = self.requests[data.draw(st.sampled_from(self.on_gpu()))]
        request.output_token_ids.extend(new_tokens)
        self.remember(request.all_token_ids)
        num_new = min(num_new, request.num_tokens - request.num_computed_tokens)
        if num_new == 0:
            return
        table_before = self.manager.block_table(request.request_id)
        allocation = self.manager.allocate_slots(request, num_new)
        if allocation is None:
            assert self.manager.block_table(request.request_id) == table_before
            return
        expected = list(table_before)
        for index, block_id in allocation.replaced_blocks:
            expected[index] = block_id
        assert self.manager.block_table(request.request_id) == expected + list(allocation.new_block_ids)
        self.compute(request, num_new, allocation)

    @precondition(lambda self: self.on_gpu())
    @rule(data=st.data(), tail=st.lists(st.integers(1, 3), min_size=1, max_size=6))
    def fork(self, data, tail):
        parent = self.requests[data.draw(st.sampled_from(self.on_gpu()))]
        num_shared = data.draw(st.integers(1, parent.num_computed_tokens))
        child = self.new_request(parent.all_token_ids[:num_shared] + tail)
        self.manager.fork(parent.request_id, child.request_id, num_shared)
        child.num_computed_tokens = num_shared
        self.requests[child.request_id] = child
        assert self.manager.block_table(child.request_id) == self.manager.block_table(parent.request_id)[
            : -(-num_shared // self.BLOCK_SIZE)
        ]

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
        assert [gpu for gpu, _ in moves] == table and self.manager.block_table(request_id) == []
        for gpu, cpu in moves:
            self.cpu[cpu] = list(self.gpu[gpu])
        self.swapped.add(request_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.swapped)))
        request = self.requests[request_id]
        if not self.manager.can_swap_in(request_id, request.num_computed_tokens):
            return
        moves = self.manager.swap_in(request_id)
        assert len(moves) == -(-request.num_computed_tokens // self.BLOCK_SIZE)
        assert all(self.manager.gpu_ref_count(gpu) == 1 for _, gpu in moves)
        for cpu, gpu in moves:
            self.gpu[gpu] = list(self.cpu[cpu])
        self.swapped.discard(request_id)

    @invariant()
    def ref_counts_match_holders_and_contents_match_tokens(self):
        manager = self.manager
        manager.check_invariants()
        held = {b for request_id in self.on_gpu() for b in manager.block_table(request_id)}
        assert manager.num_free_gpu_blocks == self.NUM_GPU_BLOCKS - len(held)
        for request_id in self.on_gpu():
            request, table = self.requests[request_id], manager.block_table(request_id)
            assert len(table) == -(-request.num_computed_tokens // self.BLOCK_SIZE)
            for position, token in enumerate(request.all_token_ids[: request.num_computed_tokens]):
                assert self.gpu[table[position // self.BLOCK_SIZE]][position % self.BLOCK_SIZE] == token
        for key, block_id in manager.cached_blocks().items():
            assert tuple(self.gpu[block_id]) == self.key_tokens[key], "a cached block lost its content"

    def teardown(self):
        for request_id in list(self.requests):
            self.manager.free(request_id)
        manager = self.manager
        manager.check_invariants()
        assert manager.num_free_gpu_blocks == manager.num_gpu_blocks and manager.num_used_gpu_blocks == 0
        assert manager.num_free_cpu_blocks == manager.num_cpu_blocks
        everything = make_request("all", tokens=[9] * (self.NUM_GPU_BLOCKS * self.BLOCK_SIZE))
        assert manager.allocate_slots(everything, everything.num_tokens) is not None  # every block reusable


BlockManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase
