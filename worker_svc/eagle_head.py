"""Speculative decoding with an EAGLE head: a small head proposes each row's next tokens greedily from the
TARGET's hidden states (models/eagle3.py has EAGLE-3's math, models/eagle1.py EAGLE-1's: its own Llama layers
over the target's final hidden state), and the target verifies them as it verifies any drafts (sample-and-match,
lossless).

Who owns what: the model runner owns one `EagleHead` when the setup names one (WorkerSetup.draft_model with
method "eagle3"/"eagle"), in the place a draft model takes (`ModelRunner.draft`), with the same surface: sizing,
the pool, block moves, `mirror`, `after_sampling`, `propose`. It holds the head's weights and its KV pool (its
layers; proposer_kv_pool.py, the class a draft model's pool is too), with the target's block ids and block size
and indexed by the same block tables (block b holds the same token positions in both pools), then scratch blocks
per worker row: the scheduler's one block manager, prefix cache, swaps and copies serve both pools.

The target exposes the states the head reads: at setup the runner sets the target's `aux_hidden_layers` to
`target_layers_read`, and each forward pass then returns the residual stream entering those layers after its
final hidden states (llama.py); CUDA graphs capture that wider output like any other, so graphs still run.
`mirror` splits it off (the target's hidden states go on to the logits unchanged) and keeps the step's inputs and
states until the step's tokens are on the host. An EAGLE-1 head reads no layers' states (`target_layers_read`
empty): it reads the final hidden states themselves, which `mirror` keeps.

Why the head's K/V is written after sampling, not with the forward pass: its input at position i pairs the
target's state at i with the token at i + 1, which for a row's last computed position is the token just sampled
(or verified). So `after_sampling`, once the step's tokens are written, computes for each row of the step its
positions that are now accepted (a chunk's all; a verified row's last known token and its kept drafts), each fed
with the next token; rejected positions are rewritten by a later step. The head's K/V is then valid exactly
where the target's is. The head's output at each row's last position gives proposal 1; `propose` feeds each
proposal back with the head's own output state for the next, k - 1 more single-token passes, whose K/V lies past
the row's computed tokens (its own blocks where it has them, else its scratch blocks). On a GPU without
--enforce-eager those passes replay CUDA graphs of the head's own (`graphs`, eagle_graphs.py), tokens and states
staying on the device; the catch-up pass (a variable number of tokens per row) stays eager. Since the step's tokens
must be on the host before the next step is launched, a worker with a head never overlaps steps.

A prefix-cache hit reuses the head's K/V of the cached blocks as written for the request that filled them: at
the last position of a cached prefix it was computed with that request's next token, which may differ. It only
changes proposals, never the output (verification keeps only what the target samples).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.attention_metadata import AttentionMetadata
from protos.pagedserve.v1 import worker_pb2
from service_runtime.load_refusal import LoadRefused
from service_runtime.model_source import resolve_model
from worker_svc.decode_graphs import bucket_sizes
from worker_svc.eagle_graphs import EagleProposalGraphs
from worker_svc.host_to_device import to_device
from worker_svc.model_config import ModelConfig
from worker_svc.models.eagle1 import load_eagle1_head
from worker_svc.models.eagle1_config import eagle1_refusal
from worker_svc.models.eagle3 import Eagle3Head, read_checkpoint
from worker_svc.models.eagle3_config import eagle3_refusal, read_eagle3_config
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.persistent_batch import PersistentBatch, StepInputs
from worker_svc.proposer_kv_pool import ProposerKVPool
from worker_svc.tensor_parallel import TensorParallel

EAGLE3_METHOD = "eagle3"
EAGLE1_METHOD = "eagle"
EAGLE_METHODS = (EAGLE3_METHOD, EAGLE1_METHOD)


class EagleHead:
    """The worker's EAGLE-3 or EAGLE-1 proposer beside the target: the head's weights, its own KV pool on the
    target's block ids, and the step's target states kept from the forward (`mirror`) until the tokens are known
    (`after_sampling`). Owned by the model runner; the same interface as DraftModel (module docstring)."""

    allows_overlap = False  # `after_sampling` needs the step's tokens before the next step launches

    def __init__(self, setup: worker_pb2.DraftModelSetup, target_model: torch.nn.Module, target_config: ModelConfig,
                 dtype: torch.dtype, device: torch.device, attention_backend, layer_ops,
                 tensor_parallel: TensorParallel):
        path = resolve_model(setup.model).path
        eagle1 = setup.method == EAGLE1_METHOD
        refusal = (eagle1_refusal if eagle1 else eagle3_refusal)(path, target_config, tensor_parallel.world_size)
        if refusal is not None:
            raise LoadRefused(refusal)
        if type(target_model).forward is not LlamaForCausalLM.forward:  # the registry's table changed under us
            raise LoadRefused(f"{target_config.architecture}'s forward pass does not return an EAGLE head's states")
        try:
            if eagle1:  # the target's final hidden states: no layers' states besides
                head = load_eagle1_head(path, target_model, attention_backend, layer_ops,
                                        target_config.max_position_embeddings)
                config, layers = head.config, ()
            else:
                config, draft_vocab_size, layers = read_eagle3_config(path, target_config.num_hidden_layers,
                                                                     target_config.max_position_embeddings)
                tensors = read_checkpoint(path)
                head = Eagle3Head(config, draft_vocab_size, attention_backend, layer_ops,
                                  own_embeddings="embed_tokens.weight" in tensors)
                head.load_tensors(tensors)
                targets = head.draft_to_target + torch.arange(draft_vocab_size)
                if targets.min() < 0 or targets.max() >= target_config.vocab_size:
                    raise ValueError("it maps draft ids outside the target's vocabulary")
        except (ValueError, KeyError, OSError) as error:
            raise LoadRefused(f"cannot serve the EAGLE-{1 if eagle1 else 3} head {setup.model}: {error}") from None
        self.model = head.to(device=device, dtype=dtype)
        self.model_config = config
        self._embed = head.embed_tokens if head.embed_tokens is not None else target_model.model.embed_tokens
        self.target_layers_read = tuple(sorted(layers))
        self._hidden_size = config.hidden_size
        self._dtype = dtype
        self.num_speculative_tokens = setup.num_speculative_tokens
        self.device = device
        self.pool = ProposerKVPool(config, setup.num_speculative_tokens, device, tensor_parallel)
        # How `propose`'s passes after the first run: CUDA graphs (set by the model runner once the pool exists, on a
        # GPU without --enforce-eager: `capture_graphs`), or eagerly (None).
        self.graphs: EagleProposalGraphs | None = None
        # Proposals are the head's argmax: point masses, verified by sample-and-match (no draft distribution q
        # for the rejection rule, unlike a sampling draft model: draft_model.py `proposed`).
        self.proposed = None
        # The step whose head K/V waits for its tokens (`mirror` -> `after_sampling`): its inputs, target states.
        self._pending: tuple[StepInputs, torch.Tensor] | None = None
        # After `after_sampling`: the rows it computed, and each one's head output at its last position.
        self._rows = np.zeros(0, dtype=np.int64)
        self._last_normed: torch.Tensor | None = None
        self._last_state: torch.Tensor | None = None

    def target_state_bytes(self, max_num_batched_tokens: int, dtype: torch.dtype) -> int:
        """Memory the target's wider output takes beyond what the KV sizing's profile saw (it runs before the
        target returns the head's states, see ModelRunner.allocate): the three layer states gathered during a step
        of max_num_batched_tokens tokens and the [T, 4H] concatenation returned, which the step keeps for the
        head's catch-up pass (EAGLE-1's: the hidden states themselves, kept one step longer)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        kept = 2 * len(self.target_layers_read) + 1
        return kept * max_num_batched_tokens * self._hidden_size * itemsize

    def proposal_graph_bytes(self, max_rows: int, target_vocab_size: int) -> int:
        """Memory the proposal passes' CUDA graphs hold for good beside the KV pool (their private pool: the
        activations of one pass of the largest bucket, which the KV sizing's profile does not see, the head being
        unprofiled), as a bound: per row the logits (a target-vocabulary-wide row in the model's dtype and in
        float32, at most) and forty hidden-wide and four MLP-wide rows of intermediates (the head's layers'), plus
        the caching allocator's segments: a 2 MiB one per captured bucket (small blocks) and a 20 MiB one (blocks
        of 1 to 10 MB, such as an 8 row x 128k float32 logits)."""
        itemsize = torch.empty(0, dtype=self._dtype).element_size()
        config = self.model_config
        layer_bytes = (40 * config.hidden_size + 4 * config.intermediate_size) * itemsize
        per_row = target_vocab_size * (itemsize + 4) + config.num_hidden_layers * layer_bytes
        buckets = bucket_sizes(max_rows)
        return buckets[-1] * per_row + (len(buckets) * 2 + 20) * 2**20

    def mirror(self, inputs: StepInputs, previous_sampled: torch.Tensor | None,
               target_output: torch.Tensor) -> torch.Tensor:
        """Keeps the step's target states (after the hidden states in `target_output`; EAGLE-1: the hidden states)
        for `after_sampling`; returns the target's hidden states."""
        states = target_output[:, self._hidden_size:] if self.target_layers_read else target_output
        self._pending = (inputs, states)
        return target_output[:, : self._hidden_size]

    @torch.inference_mode()
    def after_sampling(self, batch: PersistentBatch) -> None:
        """The head's K/V at the step's accepted positions, each fed with the token after it (now on the host),
        and each row's head output at its last one (for `propose`)."""
        if self._pending is None:
            return
        (inputs, states), self._pending = self._pending, None
        rows = inputs.rows
        starts = inputs.positions[inputs.query_start_loc[:-1]]
        scheduled = np.diff(inputs.query_start_loc)
        # Accepted: up to the row's computed tokens now (a verified row's rejected drafts are not); each position
        # needs its next token known (a beam row's comes from the scheduler: not yet).
        counts = np.minimum(batch.num_computed_tokens[rows], batch.num_tokens[rows] - 1) - starts
        counts = np.clip(counts, 0, scheduled)
        keep = counts > 0
        order = np.flatnonzero(keep)[np.argsort(counts[keep] != 1, kind="stable")]  # single tokens first
        rows, starts, counts = rows[order], starts[order], counts[order]
        self._rows = rows
        if not len(rows):
            return
        query_start_loc = np.concatenate([[0], np.cumsum(counts)])
        within = np.arange(query_start_loc[-1]) - np.repeat(query_start_loc[:-1], counts)
        token_rows = np.repeat(rows, counts)
        positions = np.repeat(starts, counts) + within
        token_indices = np.repeat(inputs.query_start_loc[:-1][order], counts) + within
        input_ids = np.maximum(batch.token_ids[token_rows, positions + 1], 0)
        block_size = self.pool.block_size
        ends = starts + counts
        tables = batch.block_table[rows][:, : int(-(-ends.max() // block_size))]
        blocks = batch.block_table[token_rows, positions // block_size]
        metadata = AttentionMetadata(
            slot_mapping=to_device(blocks * block_size + positions % block_size, self.device, torch.long),
            query_start_loc=to_device(query_start_loc, self.device, torch.int32),
            seq_lens=to_device(ends, self.device, torch.int32),
            block_tables=to_device(tables, self.device, torch.int32),
            block_size=block_size,
            num_decode_seqs=int((counts == 1).sum()),
        )
        head_states = self.model.combine(states[to_device(token_indices, self.device, torch.long)])
        normed, output = self._forward(input_ids, head_states, positions, metadata)
        last = to_device(query_start_loc[1:] - 1, self.device, torch.long)
        self._last_normed, self._last_state = normed[last], output[last]

    @torch.inference_mode()
    def propose(self, batch: PersistentBatch, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to `k` greedy tokens after each row's known tokens (`rows`: rows that sampled in the step just
        finished, so `after_sampling` ended at their last computed position). Returns each row's count (k, fewer
        near max_model_len) and the tokens, row after row."""
        num_tokens = batch.num_tokens[rows]
        counts = np.clip(np.minimum(k, batch.token_ids.shape[1] - num_tokens), 0, None).astype(np.int64)
        if not len(rows) or not counts.any():
            return counts, np.zeros(0, dtype=np.int64)
        where = {row: index for index, row in enumerate(self._rows.tolist())}
        if any(row not in where for row in rows.tolist()):
            raise ValueError("proposals asked for a row the step did not compute")
        picked = to_device(np.asarray([where[row] for row in rows.tolist()]), self.device, torch.long)
        normed, state = self._last_normed[picked], self._last_state[picked]
        num_passes = int(counts.max())
        first = num_tokens - 1  # the first uncomputed position: the next pass writes it
        tables = self.pool.block_tables(batch, rows, first + counts - 1) if num_passes > 1 else None
        proposals = torch.zeros((len(rows), num_passes), dtype=torch.long, device=self.device)
        token_ids = self.model.greedy_target_ids(normed)
        proposals[:, 0] = token_ids
        size = self.graphs.bucket_for(len(rows)) if self.graphs is not None and num_passes > 1 else None
        if size is not None:
            self.graphs.run(token_ids, state, tables, first, counts, proposals, size)
        else:
            self._eager_passes(token_ids, state, tables, first, counts, proposals)
        host = proposals.cpu().numpy()
        return counts, host[np.arange(num_passes) < counts[:, None]]

    def _eager_passes(self, token_ids: torch.Tensor, state: torch.Tensor, tables: np.ndarray | None,
                      first: np.ndarray, counts: np.ndarray, proposals: torch.Tensor) -> None:
        """Passes 1.. of a proposal, eagerly (what the graphs replay: eagle_graphs.py), the rows still proposing
        in each."""
        active = np.arange(len(counts))
        for step in range(1, proposals.shape[1]):
            keep = counts[active] > step
            if not keep.all():
                active = active[keep]
                kept = to_device(np.flatnonzero(keep), self.device, torch.long)
                token_ids, state = token_ids[kept], state[kept]
            positions = first[active] + step - 1
            table = tables[active]
            block_size = self.pool.block_size
            blocks = table[np.arange(len(active)), positions // block_size]
            metadata = AttentionMetadata(
                slot_mapping=to_device(blocks * block_size + positions % block_size, self.device, torch.long),
                query_start_loc=to_device(np.arange(len(active) + 1), self.device, torch.int32),
                seq_lens=to_device(positions + 1, self.device, torch.int32),
                block_tables=to_device(table, self.device, torch.int32),
                block_size=block_size,
                num_decode_seqs=len(active),
            )
            token_ids, state = self.proposal_pass(token_ids, state, to_device(positions, self.device, torch.long),
                                                  metadata)
            proposals[to_device(active, self.device, torch.long), step] = token_ids

    def proposal_pass(self, token_ids: torch.Tensor, states: torch.Tensor, positions: torch.Tensor,
                      metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """One single-token pass of a proposal (eager, or captured by eagle_graphs.py): each row's proposed target
        id after its input token and state, and the output state to feed back."""
        normed, output = self.model(self._embed(token_ids), states, positions, self.pool.layers, metadata)
        return self.model.greedy_target_ids(normed), output

    def capture_graphs(self, max_rows: int, max_blocks_per_seq: int) -> None:
        """Proposal passes from CUDA graphs for up to `max_rows` rows (the pool must exist)."""
        self.graphs = EagleProposalGraphs(self.proposal_pass, self._hidden_size, self._dtype,
                                          max_rows, max_blocks_per_seq, self.pool.block_size, self.device)
        self.graphs.capture()

    def _forward(self, input_ids: np.ndarray, states: torch.Tensor, positions: np.ndarray,
                 metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The catch-up pass: (normed states for the logits, output states to feed back)."""
        return self.model(self._embed(to_device(input_ids, self.device, torch.long)), states,
                          to_device(positions, self.device, torch.long), self.pool.layers, metadata)
