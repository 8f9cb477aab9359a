"""Speculative decoding with a draft model: a smaller model of the target's tokenizer proposes each row's next
tokens (greedy rows: its argmax, verified like n-gram drafts by sample-and-match; rows that sample: drawn from its
distribution, verified by exact rejection sampling), and the target verifies them in one step.

Who owns what: the model runner owns one `DraftModel` when the setup names one (WorkerSetup.draft_model). It holds
the draft's weights (loaded by the target's loader, in its dtype, attention backend and tensor-parallel group)
and the draft's own KV pool, with the target's number of blocks and block size and indexed by the same block
tables: block b holds the same token positions in both pools, so the scheduler's one block manager, its prefix
cache, swaps and copies serve both. Past those blocks the draft pool has `scratch_blocks_per_row` blocks per
worker row (below). Its forward passes are eager (no CUDA graphs for the draft).

Two passes, both over this worker's rows:
- `mirror`, every step right after the target's forward: the draft computes exactly the tokens the target
  computed, at the same slots (the same StepInputs, tokens still pending from the step in flight included). So
  the draft's K/V is valid exactly where the target's is: a prefix-cache hit, a swap-in or a recompute skips or
  redoes both alike, and a rejected draft token's slot holds a guess in both until the row computes it again.
  Why every step and not only when proposals are asked (more than disable_by_batch_size rows run): a step the
  draft skipped would leave its K/V behind the target's for good, cached blocks included.
- `propose`, after a step whose plan asks for proposals (StepPlan.propose_draft_tokens), once its tokens are on
  the host and verified: for each row that sampled, the draft computes that newest token (at its position; no
  pool has its K/V yet) and takes proposal 1 from its logits, then feeds each proposal back for the next, k
  single-token passes in all. A greedy row proposes the argmax; a row that samples draws from the draft's
  distribution q under its own temperature, top-k, top-p and min_p, with its seeded noise at the proposed
  token's position, and q is kept on the device (`proposed`, draft_probabilities.py) for the step that verifies
  these drafts by exact rejection sampling (sampling/rejection_sampler.py). The K/V these passes write lies
  past the row's computed tokens: the next step's mirror overwrites what it computes there. It goes to the row's
  own blocks where the row has them, else to the row's scratch blocks, never to a block the scheduler may have
  given to another request.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.attention_metadata import AttentionMetadata
from protos.pagedserve.v1 import worker_pb2
from service_runtime.load_refusal import LoadRefused
from service_runtime.model_source import resolve_model
from worker_svc.draft_probabilities import DraftProbabilities
from worker_svc.graph_dispatcher import GraphDispatcher
from worker_svc.host_to_device import to_device
from worker_svc.kv_cache import KVCache, bytes_per_block
from worker_svc.model_config import ModelConfig
from worker_svc.models.model_loader import load_model, refused_as_load_refusal
from worker_svc.persistent_batch import PersistentBatch, StepInputs
from worker_svc.sampling.rejection_sampler import draw_proposals
from worker_svc.sampling.sampler import GREEDY_TEMPERATURE, SamplingTensors
from worker_svc.tensor_parallel import TensorParallel
from worker_svc.tensor_parallel_fit import draft_refusal


class DraftModel:
    # The target's layers whose states the proposer reads (an EAGLE head's; eagle_head.py): none.
    target_layers_read: tuple[int, ...] = ()
    # Whether a step may be launched before the previous one's tokens are on the host (Worker.can_overlap).
    allows_overlap = True

    def __init__(self, setup: worker_pb2.DraftModelSetup, target_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, attention_backend, layer_ops, tensor_parallel: TensorParallel,
                 max_model_len: int):
        path = resolve_model(setup.model).path
        with refused_as_load_refusal():
            config = ModelConfig.from_path(path)
        refusal = draft_refusal(config, target_config, tensor_parallel.world_size, max_model_len)
        if refusal is not None:
            raise LoadRefused(refusal)
        self.model, self.model_config = load_model(path, dtype, device, attention_backend=attention_backend,
                                                   layer_ops=layer_ops, tensor_parallel=tensor_parallel)
        self.num_speculative_tokens = setup.num_speculative_tokens
        self.max_proposing_rows = setup.max_proposing_rows
        self.target_vocab_size = target_config.vocab_size
        self.device = device
        self.tensor_parallel = tensor_parallel
        self.kv_cache: KVCache | None = None
        self._graphs: GraphDispatcher | None = None
        self._block_size = 0
        self._num_blocks = 0
        self.scratch_blocks_per_row = 0
        # The q of the latest proposals of rows that sample, until the step that verifies them (None: none).
        self.proposed: DraftProbabilities | None = None

    def bytes_per_block(self, block_size: int, kv_dtype: torch.dtype) -> int:
        """Bytes of one block of the draft's pool on this rank (the sizing counts it with the target's)."""
        return bytes_per_block(self.model_config, block_size, kv_dtype, self.tensor_parallel)

    def sampled_draft_bytes(self, max_num_seqs: int) -> int:
        """Memory the q of sampled proposals takes at most (rows x k x vocabulary fp32, and as much again for the
        pass that builds them), which the KV sizing's profile does not see: the rows a step proposes for are at
        most max_proposing_rows (speculation's disable_by_batch_size)."""
        rows = min(self.max_proposing_rows or max_num_seqs, max_num_seqs)
        return 2 * rows * self.num_speculative_tokens * self.target_vocab_size * 4

    def num_scratch_blocks(self, block_size: int, max_num_seqs: int) -> int:
        """Scratch blocks in all: a proposal's k positions after the row's computed tokens span at most
        ceil(k / block_size) blocks past those the row has."""
        return max_num_seqs * -(-self.num_speculative_tokens // block_size)

    def allocate(self, num_blocks: int, num_swap_blocks: int, block_size: int, max_num_seqs: int,
                 kv_dtype: torch.dtype) -> None:
        """The draft's pool: the target's blocks (same ids), then each row's scratch blocks."""
        self._block_size, self._num_blocks = block_size, num_blocks
        self.scratch_blocks_per_row = -(-self.num_speculative_tokens // block_size)
        total = num_blocks + self.num_scratch_blocks(block_size, max_num_seqs)
        self.kv_cache = KVCache(self.model_config, total, num_swap_blocks, block_size, kv_dtype, self.device,
                                self.tensor_parallel)
        self._graphs = GraphDispatcher(self.model, self.kv_cache.layers, block_size, self.device)  # eager only

    def move_blocks(self, plan: worker_pb2.StepPlan) -> None:
        """The plan's swaps and copies, in the draft's pool (the same block ids as the target's)."""
        self.kv_cache.swap_out([(m.src, m.dst) for m in plan.swap_out])
        self.kv_cache.swap_in([(m.src, m.dst) for m in plan.swap_in])
        self.kv_cache.copy([(m.src, m.dst) for m in plan.copy])

    def mirror(self, inputs: StepInputs, previous_sampled: torch.Tensor | None,
               target_output: torch.Tensor) -> torch.Tensor:
        """Computes the step's tokens in the draft's pool, as the target just did in its own; returns the target's
        hidden states as they are."""
        self._graphs.forward(inputs, previous_sampled)
        return target_output

    def after_sampling(self, batch: PersistentBatch) -> None:
        """Nothing: the draft's K/V of the step was written by `mirror`, with the target's forward pass."""

    def propose(self, batch: PersistentBatch, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to `k` draft tokens to follow each row's known tokens (`rows`: rows whose newest token was sampled
        in the step just finished, so their computed tokens are all but it): greedy rows' argmax, sampled rows'
        draws from q (kept in `proposed`). Returns each row's count (k, fewer near max_model_len) and the
        tokens, row after row."""
        self.proposed = None
        num_tokens = batch.num_tokens[rows]
        counts = np.clip(np.minimum(k, batch.token_ids.shape[1] - num_tokens), 0, None).astype(np.int64)
        if not len(rows) or not counts.any():
            return counts, np.zeros(0, dtype=np.int64)
        num_passes = int(counts.max())
        first = num_tokens - 1  # each row's newest token: the first pass computes it
        tables = proposal_block_tables(batch, rows, first + counts, self._num_blocks, self.scratch_blocks_per_row)
        proposals = torch.zeros((len(rows), num_passes), dtype=torch.long, device=self.device)
        sampled = batch.temperature[rows] >= GREEDY_TEMPERATURE
        probs = (torch.zeros((len(rows), num_passes, self.target_vocab_size), device=self.device)
                 if sampled.any() else None)
        active = np.arange(len(rows))
        input_ids = to_device(batch.token_ids[rows, first], self.device, torch.long)
        for step in range(num_passes):
            keep = counts[active] > step
            if not keep.all():
                active = active[keep]
                input_ids = input_ids[to_device(np.flatnonzero(keep), self.device, torch.long)]
            positions = first[active] + step
            sampling = SamplingTensors.from_host(
                temperature=batch.temperature[rows[active]], top_p=batch.top_p[rows[active]],
                top_k=batch.top_k[rows[active]], min_p=batch.min_p[rows[active]], seed=batch.seed[rows[active]],
                position=positions + 1, device=self.device)
            input_ids, step_probs = draw_proposals(self._logits(input_ids, positions, tables[active]), sampling)
            on_device = to_device(active, self.device, torch.long)
            proposals[on_device, step] = input_ids
            if step_probs is not None:
                probs[on_device, step] = step_probs
        host = proposals.cpu().numpy()
        if probs is not None:
            kept = to_device(np.flatnonzero(sampled), self.device, torch.long)
            self.proposed = DraftProbabilities(
                rows=rows[sampled], generations=batch.generation[rows[sampled]].copy(), starts=num_tokens[sampled],
                counts=counts[sampled], token_ids=host[sampled], probs=probs[kept])
        return counts, host[np.arange(num_passes) < counts[:, None]]

    def _logits(self, input_ids: torch.Tensor, positions: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        """The draft's logits over the target's vocabulary for one token per row at `positions` (each row's table
        in `tables`)."""
        device, block_size = self.device, self._block_size
        blocks = tables[np.arange(len(positions)), positions // block_size]
        metadata = AttentionMetadata(
            slot_mapping=to_device(blocks * block_size + positions % block_size, device, torch.long),
            query_start_loc=to_device(np.arange(len(positions) + 1), device, torch.int32),
            seq_lens=to_device(positions + 1, device, torch.int32),
            block_tables=to_device(tables, device, torch.int32),
            block_size=block_size,
            num_decode_seqs=len(positions),
        )
        hidden = self.model(input_ids, to_device(positions, device, torch.long), self.kv_cache.layers, metadata)
        return self.model.compute_logits(hidden)[:, : self.target_vocab_size]


def proposal_block_tables(batch: PersistentBatch, rows: np.ndarray, ends: np.ndarray, num_blocks: int,
                          scratch_blocks_per_row: int) -> np.ndarray:
    """Each row's blocks of a proposer's pool (the target's `num_blocks` ids, then `scratch_blocks_per_row` per
    worker row) for its positions below `ends` (per row): its own while it has them (they cover its computed
    tokens), then its scratch blocks; 0 past its last (never read)."""
    block_size = batch.block_size
    used = -(-ends // block_size)
    index = np.arange(int(used.max()))[None, :]
    held = batch.num_blocks[rows][:, None]
    past = index - held
    if (past[index < used[:, None]] >= scratch_blocks_per_row).any():
        raise ValueError("a proposal runs past its row's blocks and its scratch blocks")
    scratch = num_blocks + rows[:, None] * scratch_blocks_per_row + past
    own = batch.block_table[rows][:, : index.shape[1]]
    return np.where(index < held, own, np.where(index < used[:, None], scratch, 0))
