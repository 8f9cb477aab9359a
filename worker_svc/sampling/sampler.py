"""Token sampling for one step of the persistent batch: logits processors (penalties, logit_bias, masks;
`logits_processors.py`), then greedy, or temperature, min_p, top-k, top-p and a seeded draw; and logprobs.

Who owns what: the worker's input builder owns the per-request sampling rows and hands this module a
`SamplingTensors` each step; the worker picks the `SamplingOps` once (Triton kernels on a GPU, their torch
references on the CPU: kernels/sampling_ops.py); this module owns nothing between steps (no generator, no
cache). Everything runs on the logits' device as whole-batch passes: no Python loop over requests, no
`.item()`, no sort of the vocabulary, so the only device-to-host copy of the step stays the caller's copy of
the sampled ids.

Randomness is Gumbel-max with noise keyed by (seed, position, vocab index) (kernels/gumbel_ref.py): a seeded
request draws the same tokens whatever batch it is in, and again after a preemption. The semantics of each
parameter are in kernels/sample_ref.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.sample_ref import TopK
from kernels.sampling_ops import SamplingOps, torch_sampling_ops
from worker_svc.host_to_device import to_device
from worker_svc.sampling.logits_processors import LogitsAdjustments, apply_adjustments

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing by them would overflow.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters of one step, already on the logits' device.

    Why a frozen dataclass of tensors rather than a list of per-request params: the sampler must treat the
    whole batch in a few vectorized passes, so each parameter is one column over the rows. The booleans are
    computed on the host when the rows are built (`from_host`), because deciding a fast path by reading a
    device tensor would be a host sync.

    Rows: row i is the request whose logits are `logits[i]`.
    - temperature float32 [N]: 0 (anything below GREEDY_TEMPERATURE) means greedy.
    - top_p float32 [N]: in (0, 1]; 1 keeps the whole vocabulary.
    - min_p float32 [N]: in [0, 1]; 0 keeps the whole vocabulary.
    - top_k int64 [N]: -1 or 0 keeps the whole vocabulary, as does any k >= vocab size.
    - seed int64 [N]: the request's seed as 64 raw bits (a uint64 seed reinterpreted; see
      `seed_to_int64`). Unseeded requests get a random seed when they are admitted.
    - position int64 [N]: index, in the request's sequence, of the token being sampled (the prompt length
      for the first generated token).
    - all_greedy: every row is greedy; no noise is computed.
    - max_top_k: the largest top_k of the non-greedy rows, 0 when none has one (then no threshold is computed;
      otherwise it sizes the threshold kernel's buffers).
    - restricts: some non-greedy row restricts its vocabulary (top-k, top-p or min_p): the nucleus pass runs.
    - adjustments: penalties, logit_bias and masks (None: no row uses any).
    - num_top_logprobs: the most top alternatives any row asked for; -1 when no row asked for logprobs,
      and then no rank or top-k is computed.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    top_k: torch.Tensor
    seed: torch.Tensor
    position: torch.Tensor
    all_greedy: bool
    max_top_k: int = 0
    restricts: bool = False
    adjustments: LogitsAdjustments | None = None
    num_top_logprobs: int = -1

    def __post_init__(self) -> None:
        num_rows = self.temperature.shape[0]
        for name in ("temperature", "top_p", "min_p", "top_k", "seed", "position"):
            column = getattr(self, name)
            if column.dim() != 1 or column.shape[0] != num_rows:
                raise ValueError(f"{name} must have shape [{num_rows}], got {list(column.shape)}")
        for name in ("top_k", "seed", "position"):
            if getattr(self, name).dtype != torch.int64:
                raise ValueError(f"{name} must be int64, got {getattr(self, name).dtype}")

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_host(
        cls,
        *,
        temperature: Sequence[float] | np.ndarray,
        top_p: Sequence[float] | np.ndarray,
        top_k: Sequence[int] | np.ndarray,
        seed: Sequence[int] | np.ndarray,
        position: Sequence[int] | np.ndarray,
        device: torch.device | str,
        min_p: Sequence[float] | np.ndarray | None = None,
        adjustments: LogitsAdjustments | None = None,
        num_top_logprobs: int = -1,
    ) -> SamplingTensors:
        """Builds the tensors from host columns in two host-to-device copies (the float columns, the int64
        ones) and derives the fast-path flags on the host, where reading them costs no device sync."""
        num_rows = len(temperature)
        floats = np.empty((3, num_rows), dtype=np.float32)
        floats[0], floats[1] = temperature, top_p
        floats[2] = 0.0 if min_p is None else min_p
        ints = np.empty((3, num_rows), dtype=np.int64)
        ints[0], ints[1], ints[2] = top_k, seed, position
        sampled = floats[0] >= GREEDY_TEMPERATURE
        max_top_k = int(np.where(sampled, ints[0], 0).max(initial=0))
        device = torch.device(device)
        restricts = max_top_k > 0 or bool((sampled & ((floats[1] < 1.0) | (floats[2] > 0.0))).any())
        floats, ints = to_device(floats, device), to_device(ints, device)
        return cls(
            temperature=floats[0], top_p=floats[1], min_p=floats[2], top_k=ints[0], seed=ints[1], position=ints[2],
            all_greedy=not sampled.any(), max_top_k=max_top_k, restricts=restricts,
            adjustments=adjustments, num_top_logprobs=num_top_logprobs,
        )


@dataclass(frozen=True)
class SamplerOutput:
    """What one step samples, on the logits' device: the caller copies both to the host in one transfer.

    - token_ids int64 [N]: the sampled token of each row.
    - logprobs float32 [N]: log_softmax of the raw logits (before penalties, temperature, top-k and top-p)
      at that token, as vLLM reports by default.
    - ranks int64 [N], top_ids int64 [N, K], top_logprobs float32 [N, K] (K = num_top_logprobs), only when
      some row asked for logprobs: 1 + the number of tokens with a strictly higher logprob, and the K best
      tokens of the raw distribution, best first (each row keeps the first k it asked for).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def seed_to_int64(seed: int) -> int:
    """The int64 whose 64 bits are those of a uint64 seed (the public API's seed is a uint64)."""
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def sample(logits: torch.Tensor, tensors: SamplingTensors, ops: SamplingOps | None = None) -> SamplerOutput:
    """Samples one token per row of `logits` (float32 [N, V]) with `ops` (default: the torch references).

    First the logits processors (`tensors.adjustments`). Greedy rows then take the argmax. Other rows: logits
    / temperature, then min_p, top-k and top-p (ties kept together), then the Gumbel-max draw over the kept
    tokens (kernels/sample_ref.py says exactly what is kept). Logprobs are of the raw logits (vLLM's default).
    """
    if logits.dim() != 2 or logits.shape[0] != tensors.num_rows:
        raise ValueError(f"logits must be [{tensors.num_rows}, V], got {list(logits.shape)}")
    ops = ops or torch_sampling_ops()
    processed = apply_adjustments(logits, tensors.adjustments)
    raw = None if processed is logits else logits
    # Top-k first: rows drawn from their gathered candidates skip the first pass's noise.
    top_k = ops.kth_largest(processed, tensors.top_k, tensors.max_top_k) if tensors.max_top_k > 0 else None
    token_ids, max_scaled, log_normalizer = ops.first_pass(
        processed, raw, tensors.temperature, tensors.seed, tensors.position, GREEDY_TEMPERATURE,
        not tensors.all_greedy, top_k.candidates.fits if top_k and top_k.candidates else None)
    if tensors.restricts:
        top_k = top_k or TopK(torch.full_like(max_scaled, float("-inf")))
        token_ids = ops.nucleus(processed, token_ids, max_scaled, tensors.temperature, tensors.seed,
                                tensors.position, tensors.top_p, tensors.min_p, top_k.threshold, GREEDY_TEMPERATURE,
                                top_k.candidates)
    logprobs = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - log_normalizer
    if tensors.num_top_logprobs < 0:
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
    ranks, top_ids, top_logprobs = ops.logprob_details(logits, token_ids, log_normalizer, tensors.num_top_logprobs)
    return SamplerOutput(token_ids, logprobs, ranks, top_ids, top_logprobs)
