"""Block tables: which KV blocks hold each request's tokens, on the GPU or in the swap pool.

Who owns it: the `Scheduler`, on the scheduler thread; it is the only writer. The worker never sees this
object, only the block ids and swap moves the scheduler puts in each step plan.

A request's K/V lives in fixed-size blocks of `block_size` token slots: token `p` sits in slot
`p % block_size` of block `table[p // block_size]`. A request holds a table on exactly one side at a time:
a GPU table while it can run, a CPU (swap) table while it is swapped out, none while it waits to be
(re)computed.

Ready for later, not built: prefix caching (full blocks keyed by a hash chain and kept in the pool's LRU free
list after release) and sharing (ref counts > 1, copy-on-write through the plan's `copy` moves). Both slot in
behind `allocate_slots` and `BlockPool`; the scheduler's calls stay the same. `swap_out` today copies each
table entry on its own; once blocks are shared it must map a shared GPU block to one CPU block.
"""

from __future__ import annotations

from collections import Counter

from scheduler_svc.block_pool import BlockPool
from scheduler_svc.request import Request


class BlockManager:
    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._block_size = block_size
        self._gpu_pool = BlockPool(num_gpu_blocks)
        self._cpu_pool = BlockPool(num_cpu_blocks)
        self._gpu_tables: dict[str, list[int]] = {}
        self._cpu_tables: dict[str, list[int]] = {}

    # ---- sizes -------------------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_gpu_blocks(self) -> int:
        return self._gpu_pool.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self._cpu_pool.num_blocks

    @property
    def num_free_gpu_blocks(self) -> int:
        return self._gpu_pool.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._cpu_pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` token slots."""
        return -(-num_tokens // self._block_size)

    # ---- GPU tables --------------------------------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        """The request's GPU block table (a copy; empty when it holds no GPU blocks)."""
        return list(self._gpu_tables.get(request_id, ()))

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a request holding no blocks could get slots for `num_tokens` tokens now."""
        return self.num_blocks_for(num_tokens) <= self._gpu_pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Grow the request's GPU table to cover `num_computed_tokens + num_new_tokens` tokens.

        Returns the block ids appended (possibly none), or None when the pool lacks free blocks, in which
        case nothing was allocated.
        """
        request_id = request.request_id
        if request_id in self._cpu_tables:
            raise ValueError(f"request {request_id} is swapped out; swap it in first")
        table = self._gpu_tables.get(request_id)
        num_held = 0 if table is None else len(table)
        num_needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - num_held
        if num_needed <= 0:
            return []
        if num_needed > self._gpu_pool.num_free_blocks:
            return None
        new_block_ids = self._gpu_pool.allocate(num_needed)
        if table is None:
            self._gpu_tables[request_id] = list(new_block_ids)
        else:
            table.extend(new_block_ids)
        return new_block_ids

    def free(self, request_id: str) -> None:
        """Release every block the request holds, GPU or swap; a no-op for a request that holds none."""
        gpu_table = self._gpu_tables.pop(request_id, None)
        if gpu_table is not None:
            # Reversed: the tail goes to the back of the LRU, so a future prefix cache evicts it first.
            self._gpu_pool.release(reversed(gpu_table))
        cpu_table = self._cpu_tables.pop(request_id, None)
        if cpu_table is not None:
            self._cpu_pool.release(cpu_table)

    # ---- swapping ----------------------------------------------------------------------------------------

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._cpu_tables

    def can_swap_out(self, request_id: str) -> bool:
        """Whether the swap pool has room for the request's whole GPU table."""
        return len(self._gpu_tables.get(request_id, ())) <= self._cpu_pool.num_free_blocks

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's table to the swap pool and free its GPU blocks.

        Returns (gpu_block, cpu_block) copies for the worker, in table order. The freed GPU blocks may be
        handed out again in the same step: the worker runs swap-outs before anything writes the cache.
        """
        if not self.can_swap_out(request_id):
            raise ValueError(f"swap pool lacks room for request {request_id}")
        gpu_table = self._gpu_tables.pop(request_id, [])
        cpu_table = self._cpu_pool.allocate(len(gpu_table))
        self._gpu_pool.release(gpu_table)
        self._cpu_tables[request_id] = cpu_table
        return list(zip(gpu_table, cpu_table))

    def can_swap_in(self, request_id: str, num_tokens: int = 0) -> bool:
        """Whether the GPU pool has room for the request's swapped table, grown to cover `num_tokens`
        tokens (pass num_computed_tokens + the tokens to schedule, so the step's new slots fit too)."""
        num_swapped = len(self._cpu_tables.get(request_id, ()))
        return max(num_swapped, self.num_blocks_for(num_tokens)) <= self._gpu_pool.num_free_blocks

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's swapped table back to fresh GPU blocks and free its swap blocks.

        Returns (cpu_block, gpu_block) copies for the worker, in table order.
        """
        cpu_table = self._cpu_tables.get(request_id)
        if cpu_table is None:
            raise ValueError(f"request {request_id} is not swapped out")
        if len(cpu_table) > self._gpu_pool.num_free_blocks:
            raise ValueError(f"GPU pool lacks room to swap in request {request_id}")
        del self._cpu_tables[request_id]
        gpu_table = self._gpu_pool.allocate(len(cpu_table))
        self._cpu_pool.release(cpu_table)
        self._gpu_tables[request_id] = gpu_table
        return list(zip(cpu_table, gpu_table))

    # ---- checks ------------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError unless each pool's ref counts equal the number of tables holding each block,
        no block is both free and held, and no request holds tables on both sides."""
        both = self._gpu_tables.keys() & self._cpu_tables.keys()
        if both:
            raise AssertionError(f"requests with GPU and swap tables at once: {sorted(both)}")
        self._gpu_pool.check_invariants(Counter(b for table in self._gpu_tables.values() for b in table))
        self._cpu_pool.check_invariants(Counter(b for table in self._cpu_tables.values() for b in table))
