"""Decode forwards captured as CUDA graphs, one per padded batch-size bucket.

Why: a decode step of a small model is a few hundred tiny kernel launches; replaying a captured graph
removes the launch gaps (DESIGN.md performance principle 2). Prefill and mixed steps run eagerly.

Ownership: the worker owns one `DecodeGraphs`; it holds static input buffers at the largest bucket, the
captured graphs, and their static outputs. A step whose scheduled rows are all decodes (one token each) and
fit a bucket copies its inputs into the buffers' first rows, pads the rest (slot -1, context 0, block 0,
which the kernels skip) and replays the bucket's graph. Every grid, slice and scalar argument inside is a
function of the bucket alone, as the Triton backend requires (kernels/triton_backend.py).

Multi-LoRA (`with_lora`, the worker's --enable-lora): the graphs are captured with the adapters' delta in every
served layer, reading each token's slot from one more static row that every step fills (the step's
`lora_token_slots`, or -1 for all rows of a step without adapters and for the padding rows: the LoRA kernels
skip slot -1). The adapters' stacked weights are the layers' own tensors, which slot loads overwrite in place
(worker_svc/lora_adapters.py), so a replay reads whatever the slots hold now.

On the CPU (tests) nothing is captured: `run` fills the same static buffers the same way and runs the forward
over them eagerly, so the buffer handling, padding included, is exercised without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from kernels.attention_metadata import AttentionMetadata
from worker_svc.host_to_device import to_device
from worker_svc.persistent_batch import StepInputs

logger = logging.getLogger(__name__)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return sorted({min(size, max_num_seqs) for size in sizes})


def capture_graphs(sizes: list[int], forward: Callable[[int], Any]) -> dict[int, tuple[torch.cuda.CUDAGraph, Any]]:
    """Each size's CUDA graph of `forward(size)` (a pass over static buffers) and the static output it returns.
    Warms up every size eagerly first (each is its own kernel variant), then captures largest first so the smaller
    graphs reuse its memory pool. The caller holds inference mode (a replayed graph's outputs are inference
    tensors)."""
    for size in sizes:
        forward(size)
    torch.cuda.synchronize()
    captured, pool = {}, None
    for size in sorted(sizes, reverse=True):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = forward(size)
        pool = graph.pool() if pool is None else pool
        captured[size] = (graph, output)
    torch.cuda.synchronize()
    return captured


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device, with_lora: bool = False):
        self._model = model
        self.with_lora = with_lora
        self._kv_caches = kv_caches
        self._block_size = block_size
        self.buckets = bucket_sizes(max_num_seqs)
        size = self.buckets[-1]
        # Rows of one int64 buffer, so that a step's token-axis inputs travel in one copy (see `run`).
        self._longs = torch.zeros(_NUM_LONG_ROWS, size, dtype=torch.long, device=device)
        self._input_ids, self._positions, self._slot_mapping = self._longs[0], self._longs[1], self._longs[2]
        self._slot_mapping.fill_(-1)
        self._pending_indices, self._pending_sources = self._longs[3], self._longs[4]
        self._lora_token_slots = self._longs[5]
        self._lora_token_slots.fill_(-1)
        self._seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self._block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self._staging = [_HostStaging(size, max_blocks_per_seq, device.type == "cuda") for _ in range(2)]
        self._num_runs = 0
        self.num_replays = 0  # steps run from a captured graph (the logs and tests read it)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._slot_mapping[:size],
            query_start_loc=self._query_start_loc[: size + 1],
            seq_lens=self._seq_lens[:size],
            block_tables=self._block_tables[:size],
            block_size=self._block_size,
            num_decode_seqs=size,
            lora_token_slots=self._lora_token_slots[:size] if self.with_lora else None,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        for size, (graph, output) in capture_graphs(self.buckets, self._forward).items():
            self._graphs[size], self._outputs[size] = graph, output
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _forward(self, size: int) -> torch.Tensor:
        return self._model(self._input_ids[:size], self._positions[:size], self._kv_caches, self._metadata(size))

    def bucket_for(self, inputs: StepInputs) -> int | None:
        """The bucket that runs this step, or None when it is not a pure decode step that fits (or has adapter
        tokens and the graphs were captured without LoRA)."""
        num_seqs = len(inputs.rows)
        if len(inputs.input_ids) != num_seqs or num_seqs > self.buckets[-1]:
            return None
        if inputs.lora_token_slots is not None and not self.with_lora:
            return None
        return next(size for size in self.buckets if size >= num_seqs)

    def run(self, inputs: StepInputs, size: int, previous_sampled: torch.Tensor | None = None) -> torch.Tensor:
        """Replays the bucket's graph over this step's inputs; returns the hidden states of its real rows.
        Input tokens still pending from the step in flight are taken from its sampled ids on the device
        (`previous_sampled`). The inputs go through pinned host buffers kept for the purpose, two sets used in
        turn: three copies a step, none waiting for the GPU, no pinned allocation."""
        n, num_pending = len(inputs.rows), len(inputs.pending_input_indices)
        staging = self._staging[self._num_runs % 2]
        self._num_runs += 1
        staging.wait_until_copied()  # copied two steps ago: long done unless the GPU is far behind
        longs = staging.longs_array
        longs[0, :n], longs[1, :n], longs[2, :n] = inputs.input_ids, inputs.positions, inputs.slot_mapping
        longs[0:2, n:size] = 0
        longs[2, n:size] = -1  # padded rows write no K/V
        longs[3, :num_pending], longs[4, :num_pending] = inputs.pending_input_indices, inputs.pending_sources
        longs[5, :n] = -1 if inputs.lora_token_slots is None else inputs.lora_token_slots
        longs[5, n:size] = -1  # padded rows: no adapter delta
        seq_lens = staging.seq_lens_array
        seq_lens[:n], seq_lens[n:size] = inputs.seq_lens, 0  # context 0: the kernels skip padded rows
        width = inputs.block_tables.shape[1]
        tables = staging.block_tables_array(n, width)
        tables[:] = inputs.block_tables
        self._longs.copy_(staging.longs, non_blocking=True)
        self._seq_lens[:size].copy_(staging.seq_lens[:size], non_blocking=True)
        self._block_tables[:n, :width].copy_(staging.block_tables(n, width), non_blocking=True)
        staging.mark_copied()
        if num_pending:
            gather_pending_tokens(self._input_ids, self._pending_indices[:num_pending],
                                  self._pending_sources[:num_pending], previous_sampled)
        graph = self._graphs.get(size)
        if graph is None:  # not captured (the CPU): the same forward over the same buffers
            return self._forward(size)[:n]
        graph.replay()
        self.num_replays += 1
        return self._outputs[size][:n]


# Rows of the graphs' int64 input buffer: input ids, positions, slots, pending token indices and sources, and
# each token's LoRA adapter slot (-1: none).
_NUM_LONG_ROWS = 6


class _HostStaging:
    """Pinned host mirrors of the graphs' inputs for one step, and the event after their copies: refilled
    only once those copies ran (a pinned buffer handed to a non-blocking copy must not change before)."""

    def __init__(self, size: int, max_blocks_per_seq: int, on_gpu: bool):
        self._on_gpu = on_gpu  # on the CPU the copies are done when they return: no pinning, no event
        self.longs = torch.zeros(_NUM_LONG_ROWS, size, dtype=torch.long, pin_memory=on_gpu)
        self.seq_lens = torch.zeros(size, dtype=torch.int32, pin_memory=on_gpu)
        self._tables = torch.zeros(size * max_blocks_per_seq, dtype=torch.int32, pin_memory=on_gpu)
        self.longs_array, self.seq_lens_array = self.longs.numpy(), self.seq_lens.numpy()
        self._tables_array = self._tables.numpy()
        self._copied: torch.cuda.Event | None = None

    def block_tables(self, rows: int, width: int) -> torch.Tensor:
        return self._tables[: rows * width].view(rows, width)

    def block_tables_array(self, rows: int, width: int):
        return self._tables_array[: rows * width].reshape(rows, width)

    def wait_until_copied(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def mark_copied(self) -> None:
        if not self._on_gpu:
            return
        self._copied = torch.cuda.Event()
        self._copied.record()


def take_pending_tokens(input_ids: torch.Tensor, inputs: StepInputs, previous_sampled: torch.Tensor | None) -> None:
    """input_ids[i] = previous_sampled[source] for each input token still pending (on the device)."""
    device = input_ids.device
    gather_pending_tokens(input_ids, to_device(inputs.pending_input_indices, device, torch.long),
                          to_device(inputs.pending_sources, device, torch.long), previous_sampled)


def gather_pending_tokens(input_ids: torch.Tensor, indices: torch.Tensor, sources: torch.Tensor,
                          previous_sampled: torch.Tensor | None) -> None:
    """input_ids[indices] = previous_sampled[sources], every index tensor already on the device."""
    if previous_sampled is None:
        raise RuntimeError("a step has pending input tokens but no step is in flight")
    input_ids[indices] = previous_sampled[sources].to(input_ids.dtype)
