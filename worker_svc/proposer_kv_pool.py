"""A speculative proposer's own KV pool (a draft model's, draft_model.py; an EAGLE head's, eagle_head.py), laid out
on the target's block ids.

Why one pool class for both proposers: each keeps K/V of its own (the draft's layers, the head's one layer) for
the tokens the target computed, and the scheduler knows only one set of block ids. So the pool holds the
target's `num_blocks` blocks under the same ids (block b holds the same token positions as in the target's
pool: the scheduler's one block manager, its prefix cache, swaps and copy-on-write copies serve both), then
`scratch_blocks_per_row` blocks per worker row for the throwaway K/V a proposal's passes write past the row's
computed tokens where the row has no block of its own yet: never a block the scheduler may give to another
request.

Who owns what: the proposer owns one pool (made at its load, with its model config), and the model runner
drives it at setup (`bytes_per_block`, `num_scratch_blocks` for the memory sizing, then `allocate`) and every
step (`move_blocks`, the plan's swaps and copies); the proposer's passes read `layers` and index it with
`block_tables`.
"""

from __future__ import annotations

import numpy as np
import torch

from protos.pagedserve.v1 import worker_pb2
from worker_svc.kv_cache import KVCache, bytes_per_block
from worker_svc.model_config import ModelConfig
from worker_svc.persistent_batch import PersistentBatch
from worker_svc.tensor_parallel import TensorParallel


class ProposerKVPool:
    def __init__(self, model_config: ModelConfig, num_speculative_tokens: int, device: torch.device,
                 tensor_parallel: TensorParallel):
        self._model_config = model_config
        self._num_speculative_tokens = num_speculative_tokens
        self._device = device
        self._tensor_parallel = tensor_parallel
        # Set by `allocate` (setup), before any pass runs.
        self.kv_cache: KVCache | None = None
        self.block_size = 0
        self.num_blocks = 0  # the target's blocks; the scratch blocks follow
        self.scratch_blocks_per_row = 0

    def bytes_per_block(self, block_size: int, kv_dtype: torch.dtype) -> int:
        """Bytes of one block of this pool on this rank (the sizing counts it with the target's)."""
        return bytes_per_block(self._model_config, block_size, kv_dtype, self._tensor_parallel)

    def _scratch_blocks_per_row(self, block_size: int) -> int:
        """A proposal's positions after the row's computed tokens (at most k) span at most ceil(k / block_size)
        blocks past those the row has."""
        return -(-self._num_speculative_tokens // block_size)

    def num_scratch_blocks(self, block_size: int, max_num_seqs: int) -> int:
        """Scratch blocks in all, every worker row's (the sizing takes them off the top)."""
        return max_num_seqs * self._scratch_blocks_per_row(block_size)

    def allocate(self, num_blocks: int, num_swap_blocks: int, block_size: int, max_num_seqs: int,
                 kv_dtype: torch.dtype) -> None:
        """The pool: the target's blocks (same ids), then each row's scratch blocks; the target's swap blocks."""
        self.block_size, self.num_blocks = block_size, num_blocks
        self.scratch_blocks_per_row = self._scratch_blocks_per_row(block_size)
        total = num_blocks + self.num_scratch_blocks(block_size, max_num_seqs)
        self.kv_cache = KVCache(self._model_config, total, num_swap_blocks, block_size, kv_dtype, self._device,
                                self._tensor_parallel)

    @property
    def layers(self) -> list[torch.Tensor]:
        return self.kv_cache.layers

    def move_blocks(self, plan: worker_pb2.StepPlan) -> None:
        """The plan's swaps and copies, in this pool (the same block ids as the target's), in the target's order:
        out to the host, in, then copies."""
        self.kv_cache.swap_out([(m.src, m.dst) for m in plan.swap_out])
        self.kv_cache.swap_in([(m.src, m.dst) for m in plan.swap_in])
        self.kv_cache.copy([(m.src, m.dst) for m in plan.copy])

    def block_tables(self, batch: PersistentBatch, rows: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Each of `rows`' blocks of this pool for its positions below `ends` (per row): its own while it has
        them (they cover its computed tokens), then its scratch blocks; 0 past its last (never read)."""
        used = -(-ends // self.block_size)
        index = np.arange(int(used.max()))[None, :]
        held = batch.num_blocks[rows][:, None]
        past = index - held
        if (past[index < used[:, None]] >= self.scratch_blocks_per_row).any():
            raise ValueError("a proposal runs past its row's blocks and its scratch blocks")
        scratch = self.num_blocks + rows[:, None] * self.scratch_blocks_per_row + past
        own = batch.block_table[rows][:, : index.shape[1]]
        return np.where(index < held, own, np.where(index < used[:, None], scratch, 0))
