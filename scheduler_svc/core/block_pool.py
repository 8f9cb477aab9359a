"""A fixed set of KV block ids on one device (the GPU KV pool or the CPU swap pool): free list + ref counts.

Who owns it: the `BlockManager`, on the scheduler thread. It holds only ids and counts; the memory itself
lives in the worker, which learns which ids to use from the step plan.

Why a reference count per block and not a set of used ids: a block has several holders when requests share
it (a prefix-cache hit, a forked child of a parallel-sampling or beam-search request; DESIGN.md "Memory");
it returns to the free list only when its last holder releases it.

Why the free list is an OrderedDict (block id -> None) and not a list or deque: popping the oldest free
block, appending a released one, putting one at the front and removing an arbitrary block are all O(1) (a
plain dict's "pop the first key" degrades as deleted slots pile up at its front), and ids are unique by
construction. That is what the prefix cache needs: freed-but-cached blocks wait in LRU order (released blocks
go to the back, allocation takes the front, so the least recently used cached block is evicted first), blocks
worth nothing to the cache go to the front to be reused first, and a cache hit on a free block takes it out of
the middle (`acquire`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks (oldest-freed first), each with one holder. All or nothing."""
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids = [self._free.popitem(last=False)[0] for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each block (sharing); a free block (a prefix-cache hit on a block nobody holds)
        leaves the free list."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int], reuse_first: bool = False) -> None:
        """Drop one holder of each block; a block with no holder left goes to the back of the free list (the
        front with `reuse_first`: its content is worth nothing, so it should be handed out before any cached
        block is evicted)."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"block {block_id} released but not held")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None
                if reuse_first:
                    self._free.move_to_end(block_id, last=False)

    def free_block_ids(self) -> list[int]:
        """Free blocks in the order they will be handed out (a copy; for checks and tests)."""
        return list(self._free)

    def check_invariants(self, holders: Counter[int]) -> None:
        """Raise AssertionError unless ref counts equal `holders` (block id -> number of tables holding it),
        no held block is free, and every unheld block is free exactly once."""
        for block_id, count in enumerate(self._ref_counts):
            if count != holders.get(block_id, 0):
                raise AssertionError(f"block {block_id}: ref count {count}, {holders.get(block_id, 0)} holders")
            if (count == 0) != (block_id in self._free):
                raise AssertionError(f"block {block_id}: ref count {count} but free={block_id in self._free}")
        unknown = set(holders) - set(range(self._num_blocks))
        if unknown:
            raise AssertionError(f"tables hold ids outside the pool: {sorted(unknown)}")
