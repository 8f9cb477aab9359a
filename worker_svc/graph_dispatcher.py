"""Which way a step's forward pass runs: a decode CUDA graph, piecewise mixed-step graphs, or eagerly.

Why one place: the three ways take the same step inputs and return the same hidden states, and which one a
step takes depends only on its shape (all one-token decodes that fit a captured batch size; at most
`mixed_graphs.MAX_TOKENS` tokens with prefill; anything else) and on what was captured at setup (nothing on
the CPU or with --enforce-eager; no piecewise graphs where the model does not allow them or their memory did
not fit). A feature that adds a way adds a `ForwardPath` to the tuple, not a branch in the worker's step.

Multi-LoRA: with --enable-lora the graphs are captured with the adapters' delta (`with_lora`), reading each
token's slot from their static buffers, so steps with adapter rows replay them too; graphs captured without it
take no step with adapter tokens (their `bucket_for` says None), which then runs eagerly. A second, small set of
decode graphs without the delta takes the base-only decode steps of up to BASE_ONLY_DECODE_ROWS rows.

Ownership: the model runner owns the target's dispatcher, and a draft model (draft_model.py) one of its own over
its model and pool, captured the same way; a dispatcher owns the captured graphs and builds the
attention metadata of the steps it runs eagerly or piecewise (the decode graphs fill their own static
buffers).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

import torch

from kernels.attention_metadata import AttentionMetadata
from worker_svc.decode_graphs import DecodeGraphs, take_pending_tokens
from worker_svc.host_to_device import to_device
from worker_svc.layers.attention import Attention
from worker_svc.mixed_graphs import MixedGraphs, supports_mixed_graphs
from worker_svc.persistent_batch import StepInputs

logger = logging.getLogger(__name__)


# With --enable-lora, decode steps of at most this many rows and no adapter row replay a second set of decode
# graphs captured without the LoRA delta. Why: captured with it, a base-only step still launches two kernels per
# fused layer that exit at once (128 launches a step on an 8B model), which cost a lone base request 7% of its
# TPOT on an H200; small batches are where a request may run alone, and their graphs take little memory.
BASE_ONLY_DECODE_ROWS = 16


class ForwardPath(Protocol):
    """One way to run a step's forward pass; `size` is what `bucket_for` chose (None: the path does not run it)."""

    name: str

    def bucket_for(self, inputs: StepInputs) -> int | None: ...

    def run(self, inputs: StepInputs, size: int, previous_sampled: torch.Tensor | None) -> torch.Tensor: ...


class GraphDispatcher:
    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, device: torch.device,
                 paths: tuple[ForwardPath, ...] = ()):
        self._eager = _EagerPath(model, kv_caches, block_size, device)
        # Tried in order; eager takes whatever none of the captured paths takes.
        self.paths: tuple[ForwardPath, ...] = (*paths, self._eager)

    @classmethod
    def captured(cls, model, kv_caches: list[torch.Tensor], block_size: int, device: torch.device,
                 max_num_seqs: int, max_blocks_per_seq: int, world_size: int, rank: int,
                 with_lora: bool = False) -> GraphDispatcher:
        """Captures the decode graphs, then the piecewise graphs where the model allows and memory fits (both
        with the LoRA delta when `with_lora`: the model's layers hold adapter slots)."""
        decode = DecodeGraphs(model, kv_caches, max_num_seqs, max_blocks_per_seq, block_size, device, with_lora)
        decode.capture()
        base = (_capture_base_only_decode_graphs(model, kv_caches, block_size, device, max_num_seqs,
                                                 max_blocks_per_seq, rank) if with_lora else None)
        paths = decode_graph_paths(decode, base)
        mixed = _capture_mixed_graphs(model, kv_caches, block_size, device, world_size, rank, with_lora)
        if mixed is not None:
            paths += (_MixedGraphPath(mixed, block_size, device),)
        return cls(model, kv_caches, block_size, device, paths)

    def choose(self, inputs: StepInputs) -> tuple[ForwardPath, int]:
        """The path that runs this step and the size it runs it at (the first path that takes it)."""
        for path in self.paths:
            size = path.bucket_for(inputs)
            if size is not None:
                return path, size
        raise AssertionError("the eager path takes every step")

    def forward(self, inputs: StepInputs, previous_sampled: torch.Tensor | None) -> torch.Tensor:
        """The hidden states of every scheduled token, one row per token (`previous_sampled`: the sampled ids
        of the step in flight, from which this step's pending input tokens are taken)."""
        inputs = inputs.as_single_token_decodes() or inputs  # a verification step runs as decodes
        path, size = self.choose(inputs)
        return path.run(inputs, size, previous_sampled)


def decode_graph_paths(decode: DecodeGraphs, base_only: DecodeGraphs | None) -> tuple[ForwardPath, ...]:
    """The decode graphs' paths in the order they are tried: a LoRA engine's base-only graphs (captured without the
    delta, up to BASE_ONLY_DECODE_ROWS rows; they refuse steps with adapter rows) before the graphs every decode
    step fits."""
    return (*(() if base_only is None else (DecodeGraphPath(base_only),)), DecodeGraphPath(decode))


def attention_metadata(inputs: StepInputs, block_size: int, device: torch.device) -> AttentionMetadata:
    """A step's attention metadata on the device, from its host arrays (copies that do not wait for the GPU)."""
    return AttentionMetadata(
        slot_mapping=to_device(inputs.slot_mapping, device, torch.long),
        query_start_loc=to_device(inputs.query_start_loc, device, torch.int32),
        seq_lens=to_device(inputs.seq_lens, device, torch.int32),
        block_tables=to_device(inputs.block_tables, device, torch.int32),
        block_size=block_size,
        num_decode_seqs=inputs.num_decode_seqs,
        lora_token_slots=(None if inputs.lora_token_slots is None
                          else to_device(inputs.lora_token_slots, device, torch.long)),
    )


def _input_ids(inputs: StepInputs, device: torch.device, previous_sampled: torch.Tensor | None) -> torch.Tensor:
    input_ids = to_device(inputs.input_ids, device, torch.long)
    if len(inputs.pending_input_indices):
        take_pending_tokens(input_ids, inputs, previous_sampled)
    return input_ids


class _EagerPath:
    name = "eager"

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, device: torch.device):
        self._model, self._kv_caches, self._block_size, self._device = model, kv_caches, block_size, device

    def bucket_for(self, inputs: StepInputs) -> int:
        return len(inputs.input_ids)

    def run(self, inputs: StepInputs, size: int, previous_sampled: torch.Tensor | None) -> torch.Tensor:
        device = self._device
        metadata = attention_metadata(inputs, self._block_size, device)
        input_ids = _input_ids(inputs, device, previous_sampled)
        return self._model(input_ids, to_device(inputs.positions, device, torch.long), self._kv_caches, metadata)


class DecodeGraphPath:
    name = "decode graph"

    def __init__(self, graphs: DecodeGraphs):
        self.graphs = graphs

    def bucket_for(self, inputs: StepInputs) -> int | None:
        return self.graphs.bucket_for(inputs)

    def run(self, inputs: StepInputs, size: int, previous_sampled: torch.Tensor | None) -> torch.Tensor:
        return self.graphs.run(inputs, size, previous_sampled)


class _MixedGraphPath:
    name = "piecewise graphs"

    def __init__(self, graphs: MixedGraphs, block_size: int, device: torch.device):
        self.graphs, self._block_size, self._device = graphs, block_size, device

    def bucket_for(self, inputs: StepInputs) -> int | None:
        if inputs.lora_token_slots is not None and not self.graphs.with_lora:
            return None
        return self.graphs.bucket_for(len(inputs.input_ids))

    def run(self, inputs: StepInputs, size: int, previous_sampled: torch.Tensor | None) -> torch.Tensor:
        # The pieces read the adapter slots from their static buffer (filled by `run`), not the metadata.
        metadata = attention_metadata(dataclasses.replace(inputs, lora_token_slots=None), self._block_size,
                                      self._device)
        input_ids = _input_ids(inputs, self._device, previous_sampled)
        return self.graphs.run(input_ids, inputs.positions, metadata, inputs.slot_mapping, size,
                               inputs.lora_token_slots)


def _capture_base_only_decode_graphs(model, kv_caches: list[torch.Tensor], block_size: int, device: torch.device,
                                     max_num_seqs: int, max_blocks_per_seq: int, rank: int) -> DecodeGraphs | None:
    """A LoRA engine's decode graphs without the delta for base-only steps of up to BASE_ONLY_DECODE_ROWS rows; None
    where their (small) memory pool does not fit beside the KV pool (those steps then replay the LoRA graphs)."""
    graphs = DecodeGraphs(model, kv_caches, min(max_num_seqs, BASE_ONLY_DECODE_ROWS), max_blocks_per_seq, block_size,
                          device, with_lora=False)
    try:
        graphs.capture()
    except torch.cuda.OutOfMemoryError:
        logger.warning("rank %d: no memory left for base-only decode graphs; base steps replay the LoRA graphs", rank)
        torch.cuda.empty_cache()
        return None
    return graphs


def _capture_mixed_graphs(model, kv_caches: list[torch.Tensor], block_size: int, device: torch.device,
                          world_size: int, rank: int, with_lora: bool) -> MixedGraphs | None:
    """Piecewise graphs for steps with prefill where the model allows (mixed_graphs.py); None there, and where
    their memory pool does not fit beside the KV pool (then those steps run eagerly)."""
    attention = [module for module in model.modules() if isinstance(module, Attention)]
    if not attention or not supports_mixed_graphs(model, world_size, attention[0].backend):
        return None
    graphs = MixedGraphs(model, kv_caches, attention, attention[0].backend, block_size, device, with_lora)
    torch.cuda.empty_cache()  # the memory profile's activations: the graphs' pool is allocated apart
    try:
        graphs.capture()
    except torch.cuda.OutOfMemoryError:
        logger.warning("rank %d: no memory left for CUDA graphs of steps with prefill; they run eagerly "
                       "(a lower --gpu-memory-utilization leaves room)", rank)
        torch.cuda.empty_cache()
        return None
    return graphs

