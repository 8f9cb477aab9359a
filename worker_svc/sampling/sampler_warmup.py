"""Compiles every variant of the sampler's Triton kernels before serving, not at a request's first token.

Why: each variant (greedy or drawn, restricted or not, with processed logits, each logprobs buffer size up to
32, each top-k size class, the grammar mask) is its own compile, and a compile met while serving stalls every
row of that step.
"""

from __future__ import annotations

import itertools

import torch

from kernels.sampling_ops import SamplingOps
from worker_svc.sampling.logits_processors import LogitsAdjustments, SparseLogits
from worker_svc.sampling.sampler import SamplingTensors, sample


@torch.inference_mode()
def warm_up_sampler(vocab_size: int, sampling_ops: SamplingOps, device: torch.device) -> None:
    """Samples one row and several rows of every variant (GPU only: Triton)."""
    bias = LogitsAdjustments(sparse=SparseLogits(rows=torch.zeros(1, dtype=torch.int64, device=device),
                                                 token_ids=torch.zeros(1, dtype=torch.int64, device=device),
                                                 values=torch.ones(1, device=device)))
    for rows, temperature, top_k, adjustments, logprobs in itertools.product(
            (1, 2), (0.0, 1.0), (-1, 5), (None, bias), (-1, 0, 8, 16, 32)):
        tensors = SamplingTensors.from_host(temperature=[temperature] * rows, top_p=[0.9] * rows,
                                            top_k=[top_k] * rows, seed=[0] * rows, position=[0] * rows,
                                            adjustments=adjustments, num_top_logprobs=logprobs, device=device)
        sample(torch.zeros(rows, vocab_size, device=device), tensors, sampling_ops)
    # The grammar mask (constrained rows) has one variant.
    no_tokens = torch.zeros(1, -(-vocab_size // 32), dtype=torch.int32, device=device)
    sampling_ops.apply_token_bitmask(torch.zeros(1, vocab_size, device=device), no_tokens,
                                     torch.zeros(1, dtype=torch.int64, device=device))
    from kernels.triton_kth_largest import MAX_FILTERED_K  # Triton only on a GPU

    # The top-k filter's group size and buffers follow the batch's largest k: one compile per size class.
    for top_k in (2 ** i for i in range(1, MAX_FILTERED_K.bit_length())):
        tensors = SamplingTensors.from_host(temperature=[1.0], top_p=[1.0], top_k=[top_k], seed=[0], position=[0],
                                            device=device)
        sample(torch.randn(1, vocab_size, device=device), tensors, sampling_ops)
