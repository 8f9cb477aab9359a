"""Decode forwards captured as CUDA graphs, one per padded batch-size bucket.

Why: a decode step of a small model is a few hundred tiny kernel launches; replaying a captured graph
removes the launch gaps (DESIGN.md performance principle 2). Prefill and mixed steps run eagerly.

Ownership: the worker owns one `DecodeGraphs`; it holds static input buffers at the largest bucket, the
captured graphs, and their static outputs. A step whose scheduled rows are all decodes (one token each) and
fit a bucket copies its inputs into the buffers' first rows, pads the rest (slot -1, context 0, block 0,
which the kernels skip) and replays the bucket's graph. Every grid, slice and scalar argument inside is a
function of the bucket alone, as the Triton backend requires (kernels/triton_backend.py).
"""

from __future__ import annotations

import logging

import torch

from kernels.attention_metadata import AttentionMetadata
from worker_svc.host_to_device import copy_into, to_device
from worker_svc.persistent_batch import StepInputs

logger = logging.getLogger(__name__)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return sorted({min(size, max_num_seqs) for size in sizes})


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device):
        self._model = model
        self._kv_caches = kv_caches
        self._block_size = block_size
        self.buckets = bucket_sizes(max_num_seqs)
        size = self.buckets[-1]
        self._input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self._positions = torch.zeros(size, dtype=torch.long, device=device)
        self._slot_mapping = torch.full((size,), -1, dtype=torch.long, device=device)
        self._seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self._block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool = None

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._slot_mapping[:size],
            query_start_loc=self._query_start_loc[: size + 1],
            seq_lens=self._seq_lens[:size],
            block_tables=self._block_tables[:size],
            block_size=self._block_size,
            num_decode_seqs=size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Warms up every bucket eagerly (each is its own kernel variant), then captures, largest first so
        the smaller graphs reuse its memory pool."""
        for size in self.buckets:
            self._forward(size)
        torch.cuda.synchronize()
        for size in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._outputs[size] = self._forward(size)
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _forward(self, size: int) -> torch.Tensor:
        return self._model(self._input_ids[:size], self._positions[:size], self._kv_caches, self._metadata(size))

    def bucket_for(self, inputs: StepInputs) -> int | None:
        """The bucket that runs this step, or None when it is not a pure decode step that fits."""
        num_seqs = len(inputs.rows)
        if len(inputs.input_ids) != num_seqs or num_seqs > self.buckets[-1]:
            return None
        return next(size for size in self.buckets if size >= num_seqs)

    def run(self, inputs: StepInputs, size: int, previous_sampled: torch.Tensor | None = None) -> torch.Tensor:
        """Replays the bucket's graph over this step's inputs; returns the hidden states of its real rows.
        Input tokens still pending from the step in flight are taken from its sampled ids on the device
        (`previous_sampled`). No copy here waits for the GPU (pinned staging buffers)."""
        n = len(inputs.rows)
        copy_into(self._input_ids[:n], inputs.input_ids)
        if len(inputs.pending_input_indices):
            take_pending_tokens(self._input_ids, inputs, previous_sampled)
        copy_into(self._positions[:n], inputs.positions)
        copy_into(self._slot_mapping[:n], inputs.slot_mapping)
        self._slot_mapping[n:size].fill_(-1)
        copy_into(self._seq_lens[:n], inputs.seq_lens)
        self._seq_lens[n:size].zero_()
        width = inputs.block_tables.shape[1]
        copy_into(self._block_tables[:n, :width], inputs.block_tables)
        self._graphs[size].replay()
        return self._outputs[size][:n]


def take_pending_tokens(input_ids: torch.Tensor, inputs: StepInputs, previous_sampled: torch.Tensor | None) -> None:
    """input_ids[i] = previous_sampled[source] for each input token still pending (on the device)."""
    if previous_sampled is None:
        raise RuntimeError("a step has pending input tokens but no step is in flight")
    device = input_ids.device
    indices = to_device(inputs.pending_input_indices, device, torch.long)
    sources = to_device(inputs.pending_sources, device, torch.long)
    input_ids[indices] = previous_sampled[sources].to(input_ids.dtype)
