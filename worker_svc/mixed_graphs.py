"""Steps with prefill (mixed and prefill-only, up to `MAX_TOKENS` tokens) as CUDA graphs captured in pieces,
with attention run eagerly between the pieces.

Why: an eager forward of a small model is a few hundred kernel launches, and each costs the host tens of
microseconds (Triton's launcher, torch's dispatcher): a mixed step's launch took the host several times the
device's time for it (docs/benchmarks.md, benchmarks/mixed_step_launch.py), so under steady arrivals, where
most steps carry a new prompt, the GPU waited for the host. Everything but
attention depends only on the number of tokens, so it is captured per padded token count (a bucket); attention
depends on how the tokens split into sequences, so it runs eagerly: per layer the cache write and the
attention kernels over this step's metadata, reading the piece's query/key/value and writing the buffer the
next piece reads (vLLM's piecewise CUDA graphs, built without torch.compile: the split points are the calls
into the attention backend, which this module's `_SplitBackend` stands in for while capturing).

Multi-LoRA (`with_lora`): the adapters' delta sits in the linear layers, so inside the pieces; they read each
token's adapter slot from a static buffer `run` fills (-1 for base tokens and the bucket's padding, which the LoRA
kernels skip), and the adapters' stacked weights, which slot loads overwrite in place.

Not for models whose positions depend on the batch (longrope's table choice), mixtures of experts (their
kernels size work by the routed tokens) or tensor parallel: those run eagerly (`supports_mixed_graphs`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import numpy as np
import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.kv_quant import UNIT_KV_SCALES, KVScales
from worker_svc.host_to_device import to_device
from worker_svc.layers.fused_moe import FusedMoE

logger = logging.getLogger(__name__)

BUCKET = 128  # token counts are padded up to a multiple of this
MAX_TOKENS = 2048  # larger steps run eagerly: their device time dwarfs the launch


def supports_mixed_graphs(model: torch.nn.Module, world_size: int, backend) -> bool:
    """Whether `model`'s forward outside attention depends only on the token count (see the module docstring),
    on a Triton attention backend (it writes into a given buffer). In batch-invariant mode too: every op there
    computes a row alone, so the padding rows of a bucket change no real row's bits."""
    from kernels.triton_backend import TritonAttentionBackend  # Triton: on a GPU only (the CPU image has none)
    from kernels.triton_batch_invariant_attention import BatchInvariantTritonBackend

    if not isinstance(backend, (TritonAttentionBackend, BatchInvariantTritonBackend)):
        return False
    if world_size != 1 or any(isinstance(module, FusedMoE) for module in model.modules()):
        return False
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    return getattr(rotary, "long_from", None) is None


@dataclass
class _AttentionCall:
    """One layer's attention between two pieces: the tensors the pieces left it and the buffer it fills."""

    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    query: torch.Tensor
    output: torch.Tensor
    scale: float
    sliding_window: int | None
    logit_softcap: float | None
    kv_scales: KVScales


class _SplitBackend:
    """Stands in for the attention backend while a bucket is captured: each layer's attention ends the piece
    being captured (its inputs recorded), and the next piece starts reading a fixed output buffer."""

    def __init__(self, real, pool):
        self.real = real
        self.pool = pool
        self.capturing = False
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.calls: list[_AttentionCall] = []
        self._pending: tuple | None = None

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.pieces.append(graph)

    def write_kv_cache(self, key, value, kv_cache, slot_mapping, kv_scales=UNIT_KV_SCALES) -> None:
        if not self.capturing:
            return self.real.write_kv_cache(key, value, kv_cache, slot_mapping, kv_scales)
        self._pending = (key, value, kv_cache)

    def paged_attention(self, query, kv_cache, metadata, scale, sliding_window=None, logit_softcap=None,
                        kv_scales=UNIT_KV_SCALES):
        if not self.capturing:
            return self.real.paged_attention(query, kv_cache, metadata, scale, sliding_window, logit_softcap,
                                             kv_scales=kv_scales)
        self.pieces[-1].capture_end()
        key, value, cache = self._pending
        output = torch.zeros_like(query)
        self.calls.append(_AttentionCall(key, value, cache, query, output, scale, sliding_window, logit_softcap,
                                         kv_scales))
        self.begin()
        return output


@dataclass
class _Bucket:
    """One token count's capture: its pieces in replay order, the attention call after each piece but the
    last, and the last piece's hidden states (static: the step's logits read them before the next replay)."""

    pieces: list[torch.cuda.CUDAGraph]
    calls: list[_AttentionCall]
    output: torch.Tensor


class MixedGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], attention_modules: list, backend, block_size: int,
                 device: torch.device, with_lora: bool = False):
        self._model = model
        self.with_lora = with_lora
        self._kv_caches = kv_caches
        self._attention_modules = attention_modules  # whose `backend` is swapped while capturing
        self._backend = backend
        self._block_size = block_size
        self._device = device
        self.sizes = list(range(BUCKET, MAX_TOKENS + 1, BUCKET))
        self._input_ids = torch.zeros(MAX_TOKENS, dtype=torch.long, device=device)
        self._positions = torch.zeros(MAX_TOKENS, dtype=torch.long, device=device)
        self._lora_token_slots = torch.full((MAX_TOKENS,), -1, dtype=torch.long, device=device)
        self._buckets: dict[int, _Bucket] = {}

    def _dummy_metadata(self, size: int) -> AttentionMetadata:
        """Metadata for the eager warm-up: `size` one-token sequences of no context (the kernels skip them)."""
        device = self._device
        return AttentionMetadata(
            slot_mapping=torch.full((size,), -1, dtype=torch.long, device=device),
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(size, dtype=torch.int32, device=device),
            block_tables=torch.zeros(size, 1, dtype=torch.int32, device=device),
            block_size=self._block_size,
            num_decode_seqs=size,
            lora_token_slots=self._lora_token_slots[:size] if self.with_lora else None,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Runs every bucket eagerly once (compiles, cuBLAS choices), then captures each, largest first,
        sharing one memory pool (pieces replay in the order they were captured)."""
        for size in self.sizes:
            self._run_model(size, self._backend)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for size in reversed(self.sizes):
            split = _SplitBackend(self._backend, pool)
            with torch.cuda.stream(stream):
                split.capturing = True
                split.begin()
                try:
                    output = self._run_model(size, split)
                except BaseException:  # out of memory: a capture left open would break every later CUDA call
                    with contextlib.suppress(RuntimeError):  # (unless it failed between two pieces)
                        split.pieces[-1].capture_end()
                    raise
                split.pieces[-1].capture_end()
                split.capturing = False
            self._buckets[size] = _Bucket(split.pieces, split.calls, output)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for steps with prefill of up to %d tokens (%d buckets, %d pieces each)",
                    MAX_TOKENS, len(self.sizes), len(self._buckets[self.sizes[0]].pieces))

    def _run_model(self, size: int, backend) -> torch.Tensor:
        for module in self._attention_modules:
            module.backend = backend
        try:
            return self._model(self._input_ids[:size], self._positions[:size], self._kv_caches,
                               self._dummy_metadata(size))
        finally:
            for module in self._attention_modules:
                module.backend = self._backend

    def bucket_for(self, num_tokens: int) -> int | None:
        if num_tokens > MAX_TOKENS:
            return None
        return -(-num_tokens // BUCKET) * BUCKET

    def run(self, input_ids: torch.Tensor, positions: np.ndarray, metadata: AttentionMetadata,
            slot_mapping: np.ndarray, size: int, lora_token_slots: np.ndarray | None = None) -> torch.Tensor:
        """The hidden states of the step's tokens: `input_ids` on the device (pending tokens already taken),
        `positions`, `slot_mapping` and `lora_token_slots` (None: no adapter token) on the host, `metadata` this
        step's (its slot mapping unused: the padded one is built here)."""
        num_tokens = input_ids.shape[0]
        self._input_ids[:num_tokens].copy_(input_ids)
        padded_positions = np.zeros(size, dtype=np.int64)
        padded_positions[:num_tokens] = positions
        self._positions[:size].copy_(to_device(padded_positions, self._device, torch.long), non_blocking=True)
        padded_slots = np.full(size, -1, dtype=np.int64)
        padded_slots[:num_tokens] = slot_mapping
        slots = to_device(padded_slots, self._device, torch.long)
        if self.with_lora:
            padded_lora = np.full(size, -1, dtype=np.int64)
            if lora_token_slots is not None:
                padded_lora[:num_tokens] = lora_token_slots
            self._lora_token_slots[:size].copy_(to_device(padded_lora, self._device, torch.long), non_blocking=True)
        bucket = self._buckets[size]
        backend = self._backend
        for index, piece in enumerate(bucket.pieces):
            piece.replay()
            if index < len(bucket.calls):
                call = bucket.calls[index]
                backend.write_kv_cache(call.key, call.value, call.kv_cache, slots, call.kv_scales)
                backend.paged_attention(call.query, call.kv_cache, metadata, call.scale, call.sliding_window,
                                        call.logit_softcap, output=call.output, kv_scales=call.kv_scales)
        return bucket.output[:num_tokens]
