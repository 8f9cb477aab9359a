"""SamplingOps: the passes of the sampler over a step's [N, V] logits (first pass, k-th largest, nucleus,
logprob details), as a set the worker picks once, like LayerOps.

Why a set: on a GPU each pass is one Triton kernel streaming the logits once per row (about ten eager
passes otherwise, and a full-vocabulary sort for top-k/top-p); on the CPU the torch references run. The
contracts are the reference functions' (kernels/sample_ref.py), so worker_svc/sampler.py is the same
whichever set it gets, and a seeded row draws the same token in either (on one device, up to the last bit of
log: kernels/gumbel_ref.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kernels import sample_ref


@dataclass(frozen=True)
class SamplingOps:
    name: str
    first_pass: Callable
    kth_largest: Callable
    nucleus: Callable
    logprob_details: Callable


def torch_sampling_ops() -> SamplingOps:
    return SamplingOps("torch", sample_ref.first_pass, sample_ref.kth_largest, sample_ref.nucleus,
                       sample_ref.logprob_details)


def triton_sampling_ops() -> SamplingOps:
    """Triton kernels (GPU; CPU under TRITON_INTERPRET=1). Triton is imported only when asked for."""
    from kernels import triton_kth_largest, triton_logprob_details, triton_nucleus, triton_sample

    return SamplingOps("triton", triton_sample.first_pass, triton_kth_largest.kth_largest, triton_nucleus.nucleus,
                       triton_logprob_details.logprob_details)
