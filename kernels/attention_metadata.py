"""Attention metadata: the per-step description of where every token's K/V lives in the paged pool.

Why a frozen dataclass of tensors: the model's `forward` takes it explicitly (no module global), every
attention backend (the torch reference here, Triton later) reads the same fields, and a CUDA-graph
runner can keep one static instance per padded batch bucket and refill its tensors in place.

Who owns it: the worker's input builder makes one per step from its persistent batch; the model only
reads it. All tensors live on the model's device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels.lora_ref import LoraTokens


@dataclass(frozen=True)
class AttentionMetadata:
    """Where the scheduled tokens of one step come from and go to.

    The token axis is flattened: the new tokens of sequence 0, then of sequence 1, ..., then padding.

    Fields:
        slot_mapping: LongTensor[T]. Flat cache slot of each scheduled token,
            `block_id * block_size + offset_in_block`; -1 marks a padding token (its K/V is not written).
        query_start_loc: IntTensor[B + 1]. Cumulative start of each sequence's new tokens on the token
            axis; `query_start_loc[i + 1] - query_start_loc[i]` is sequence i's query length.
        seq_lens: IntTensor[B]. Tokens in each sequence's context after this step (computed before plus
            scheduled now). Sequence i's new tokens are the last `query_len` positions of its context, so
            one rule covers decode, prefill, chunked prefill and prefix-cache hits.
        block_tables: IntTensor[B, max_blocks_per_seq]. Block ids of each sequence in context order;
            unused tail entries are 0.
        block_size: tokens per KV block.
        num_decode_seqs: host int, optional. The first `num_decode_seqs` sequences are decodes (at most
            one query token each; the input builder puts decodes first, as the scheduler orders them).
            Backends that run separate decode and prefill kernels (kernels/triton_backend.py) read it to
            split the batch without a device-to-host sync; under CUDA graphs it is the padded bucket
            size. None means unknown: the Triton backend then finds it with one host sync, the torch
            reference ignores it.
        lora_token_slots: LongTensor[T], optional. Multi-LoRA: each token's adapter slot in the layers' stacked
            adapter weights (-1: the base model, no delta); None when no token of the step has an adapter,
            which keeps such a step exactly the base model's (and on its CUDA graphs). The linear layers read
            it (worker_svc/layers/parallel_linear.py); attention ignores it.
        lora_tokens: optional. `lora_token_slots` with the tokens' order by slot (kernels/lora_ref.LoraTokens),
            which the LoRA kernels read: set by the model at the start of its forward (`with_lora_tokens`), so one
            sort serves every layer of the step, and a CUDA graph replays it with the slots. None without LoRA.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    num_decode_seqs: int | None = None
    lora_token_slots: torch.Tensor | None = None
    lora_tokens: LoraTokens | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def with_lora_tokens(metadata: AttentionMetadata) -> AttentionMetadata:
    """`metadata` with `lora_tokens` made from `lora_token_slots` (sorted once for the step's layers), or as it
    is when the step has no adapter token or already has them."""
    if metadata.lora_token_slots is None or metadata.lora_tokens is not None:
        return metadata
    return dataclasses.replace(metadata, lora_tokens=LoraTokens.of(metadata.lora_token_slots))
