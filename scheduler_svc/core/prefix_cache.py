"""The prefix cache index: which GPU block holds the K/V of each cached full block key, and its hit counters.

Who owns it: the `BlockManager`, on the scheduler thread. It only maps keys to block ids; whether a block is
held or free is the `BlockPool`'s business. A cached block may be held (ref count > 0, possibly by several
requests) or free (ref count 0, in the pool's LRU free list): caching outlives every holder, and the entry is
dropped only when the pool hands the block out again (`evict`) or a holder is about to write into it.

When a block is registered: as soon as it is allocated for tokens that fill it, before the worker has run the
step that writes it. That is sound because the worker writes every scheduled token's K/V before any attention
reads in each layer of the same forward pass, so a request scheduled later in the same step may already hit it;
and the scheduler never undoes a scheduled step (it preempts only requests not yet scheduled in the step).

Why a key maps to one block and a block to one key: two requests may compute the same block independently
(neither saw the other's in the cache); the first registered wins and the duplicate stays uncached, so it is
reused first when freed (see `BlockManager.free`).
"""

from __future__ import annotations

from scheduler_svc.core.block_hash import BlockKey


class PrefixCache:
    def __init__(self) -> None:
        self._block_of_key: dict[BlockKey, int] = {}
        self._key_of_block: dict[int, BlockKey] = {}
        # Admission lookups over the scheduler's life: tokens the admitted requests needed, tokens found cached.
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    def __len__(self) -> int:
        return len(self._block_of_key)

    @property
    def hit_rate(self) -> float:
        """Cached tokens / queried tokens over the cache's life (0.0 before any query)."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    def block_of(self, key: BlockKey) -> int | None:
        return self._block_of_key.get(key)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._key_of_block

    def key_of(self, block_id: int) -> BlockKey | None:
        return self._key_of_block.get(block_id)

    def add(self, key: BlockKey, block_id: int) -> bool:
        """Cache `block_id` under `key`; False (and nothing changes) when the key is already cached."""
        if key in self._block_of_key:
            return False
        if block_id in self._key_of_block:
            raise ValueError(f"block {block_id} is already cached under another key")
        self._block_of_key[key] = block_id
        self._key_of_block[block_id] = key
        return True

    def evict(self, block_id: int) -> None:
        """Forget the block's key, if it has one: its content is about to change."""
        key = self._key_of_block.pop(block_id, None)
        if key is not None:
            del self._block_of_key[key]

    def entries(self) -> dict[BlockKey, int]:
        """Key -> block id of every cached block (a copy; for checks and tests)."""
        return dict(self._block_of_key)

    def check_invariants(self) -> None:
        """Raise AssertionError unless the key -> block and block -> key maps are inverse (no key and no block
        appears twice)."""
        if len(self._block_of_key) != len(self._key_of_block):
            raise AssertionError(f"{len(self._block_of_key)} keys but {len(self._key_of_block)} cached blocks")
        for key, block_id in self._block_of_key.items():
            if self._key_of_block.get(block_id) != key:
                raise AssertionError(f"block {block_id} is cached under two keys")
