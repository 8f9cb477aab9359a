"""Speculative decoding with a draft model: a smaller model of the target's tokenizer proposes each row's next
tokens (greedy rows: its argmax, verified like n-gram drafts by sample-and-match; rows that sample: drawn from its
distribution, verified by exact rejection sampling), and the target verifies them in one step.

Who owns what: the model runner owns one `DraftModel` when the setup names one (WorkerSetup.draft_model). It holds
the draft's weights (loaded by the target's loader, in its dtype, attention backend and tensor-parallel group)
and the draft's own KV pool, with the target's number of blocks and block size and indexed by the same block
tables: block b holds the same token positions in both pools, so the scheduler's one block manager, its prefix
cache, swaps and copies serve both. Past those blocks the draft pool has scratch blocks per worker row (below;
the pool is proposer_kv_pool.py's, the class an EAGLE head's is too).

Its forward passes go through a graph dispatcher of its own (`graphs`, set by the model runner once the pool
exists): on a GPU without --enforce-eager, CUDA graphs captured over the draft's model and pool like the
target's (decode graphs, and the piecewise graphs of steps with prefill where the draft model allows them),
else eager. Why: an eager pass is a few milliseconds of host launches whatever its size, and a speculating
step runs 1 + k of them (22.7 ms per token against 1.9 ms without speculation on an H200, the 1.5B shape as its
own draft, before these graphs). The logits and the draws stay eager.

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
  single-token passes in all, each a decode step of the rows still proposing through the dispatcher (so the
  draft's decode graphs replay it): a pass takes its input tokens, the previous pass's proposals, on the device
  as a step takes tokens still pending from the step in flight, so the host waits for none of them, and copies
  the proposals once at the end. A greedy row proposes the argmax; a row that samples draws from the draft's
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

from protos.pagedserve.v1 import worker_pb2
from service_runtime.load_refusal import LoadRefused
from service_runtime.model_source import resolve_model
from worker_svc.draft_probabilities import DraftProbabilities
from worker_svc.graph_dispatcher import GraphDispatcher
from worker_svc.host_to_device import to_device
from worker_svc.model_config import ModelConfig
from worker_svc.models.model_loader import load_model, refused_as_load_refusal
from worker_svc.persistent_batch import PersistentBatch, StepInputs
from worker_svc.proposer_kv_pool import ProposerKVPool
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
        self.pool = ProposerKVPool(self.model_config, setup.num_speculative_tokens, device, tensor_parallel)
        # How the draft's forward passes run (captured or eager): set by the model runner at setup, over `pool`
        # once it is allocated (ModelRunner.allocate).
        self.graphs: GraphDispatcher | None = None
        # The q of the latest proposals of rows that sample, until the step that verifies them (None: none).
        self.proposed: DraftProbabilities | None = None

    def sampled_draft_bytes(self, max_num_seqs: int) -> int:
        """Memory the q of sampled proposals takes at most (rows x k x vocabulary fp32, and as much again for the
        pass that builds them), which the KV sizing's profile does not see: the rows a step proposes for are at
        most max_proposing_rows (speculation's disable_by_batch_size)."""
        rows = min(self.max_proposing_rows or max_num_seqs, max_num_seqs)
        return 2 * rows * self.num_speculative_tokens * self.target_vocab_size * 4

    def mirror(self, inputs: StepInputs, previous_sampled: torch.Tensor | None,
               target_output: torch.Tensor) -> torch.Tensor:
        """Computes the step's tokens in the draft's pool, as the target just did in its own; returns the target's
        hidden states as they are."""
        self.graphs.forward(inputs, previous_sampled)
        return target_output

    def after_sampling(self, batch: PersistentBatch) -> None:
        """Nothing: the draft's K/V of the step was written by `mirror`, with the target's forward pass."""

    @torch.inference_mode()  # Worker.finish calls it outside inference mode; a replayed graph's outputs need it
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
        tables = self.pool.block_tables(batch, rows, first + counts)
        proposals = torch.zeros((len(rows), num_passes), dtype=torch.long, device=self.device)
        sampled = batch.temperature[rows] >= GREEDY_TEMPERATURE
        probs = (torch.zeros((len(rows), num_passes, self.target_vocab_size), device=self.device)
                 if sampled.any() else None)
        active = np.arange(len(rows))
        tokens = None  # the previous pass's proposals on the device, one per row it ran
        for step in range(num_passes):
            keep = counts[active] > step
            active = active[keep]
            positions = first[active] + step
            if step == 0:
                inputs = self._pass_inputs(rows[active], batch.token_ids[rows[active], first[active]], positions,
                                           tables[active], sources=None)
            else:  # each row's input is its proposal of the pass before, still on the device
                inputs = self._pass_inputs(rows[active], np.zeros(len(active), dtype=np.int64), positions,
                                           tables[active], sources=np.flatnonzero(keep))
            hidden = self.graphs.forward(inputs, tokens)
            logits = self.model.compute_logits(hidden)[:, : self.target_vocab_size]
            sampling = SamplingTensors.from_host(
                temperature=batch.temperature[rows[active]], top_p=batch.top_p[rows[active]],
                top_k=batch.top_k[rows[active]], min_p=batch.min_p[rows[active]], seed=batch.seed[rows[active]],
                position=positions + 1, device=self.device)
            tokens, step_probs = draw_proposals(logits, sampling)
            on_device = to_device(active, self.device, torch.long)
            proposals[on_device, step] = tokens
            if step_probs is not None:
                probs[on_device, step] = step_probs
        host = proposals.cpu().numpy()
        if probs is not None:
            kept = to_device(np.flatnonzero(sampled), self.device, torch.long)
            self.proposed = DraftProbabilities(
                rows=rows[sampled], generations=batch.generation[rows[sampled]].copy(), starts=num_tokens[sampled],
                counts=counts[sampled], token_ids=host[sampled], probs=probs[kept])
        return counts, host[np.arange(num_passes) < counts[:, None]]

    def _pass_inputs(self, rows: np.ndarray, input_ids: np.ndarray, positions: np.ndarray, tables: np.ndarray,
                     sources: np.ndarray | None) -> StepInputs:
        """One proposal pass as a decode step: a token per row at `positions`, over its table in `tables`, which
        writes its K/V at the position's slot there; `sources`: where each row's input token sits in the previous
        pass's proposals (None: `input_ids` holds them all)."""
        block_size, n = self.pool.block_size, len(rows)
        blocks = tables[np.arange(n), positions // block_size]
        none = np.zeros(0, dtype=np.int64)
        return StepInputs(
            rows=rows, input_ids=input_ids, positions=positions,
            slot_mapping=blocks * block_size + positions % block_size, query_start_loc=np.arange(n + 1),
            seq_lens=positions + 1, block_tables=tables, sample_rows=none, sample_offsets=none, logits_indices=none,
            num_draft_tokens=0, num_decode_seqs=n, pending_input_indices=none if sources is None else np.arange(n),
            pending_sources=none if sources is None else sources)
