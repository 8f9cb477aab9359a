"""An EAGLE head's proposal passes captured as CUDA graphs, one per padded row count.

Why: `EagleHead.propose` runs k - 1 single-token passes of the head after the first proposal, each about twenty
kernel launches (Triton launches cost tens of microseconds of Python each) plus host-to-device copies of its
metadata: about 2 ms a pass eagerly, 9 ms of a k = 4 step on an H200 (Llama-3.1-8B shape), where the target's
verification takes less. A replayed graph launches them all at once.

What a graph holds: one pass over the head's pool for `size` rows (a bucket of decode_graphs.bucket_sizes, up to
the rows that propose at most): the embedding of each row's input token, the head's forward with its fed-back
state, the logits and argmax as target ids (`greedy_target_ids`), and the write-back of those ids and output
states into the input buffers, so that the next replay reads them (tokens and states never leave the device).
The first proposal is not a graph pass: it comes from the head's catch-up pass after sampling (a variable number
of tokens per row, eager; eagle_head.py).

Rows keep their place for a whole proposal: a row that has proposed its count becomes a padding row (slot -1,
context 0, which the kernels skip) instead of the others moving up, so its block table, copied once per proposal,
stays valid. Every pass's positions, slots and context lengths are known on the host at the start (each pass is
one position further), so they go to the device in one copy per proposal, and each pass copies its rows into the
static buffer on the device before its replay.

Ownership: the EAGLE head owns one (`EagleHead.graphs`, made by the model runner once the head's pool exists, on a
GPU without --enforce-eager), over a pass callable the head gives it. On the CPU (tests) nothing is captured: `run`
fills the same buffers the same way and runs the pass over them eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from kernels.attention_metadata import AttentionMetadata
from worker_svc.decode_graphs import bucket_sizes, capture_graphs
from worker_svc.host_to_device import to_device

logger = logging.getLogger(__name__)

# (input token ids [T], input states [T, H], positions [T], metadata) -> (proposed target ids [T], output states)
HeadPass = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], tuple[torch.Tensor, torch.Tensor]]

# Rows of a pass's metadata (int64): positions, slots, context lengths.
_POSITIONS, _SLOTS, _SEQ_LENS = range(3)


class EagleProposalGraphs:
    def __init__(self, head_pass: HeadPass, hidden_size: int, dtype: torch.dtype, max_rows: int,
                 max_blocks_per_seq: int, block_size: int, device: torch.device):
        self._head_pass = head_pass
        self._block_size = block_size
        self._device = device
        self.buckets = bucket_sizes(max_rows)
        size = self.buckets[-1]
        self._token_ids = torch.zeros(size, dtype=torch.long, device=device)
        self._states = torch.zeros(size, hidden_size, dtype=dtype, device=device)
        self._pass_rows = torch.zeros(3, size, dtype=torch.long, device=device)
        self._pass_rows[_SLOTS].fill_(-1)
        self._block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0  # passes run from a captured graph (the logs and tests read it)

    def _pass(self, size: int) -> None:
        """One pass of the first `size` rows over the buffers; its proposals and output states replace its inputs."""
        seq_lens = self._pass_rows[_SEQ_LENS, :size].to(torch.int32)
        metadata = AttentionMetadata(
            slot_mapping=self._pass_rows[_SLOTS, :size], query_start_loc=self._query_start_loc[: size + 1],
            seq_lens=seq_lens, block_tables=self._block_tables[:size], block_size=self._block_size,
            num_decode_seqs=size)
        token_ids, states = self._head_pass(self._token_ids[:size], self._states[:size],
                                            self._pass_rows[_POSITIONS, :size], metadata)
        self._token_ids[:size].copy_(token_ids)
        self._states[:size].copy_(states)

    @torch.inference_mode()
    def capture(self) -> None:
        self._graphs = {size: graph for size, (graph, _) in capture_graphs(self.buckets, self._pass).items()}
        logger.info("captured the EAGLE head's proposal CUDA graphs for %s rows", self.buckets)

    def bucket_for(self, num_rows: int) -> int | None:
        """The bucket whose graph runs a proposal of `num_rows` rows (None: more rows than the largest)."""
        return next((size for size in self.buckets if size >= num_rows), None)

    def run(self, token_ids: torch.Tensor, states: torch.Tensor, tables: np.ndarray, positions: np.ndarray,
            counts: np.ndarray, proposals: torch.Tensor, size: int) -> None:
        """Passes 1.. of a proposal: `token_ids` and `states` (on the device) are each row's first proposal and the
        head's output state it came from, `tables` each row's blocks of the head's pool (for every position the
        passes write), `positions` where each row's first graph pass writes, `counts` each row's proposals in
        all; pass p writes column p of `proposals` for the rows still proposing."""
        n, num_passes = len(counts), int(counts.max()) - 1
        self._token_ids[:n].copy_(token_ids)
        self._states[:n].copy_(states)
        self._states[n:size].zero_()  # padding rows: finite states (each row's math is its own)
        self._block_tables[:n, : tables.shape[1]].copy_(to_device(tables, self._device, torch.int32))
        rows = self._padded_pass_rows(tables, positions, counts, num_passes, size)
        for index in range(num_passes):
            self._pass_rows[:, :size].copy_(rows[index])
            graph = self._graphs.get(size)
            if graph is None:  # not captured (the CPU): the same pass over the same buffers
                self._pass(size)
            else:
                graph.replay()
                self.num_replays += 1
            proposals[:, index + 1] = self._token_ids[:n]

    def _padded_pass_rows(self, tables: np.ndarray, positions: np.ndarray, counts: np.ndarray, num_passes: int,
                          size: int) -> torch.Tensor:
        """Every pass's metadata rows [passes, 3, size] on the device: a row still proposing writes one position
        further each pass; a row done and the padding rows write nothing (slot -1) over no context."""
        n, block_size = len(counts), self._block_size
        rows = np.zeros((num_passes, 3, size), dtype=np.int64)
        rows[:, _SLOTS] = -1
        step = np.arange(num_passes)[:, None]
        active = step + 1 < counts[None, :]
        pass_positions = positions[None, :] + step
        blocks = tables[np.arange(n)[None, :], np.where(active, pass_positions, 0) // block_size]
        rows[:, _POSITIONS, :n] = np.where(active, pass_positions, 0)
        rows[:, _SLOTS, :n] = np.where(active, blocks * block_size + pass_positions % block_size, -1)
        rows[:, _SEQ_LENS, :n] = np.where(active, pass_positions + 1, 0)
        return to_device(rows, self._device, torch.long)
