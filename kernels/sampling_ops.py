"""SamplingOps: the passes of the sampler over a step's [N, V] logits (first pass, k-th largest, nucleus,
logprob details, and the grammar mask of constrained rows), as a set the worker picks once, like LayerOps.

Why a set: on a GPU each pass is one Triton kernel streaming the logits once per row (about ten eager
passes otherwise, and a full-vocabulary sort for top-k/top-p); on the CPU the torch references run. The
contracts are the reference functions' (kernels/sample_ref.py), so worker_svc/sampler.py is the same
whichever set it gets, and a seeded row draws the same token in either (on one device, up to the last bit of
log: kernels/gumbel_ref.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import sample_ref, token_bitmask_ref


@dataclass(frozen=True)
class SamplingOps:
    name: str
    first_pass: Callable
    kth_largest: Callable
    nucleus: Callable
    logprob_details: Callable
    # Constrained decoding: a packed allowed-token bitmask applied to some rows (kernels/token_bitmask_ref.py).
    apply_token_bitmask: Callable
    # Each pass gives a row its own program, reducing over the vocabulary in blocks of a size fixed by the
    # vocabulary alone: a row's bits cannot depend on the other rows (batch-invariant as they are).
    one_program_per_row: bool = False


def torch_sampling_ops() -> SamplingOps:
    return SamplingOps("torch", sample_ref.first_pass, sample_ref.kth_largest, sample_ref.nucleus,
                       sample_ref.logprob_details, token_bitmask_ref.apply_token_bitmask)


def triton_sampling_ops() -> SamplingOps:
    """Triton kernels (GPU; CPU under TRITON_INTERPRET=1). Triton is imported only when asked for."""
    from kernels import triton_kth_largest, triton_logprob_details, triton_nucleus, triton_sample, triton_token_bitmask

    return SamplingOps("triton", triton_sample.first_pass, triton_kth_largest.kth_largest, triton_nucleus.nucleus,
                       triton_logprob_details.logprob_details, triton_token_bitmask.apply_token_bitmask,
                       one_program_per_row=True)


def batch_invariant_sampling_ops(ops: SamplingOps) -> SamplingOps:
    """`ops` with the passes that reduce over a row or draw transcendental noise over it (the first pass's
    logsumexp and Gumbel noise, the nucleus's exp and mass) run one row at a time, so that a row's token and
    logprobs cannot depend on the other rows (kernels/batch_invariant_ref.py says why on the CPU). The k-th
    largest (a sort), the logprob details (top-k, gathers, one subtraction) and the grammar mask (a store per
    token) are exact per row already. A set whose kernels run one program per row (the Triton set) is
    batch-invariant already and is returned as is: row-at-a-time launches would only cost N launches per pass."""
    if ops.one_program_per_row:
        return ops
    return SamplingOps(f"{ops.name}-batch-invariant", _one_row_at_a_time(ops.first_pass), ops.kth_largest,
                       _one_row_at_a_time(ops.nucleus), ops.logprob_details, ops.apply_token_bitmask)


def _one_row_at_a_time(sampling_pass: Callable) -> Callable:
    def rowwise(rows: torch.Tensor, *args):
        count = rows.shape[0]
        if count <= 1:
            return sampling_pass(rows, *args)
        parts = [sampling_pass(rows[i : i + 1], *(_row_of(arg, i, count) for arg in args)) for i in range(count)]
        if isinstance(parts[0], tuple):
            return tuple(torch.cat(column) for column in zip(*parts, strict=True))
        return torch.cat(parts)

    return rowwise


def _row_of(arg, index: int, count: int):
    """Row `index` of a per-row argument (a tensor or a dataclass of tensors with `count` rows); others as given."""
    if isinstance(arg, torch.Tensor) and arg.dim() > 0 and arg.shape[0] == count:
        return arg[index : index + 1]
    if dataclasses.is_dataclass(arg) and not isinstance(arg, type):
        return dataclasses.replace(arg, **{field.name: _row_of(getattr(arg, field.name), index, count)
                                           for field in dataclasses.fields(arg)})
    return arg
