"""Block tables: which KV blocks hold each request's tokens, on the GPU or in the swap pool; sharing, copy-on-write
and the prefix cache.

Who owns it: the `Scheduler`, on the scheduler thread; it is the only writer. The worker never sees this
object, only the block ids, swap moves, copies and table replacements the scheduler puts in each step plan.

A request's K/V lives in fixed-size blocks of `block_size` token slots: token `p` sits in slot
`p % block_size` of block `table[p // block_size]`. A request holds a table on exactly one side at a time:
a GPU table while it can run, a CPU (swap) table while it is swapped out, none while it waits to be
(re)computed. Between steps a GPU table covers exactly the computed tokens (ceil(computed / block_size)
blocks); `allocate_slots` grows it for the tokens a step schedules.

Sharing. A GPU block may sit in several tables (ref count = number of tables holding it): a prefix-cache hit
reuses full blocks another request computed, and `fork` gives a child the first blocks of its parent. Full
blocks are never written again, so sharing them is free. The one block that can be written while shared is
a partial last block after a fork: before a request writes into a block with ref count > 1, `allocate_slots`
gives it a private copy (copy-on-write: a new block, a (src, dst) copy for the worker, the table entry
replaced, one holder less on the original). A request about to write alone into a full block cached with its
fork parent's later tokens drops that block's key instead of copying. The swap pool is never shared: swapping
out copies each GPU block to its own CPU block, and swapping in gives fresh private GPU blocks.

Prefix cache (`prefix_cache.py`, keys from `block_hash.py`): each request's full blocks have keys (a hash chain
over its tokens, computed lazily and kept while the request lives); a block is registered under its key as
soon as it is allocated for tokens that fill it. A request admitted with no computed tokens first looks its
keys up (`find_cached_prefix`) and starts with the hit blocks (keys are kept across a swap, dropped with the
blocks on a recompute preemption and recomputed at readmission). Released blocks stay cached in the pool's LRU
free list (counted as free) until the pool hands them out again, which evicts the key. Freed blocks that are
not cached go to the front of the free list, so they are reused before any cached block is evicted; a table is
released tail first, so a request's last blocks (the least likely to be shared) are evicted before its first.
Swapped-in blocks are not re-registered (the manager does not know which of them are computed; it is only a
lost hit).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from scheduler_svc.core.block_hash import BlockKey, adapter_root_key, chain_block_key
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.prefix_cache import PrefixCache
from scheduler_svc.core.request import Request


@dataclass(frozen=True)
class CachedPrefix:
    """Full blocks found in the prefix cache for a request's first tokens (`find_cached_prefix`)."""

    block_ids: tuple[int, ...]
    num_tokens: int  # len(block_ids) * block_size


NO_CACHED_PREFIX = CachedPrefix((), 0)


@dataclass(frozen=True)
class SlotAllocation:
    """What one `allocate_slots` call changed in a request's GPU table, for the step plan."""

    new_block_ids: tuple[int, ...]  # appended to the table (after the cached prefix on an admission)
    copies: tuple[tuple[int, int], ...] = ()  # (src, dst) copy-on-write copies the worker runs before the forward
    replaced_blocks: tuple[tuple[int, int], ...] = ()  # (index in the table, new block id) after a copy


_IN_PLACE = SlotAllocation(())  # a token written into a block the request already holds alone


class BlockManager:
    def __init__(
        self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int, enable_prefix_caching: bool = True
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._block_size = block_size
        self._gpu_pool = BlockPool(num_gpu_blocks)
        self._cpu_pool = BlockPool(num_cpu_blocks)
        self._gpu_tables: dict[str, list[int]] = {}
        self._cpu_tables: dict[str, list[int]] = {}
        self._prefix_cache = PrefixCache() if enable_prefix_caching else None
        # Request id -> keys of its first full blocks (a prefix of the chain; empty when caching is off).
        self._block_keys: dict[str, list[BlockKey]] = {}

    # ---- sizes and counters ------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def enable_prefix_caching(self) -> bool:
        return self._prefix_cache is not None

    @property
    def num_gpu_blocks(self) -> int:
        return self._gpu_pool.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self._cpu_pool.num_blocks

    @property
    def num_free_gpu_blocks(self) -> int:
        """Blocks nobody holds, cached or not (a cached free block is evicted when handed out)."""
        return self._gpu_pool.num_free_blocks

    @property
    def num_used_gpu_blocks(self) -> int:
        return self._gpu_pool.num_blocks - self._gpu_pool.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._cpu_pool.num_free_blocks

    @property
    def prefix_cache_query_tokens(self) -> int:
        """Tokens of every request admitted with a cache lookup (0 with caching off)."""
        return self._prefix_cache.num_query_tokens if self._prefix_cache is not None else 0

    @property
    def prefix_cache_hit_tokens(self) -> int:
        """Of those, tokens whose K/V came from the cache."""
        return self._prefix_cache.num_hit_tokens if self._prefix_cache is not None else 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self._prefix_cache.hit_rate if self._prefix_cache is not None else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` token slots."""
        return -(-num_tokens // self._block_size)

    def gpu_ref_count(self, block_id: int) -> int:
        return self._gpu_pool.ref_count(block_id)

    def cached_blocks(self) -> dict[BlockKey, int]:
        """Key -> GPU block of every cached block, held or free (a copy; for checks and tests)."""
        return self._prefix_cache.entries() if self._prefix_cache is not None else {}

    def free_gpu_block_ids(self) -> list[int]:
        """Free GPU blocks in the order they will be handed out (for tests of the eviction order)."""
        return self._gpu_pool.free_block_ids()

    # ---- GPU tables --------------------------------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        """The request's GPU block table (a copy; empty when it holds no GPU blocks)."""
        return list(self._gpu_tables.get(request_id, ()))

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a request holding no blocks could get slots for `num_tokens` tokens now (no cache hit)."""
        return self.num_blocks_for(num_tokens) <= self._gpu_pool.num_free_blocks

    def find_cached_prefix(self, request: Request, max_num_tokens: int) -> CachedPrefix:
        """The longest run of the request's first full blocks found in the prefix cache, at most
        `max_num_tokens` tokens (pass fewer than the tokens to compute: at least one must be computed to
        sample). Changes nothing but the request's memoized keys; pass the result to `allocate_slots` at once."""
        if self._prefix_cache is None or request.request_id in self._gpu_tables:
            return NO_CACHED_PREFIX
        max_blocks = min(max_num_tokens, request.num_tokens) // self._block_size
        block_ids = []
        for key in self._keys_for(request, max_blocks):
            block_id = self._prefix_cache.block_of(key)
            if block_id is None:
                break
            block_ids.append(block_id)
        return CachedPrefix(tuple(block_ids), len(block_ids) * self._block_size)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_prefix: CachedPrefix | None = None
    ) -> SlotAllocation | None:
        """Make the request's GPU table cover `num_new_tokens` more tokens, all or nothing.

        With `cached_prefix` (an admission; the request holds no table) the table starts with the prefix's
        blocks and the new tokens follow them; the caller then sets num_computed_tokens to the prefix's tokens.
        Gives the request a private copy of a shared block it is about to write into, and registers in the
        prefix cache every block the new tokens fill. Returns None, changing nothing, when the pool lacks free
        blocks.
        """
        request_id = request.request_id
        if cached_prefix is None and num_new_tokens == 1:
            allocation = self._decode_in_place(request)
            if allocation is not None:
                return allocation
        if request_id in self._cpu_tables:
            raise ValueError(f"request {request_id} is swapped out; swap it in first")
        table = self._gpu_tables.get(request_id, [])
        if cached_prefix is not None and table:
            raise ValueError(f"request {request_id} holds blocks; a cached prefix is for admissions only")
        prefix = cached_prefix or NO_CACHED_PREFIX
        start = prefix.num_tokens if cached_prefix is not None else request.num_computed_tokens
        held = list(prefix.block_ids) if cached_prefix is not None else table
        end = start + num_new_tokens
        num_grow = max(0, self.num_blocks_for(end) - len(held))
        written = start // self._block_size if num_new_tokens and start % self._block_size else None
        copy_on_write = written is not None and self._gpu_pool.ref_count(held[written]) > 1
        num_revived = sum(1 for block_id in prefix.block_ids if self._gpu_pool.ref_count(block_id) == 0)
        if num_grow + copy_on_write + num_revived > self._gpu_pool.num_free_blocks:
            return None

        if cached_prefix is not None:
            self._gpu_pool.acquire(prefix.block_ids)  # before allocating, so the growth cannot evict them
            if self._prefix_cache is not None:
                self._prefix_cache.record_query(request.num_tokens, prefix.num_tokens)
        copies, replaced = (), ()
        if copy_on_write:
            source = held[written]
            (private,) = self._allocate_gpu(1)
            held[written] = private
            self._gpu_pool.release([source])  # still held by the others
            copies, replaced = ((source, private),), ((written, private),)
        elif written is not None and self._prefix_cache is not None:
            # A full block cached with another request's tokens past our shared prefix (the fork parent's),
            # now ours alone: we overwrite its tail, so it no longer holds what its key says.
            self._prefix_cache.evict(held[written])
        new_block_ids = self._allocate_gpu(num_grow)
        held.extend(new_block_ids)
        self._gpu_tables[request_id] = held
        self._register_full_blocks(request, held, start, end)
        return SlotAllocation(tuple(new_block_ids), copies, replaced)

    def _decode_in_place(self, request: Request) -> SlotAllocation | None:
        """`allocate_slots` of one token that lands inside the last block the request holds alone (most decode
        steps): no growth, no copy, what the general path would do in a few lookups (a steady-decode step plans
        hundreds of these). None when the general path is needed."""
        table = self._gpu_tables.get(request.request_id)
        start, size = request.num_computed_tokens, self._block_size
        if not table or start % size == 0 or start >= len(table) * size:
            return None
        written = table[start // size]
        if self._gpu_pool.ref_count(written) > 1:
            return None
        if self._prefix_cache is not None:
            self._prefix_cache.evict(written)  # see allocate_slots: a block we overwrite the tail of
            if (start + 1) % size == 0:
                self._register_full_blocks(request, table, start, start + 1)
        return _IN_PLACE

    def keep_accepted_slots(self, request: Request, first_draft_position: int) -> None:
        """Speculative decoding: the request's computed tokens were cut back to the drafts it accepted (those
        from `first_draft_position` on were computed in the step just applied). Frees the blocks allocated only
        for rejected drafts, so the table covers the computed tokens again, and caches the full blocks the
        accepted ones completed (never before: a draft block's content was a guess until the result)."""
        table = self._gpu_tables.get(request.request_id)
        if not table:
            return
        num_kept = self.num_blocks_for(request.num_computed_tokens)
        if len(table) > num_kept:
            rejected = table[num_kept:]
            del table[num_kept:]
            self._release_gpu(rejected)
        self._register_full_blocks(request, table, first_draft_position, request.num_computed_tokens)

    def fork(self, parent_id: str, child_id: str, num_shared_tokens: int) -> None:
        """Give `child_id` the parent's first blocks covering `num_shared_tokens` tokens (one more holder each).

        Takes a token count rather than a block count because the last shared block may be full for the parent
        but partial for the child: only blocks full within the shared tokens carry over their cache keys.
        """
        num_blocks = self.num_blocks_for(num_shared_tokens)
        parent_table = self._gpu_tables.get(parent_id, [])
        if num_blocks > len(parent_table):
            raise ValueError(f"request {parent_id} holds {len(parent_table)} GPU blocks, {num_blocks} to share")
        if child_id in self._gpu_tables or child_id in self._cpu_tables:
            raise ValueError(f"request {child_id} already holds blocks")
        if num_blocks == 0:
            return
        shared = parent_table[:num_blocks]
        self._gpu_pool.acquire(shared)
        self._gpu_tables[child_id] = shared
        if self._prefix_cache is not None:
            parent_keys = self._block_keys.get(parent_id, [])
            self._block_keys[child_id] = parent_keys[: num_shared_tokens // self._block_size]

    def free(self, request_id: str) -> None:
        """Release every block the request holds, GPU or swap; a no-op for a request that holds none."""
        gpu_table = self._gpu_tables.pop(request_id, None)
        if gpu_table is not None:
            self._release_gpu(gpu_table)
        cpu_table = self._cpu_tables.pop(request_id, None)
        if cpu_table is not None:
            self._cpu_pool.release(cpu_table)
        self._block_keys.pop(request_id, None)

    def forget_unwritten(self, request_id: str, num_written_tokens: int) -> bool:
        """The request's tokens past its first `num_written_tokens` may never be written (the worker is to drop
        the steps that write them, see `Scheduler.abort_request`): evict the cache keys of every GPU block they
        reach and return True. Changes nothing and returns False when another request holds one of those blocks
        (it may read them), or the request holds no GPU table (swapped or preempted: its blocks left it)."""
        table = self._gpu_tables.get(request_id)
        if not table:
            return False
        unwritten = table[max(num_written_tokens, 0) // self._block_size:]
        if any(self._gpu_pool.ref_count(block_id) > 1 for block_id in unwritten):
            return False
        if self._prefix_cache is not None:
            for block_id in unwritten:
                self._prefix_cache.evict(block_id)
        return True

    def _allocate_gpu(self, num_blocks: int) -> list[int]:
        block_ids = self._gpu_pool.allocate(num_blocks)
        if self._prefix_cache is not None:
            for block_id in block_ids:
                self._prefix_cache.evict(block_id)  # its content is about to be overwritten
        return block_ids

    def _release_gpu(self, table: list[int]) -> None:
        """Release a table tail first; uncached blocks are reused before any cached block is evicted."""
        tail_first = table[::-1]
        cache = self._prefix_cache
        if cache is None:
            self._gpu_pool.release(tail_first)
            return
        self._gpu_pool.release([block_id for block_id in tail_first if cache.is_cached(block_id)])
        self._gpu_pool.release([b for b in tail_first if not cache.is_cached(b)], reuse_first=True)

    def _register_full_blocks(self, request: Request, table: list[int], start: int, end: int) -> None:
        """Cache the blocks that tokens [start, end) complete."""
        if self._prefix_cache is None:
            return
        first, last = start // self._block_size, min(end, request.num_tokens) // self._block_size
        if first >= last:
            return
        keys = self._keys_for(request, last)
        for index in range(first, last):
            self._prefix_cache.add(keys[index], table[index])

    def _keys_for(self, request: Request, num_blocks: int) -> list[BlockKey]:
        """The request's memoized key chain, extended to at least its first `num_blocks` (full) blocks."""
        keys = self._block_keys.setdefault(request.request_id, [])
        if len(keys) < num_blocks:
            size = self._block_size
            tokens = request.token_ids_between(len(keys) * size, num_blocks * size)
            if keys:
                parent = keys[-1]
            else:  # an adapter's chain starts from its own root: no block is shared with another adapter's
                parent = None if request.lora_name is None else adapter_root_key(*request.lora_key)
            for offset in range(0, len(tokens), size):
                parent = chain_block_key(parent, tokens[offset : offset + size])
                keys.append(parent)
        return keys

    # ---- swapping ----------------------------------------------------------------------------------------

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._cpu_tables

    def can_swap_out(self, request_id: str) -> bool:
        """Whether the swap pool has room for the request's whole GPU table."""
        return len(self._gpu_tables.get(request_id, ())) <= self._cpu_pool.num_free_blocks

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Copy each of the request's GPU blocks to its own swap block and drop its hold on the GPU blocks
        (shared ones stay with their other holders, cached ones stay cached).

        Returns (gpu_block, cpu_block) copies for the worker, in table order. The released GPU blocks may be
        handed out again in the same step: the worker runs swap-outs before anything writes the cache.
        """
        if not self.can_swap_out(request_id):
            raise ValueError(f"swap pool lacks room for request {request_id}")
        gpu_table = self._gpu_tables.pop(request_id, [])
        cpu_table = self._cpu_pool.allocate(len(gpu_table))
        self._release_gpu(gpu_table)
        self._cpu_tables[request_id] = cpu_table
        return list(zip(gpu_table, cpu_table))

    def can_swap_in(self, request_id: str, num_tokens: int = 0) -> bool:
        """Whether the GPU pool has room for the request's swapped table, grown to cover `num_tokens`
        tokens (pass num_computed_tokens + the tokens to schedule, so the step's new slots fit too)."""
        num_swapped = len(self._cpu_tables.get(request_id, ()))
        return max(num_swapped, self.num_blocks_for(num_tokens)) <= self._gpu_pool.num_free_blocks

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's swapped table back to fresh private GPU blocks and free its swap blocks.

        Returns (cpu_block, gpu_block) copies for the worker, in table order.
        """
        cpu_table = self._cpu_tables.get(request_id)
        if cpu_table is None:
            raise ValueError(f"request {request_id} is not swapped out")
        if len(cpu_table) > self._gpu_pool.num_free_blocks:
            raise ValueError(f"GPU pool lacks room to swap in request {request_id}")
        del self._cpu_tables[request_id]
        gpu_table = self._allocate_gpu(len(cpu_table))
        self._cpu_pool.release(cpu_table)
        self._gpu_tables[request_id] = gpu_table
        return list(zip(cpu_table, gpu_table))

    # ---- checks ------------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError unless: each pool's ref counts equal the number of tables holding each block;
        every block is either free (cached or not) or held, never both; no request holds tables on both sides;
        the prefix cache maps no key and no block twice; and a cached block held by a request sits where that
        request's own key chain has the block's key (its content is what the key says)."""
        both = self._gpu_tables.keys() & self._cpu_tables.keys()
        if both:
            raise AssertionError(f"requests with GPU and swap tables at once: {sorted(both)}")
        self._gpu_pool.check_invariants(Counter(b for table in self._gpu_tables.values() for b in table))
        self._cpu_pool.check_invariants(Counter(b for table in self._cpu_tables.values() for b in table))
        cache = self._prefix_cache
        if cache is None:
            return
        cache.check_invariants()
        for block_id in cache.entries().values():
            if not 0 <= block_id < self._gpu_pool.num_blocks:
                raise AssertionError(f"cached block {block_id} is outside the pool")
        for request_id, table in self._gpu_tables.items():
            keys = self._block_keys.get(request_id, ())
            for index in range(min(len(keys), len(table))):
                key = cache.key_of(table[index])
                if key is not None and key != keys[index]:
                    raise AssertionError(f"request {request_id}: block {table[index]} is cached under another key")
