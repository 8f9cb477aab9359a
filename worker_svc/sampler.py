"""Token sampling for one step of the persistent batch: logits processors (penalties, logit_bias, masks;
`logits_processors.py`), then greedy, or temperature, min_p, top-k, top-p and a seeded draw; and logprobs.

Who owns what: the worker's input builder owns the per-request sampling rows and hands this module a
`SamplingTensors` each step; this module owns nothing between steps (no generator, no cache). Everything
runs on the logits' device as whole-batch tensor ops: no Python loop over requests, no `.item()`, no
`torch.multinomial`, so the only device-to-host copy of the step stays the caller's copy of the sampled ids.

Randomness is Gumbel-max with noise from a counter-based hash of (seed, position, vocab index): the noise a
row sees depends only on its own request's seed and the position of the token being sampled, never on the
batch around it, the row it landed in, or the device. That is what makes a seeded request reproducible under
continuous batching, and what makes a recompute after preemption draw the same tokens again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from worker_svc.host_to_device import to_device
from worker_svc.logits_processors import LogitsAdjustments, apply_adjustments

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing by them would overflow.
GREEDY_TEMPERATURE = 1e-5

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF
# Starting states of the two per-row key chains (any two distinct odd 32-bit values will do).
_KEY_A_START = 0x9E3779B9
_KEY_B_START = 0x7F4A7C15

# (seed [N], position [N], vocab_size) -> Gumbel noise float32 [N, vocab_size]; see `gumbel_noise`.
NoiseFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
# (logits, temperature, seed, position) -> (token ids, logprobs); see `temperature_sample`.
TemperatureFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters of one step, already on the logits' device.

    Why a frozen dataclass of tensors rather than a list of per-request params: the sampler must treat the
    whole batch in a few vectorized ops, so each parameter is one column over the rows. The two booleans are
    computed on the host when the rows are built (`from_host`), because deciding a fast path by reading a
    device tensor would be a host sync.

    Rows: row i is the request whose logits are `logits[i]`.
    - temperature float32 [N]: 0 (anything below GREEDY_TEMPERATURE) means greedy.
    - top_p float32 [N]: in (0, 1]; 1 keeps the whole vocabulary.
    - top_k int32/int64 [N]: -1 or 0 keeps the whole vocabulary, as does any k > vocab size.
    - seed int64 [N]: the request's seed as 64 raw bits (a uint64 seed reinterpreted; see
      `seed_to_int64`). Unseeded requests get a random seed when they are admitted.
    - position int64 [N]: index, in the request's sequence, of the token being sampled (the prompt length
      for the first generated token).
    - min_p float32 [N]: in [0, 1]; 0 keeps the whole vocabulary.
    - all_greedy: every row is greedy; `sample` then takes the argmax and builds no noise.
    - uses_top_k_top_p: some row restricts its top-k or top-p; when False the vocabulary sort is skipped.
    - uses_min_p: some row has min_p > 0.
    - adjustments: penalties, logit_bias and masks (None: no row uses any).
    - num_top_logprobs: the most top alternatives any row asked for; -1 when no row asked for logprobs,
      and then no rank or top-k is computed.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    seed: torch.Tensor
    position: torch.Tensor
    all_greedy: bool
    uses_top_k_top_p: bool
    min_p: torch.Tensor | None = None
    uses_min_p: bool = False
    adjustments: LogitsAdjustments | None = None
    num_top_logprobs: int = -1

    def __post_init__(self) -> None:
        num_rows = self.temperature.shape[0]
        for name in ("temperature", "top_p", "top_k", "seed", "position"):
            column = getattr(self, name)
            if column.dim() != 1 or column.shape[0] != num_rows:
                raise ValueError(f"{name} must have shape [{num_rows}], got {list(column.shape)}")
        for name in ("seed", "position"):
            if getattr(self, name).dtype != torch.int64:
                raise ValueError(f"{name} must be int64, got {getattr(self, name).dtype}")

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_host(
        cls,
        *,
        temperature: Sequence[float] | torch.Tensor,
        top_p: Sequence[float] | torch.Tensor,
        top_k: Sequence[int] | torch.Tensor,
        seed: Sequence[int] | torch.Tensor,
        position: Sequence[int] | torch.Tensor,
        device: torch.device | str,
        min_p: Sequence[float] | torch.Tensor | None = None,
        adjustments: LogitsAdjustments | None = None,
        num_top_logprobs: int = -1,
    ) -> SamplingTensors:
        """Builds the tensors from host columns (lists, numpy arrays or CPU tensors) and derives the fast-path
        flags on the host, where reading them costs no device sync."""
        host_temperature = torch.as_tensor(temperature, dtype=torch.float32)
        host_top_p = torch.as_tensor(top_p, dtype=torch.float32)
        host_top_k = torch.as_tensor(top_k, dtype=torch.int64)
        host_min_p = None if min_p is None else torch.as_tensor(min_p, dtype=torch.float32)
        all_greedy = bool((host_temperature < GREEDY_TEMPERATURE).all())
        uses_top_k_top_p = bool(((host_top_k > 0) | (host_top_p < 1.0)).any())
        uses_min_p = host_min_p is not None and bool((host_min_p > 0).any())
        device = torch.device(device)
        return cls(
            min_p=to_device(host_min_p, device) if uses_min_p else None,
            uses_min_p=uses_min_p,
            adjustments=adjustments,
            num_top_logprobs=num_top_logprobs,
            temperature=to_device(host_temperature, device),
            top_p=to_device(host_top_p, device),
            top_k=to_device(host_top_k, device),
            seed=to_device(torch.as_tensor(seed, dtype=torch.int64), device),
            position=to_device(torch.as_tensor(position, dtype=torch.int64), device),
            all_greedy=all_greedy,
            uses_top_k_top_p=uses_top_k_top_p,
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


def sample(
    logits: torch.Tensor,
    tensors: SamplingTensors,
    *,
    noise_fn: NoiseFn | None = None,
    temperature_fn: TemperatureFn | None = None,
) -> SamplerOutput:
    """Samples one token per row of `logits` (float32 [N, V]).

    First the logits processors (`tensors.adjustments`). Greedy rows then take the argmax. Other rows:
    logits / temperature, then min_p, then top-k, then top-p on the top-k-renormalized distribution (vLLM's
    order), then the argmax of the kept logits plus Gumbel noise, which draws exactly from softmax over the
    kept tokens. Logprobs are of the raw logits.

    `noise_fn` defaults to `gumbel_noise`, which runs as ~45 eager elementwise passes over [N, V] int64: fine
    on the CPU, but about 8 ms at N=256, V=152k on an H200. On a GPU the worker should pass
    `torch.compile(gumbel_noise, dynamic=True)` (built once, owned by the worker): one fused kernel, the same
    bits, ~0.4 ms there.
    """
    if logits.dim() != 2 or logits.shape[0] != tensors.num_rows:
        raise ValueError(f"logits must be [{tensors.num_rows}, V], got {list(logits.shape)}")
    if tensors.all_greedy and tensors.adjustments is None and tensors.num_top_logprobs < 0 and logits.is_cuda:
        # One pass over the logits for argmax and logprob (kernels/triton_greedy_sample.py), instead of a
        # cast, an argmax and a multi-pass logsumexp: about 0.06 ms instead of 0.5 at [256, 152k] on an H200.
        from kernels.triton_greedy_sample import greedy_sample

        token_ids, logprobs = greedy_sample(logits)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
    plain = tensors.adjustments is None and tensors.num_top_logprobs < 0 and not tensors.uses_min_p
    if plain and not tensors.uses_top_k_top_p and temperature_fn is not None:
        # Temperature only: one compiled function of `temperature_sample`'s exact ops (the same bits).
        token_ids, logprobs = temperature_fn(logits, tensors.temperature, tensors.seed, tensors.position)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
    processed = apply_adjustments(logits, tensors.adjustments)
    greedy_ids = processed.argmax(dim=-1)
    if tensors.all_greedy:
        token_ids = greedy_ids
    else:
        is_greedy = tensors.temperature < GREEDY_TEMPERATURE
        sampled_ids = _sample_random(processed, tensors, is_greedy, noise_fn or gumbel_noise)
        token_ids = torch.where(is_greedy, greedy_ids, sampled_ids)
    chosen_logits = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    log_normalizer = torch.logsumexp(logits, dim=-1)
    logprobs = chosen_logits - log_normalizer
    if tensors.num_top_logprobs < 0:
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
    ranks, top_ids, top_logprobs = rank_and_top(logits, chosen_logits, log_normalizer, tensors.num_top_logprobs)
    return SamplerOutput(token_ids, logprobs, ranks, top_ids, top_logprobs)


def temperature_sample(
    logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, position: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, logprobs) of rows sampled with temperature alone (greedy below GREEDY_TEMPERATURE): the ops
    `sample` runs for such a batch, in one function: the reference of the GPU's one-pass kernel
    (`cuda_temperature_fn`), and what a CPU worker's batches compute through the general path."""
    is_greedy = temperature < GREEDY_TEMPERATURE
    scaled = logits / torch.where(is_greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    sampled_ids = (scaled + gumbel_noise(seed, position, logits.shape[-1])).argmax(dim=-1)
    token_ids = torch.where(is_greedy, logits.argmax(dim=-1), sampled_ids)
    logprobs = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return token_ids, logprobs


def cuda_temperature_fn() -> TemperatureFn:
    """What a GPU worker passes as `temperature_fn`: the one-pass Triton kernel (the same draws as
    `temperature_sample`; kernels/triton_temperature_sample.py). Triton is imported only here."""
    from kernels.triton_temperature_sample import temperature_sample as kernel

    return functools.partial(kernel, greedy_below=GREEDY_TEMPERATURE)


def rank_and_top(
    logits: torch.Tensor, chosen_logits: torch.Tensor, log_normalizer: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rank [N], top ids [N, k], top logprobs [N, k]) of the tokens whose raw logits are `chosen_logits`:
    rank = 1 + the number of tokens with a strictly higher logit (so a strictly higher logprob)."""
    ranks = 1 + (logits > chosen_logits.unsqueeze(-1)).sum(dim=-1)
    top = torch.topk(logits, k=min(k, logits.shape[-1]), dim=-1)
    return ranks, top.indices, top.values - log_normalizer.unsqueeze(-1)


def min_p_mask(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Sets to -inf the tokens whose probability is below min_p times the best token's (vLLM's min_p),
    compared in log space: logit < max logit + log(min_p). min_p 0 keeps every token."""
    threshold = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p).unsqueeze(-1)
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def _sample_random(
    logits: torch.Tensor, tensors: SamplingTensors, is_greedy: torch.Tensor, noise_fn: NoiseFn
) -> torch.Tensor:
    """Gumbel-max draw for every row (greedy rows get temperature 1 here and are overridden by the caller)."""
    temperature = torch.where(is_greedy, torch.ones_like(tensors.temperature), tensors.temperature)
    scaled = logits / temperature.unsqueeze(-1)
    if tensors.uses_min_p:
        scaled = min_p_mask(scaled, tensors.min_p)
    noise = noise_fn(tensors.seed, tensors.position, logits.shape[-1])
    if not tensors.uses_top_k_top_p:
        return (scaled + noise).argmax(dim=-1)
    # Sort descending; stable, so ties break toward the lower token id whatever the batch.
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    kept = _mask_top_k_top_p(sorted_logits, tensors.top_k, tensors.top_p)
    winner = (kept + noise.gather(-1, sorted_ids)).argmax(dim=-1, keepdim=True)
    return sorted_ids.gather(-1, winner).squeeze(-1)


def _mask_top_k_top_p(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sets to -inf every sorted (descending) logit outside the row's top-k, then outside its top-p nucleus:
    the smallest prefix whose probability mass reaches p. The best token is always kept."""
    vocab_size = sorted_logits.shape[-1]
    ranks = torch.arange(vocab_size, device=sorted_logits.device)
    k = top_k.to(torch.int64)
    k = torch.where((k <= 0) | (k > vocab_size), vocab_size, k)
    outside_top_k = ranks.unsqueeze(0) >= k.unsqueeze(-1)
    masked = sorted_logits.masked_fill(outside_top_k, float("-inf"))

    probs = masked.softmax(dim=-1)
    # Mass of the strictly better tokens: a token is needed only while that mass is still below p.
    mass_before = probs.cumsum(dim=-1) - probs
    outside_top_p = (mass_before >= top_p.unsqueeze(-1)) & (top_p.unsqueeze(-1) < 1.0)
    outside_top_p[:, 0] = False
    return masked.masked_fill(outside_top_p, float("-inf"))


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise float32 [N, vocab_size], a pure function of (seed[i], position[i], vocab index).

    A counter-based generator: two 32-bit row keys are derived from the row's seed and position, and each
    vocab index is hashed under them with two rounds of murmur3's fmix32 finalizer. All integer arithmetic is
    int64 holding values below 2**32 (products stay below 2**49), so every op is well defined and gives the
    same bits on every device; a fused kernel computing the same uint32 hash would give the same noise.
    The 32 hash bits become u in (0, 1) in float64, and the noise is -log(-log(1 - u)). 1 - u is exact in
    float64 (u has at most 33 significant bits), so the large-noise tail (small -log(1 - u)) keeps full
    precision: draws up to ~23 nats above the mean. Only `log` is used (no log1p), so a kernel computing the
    same float64 ops with the device's log gets the same bits (kernels/triton_temperature_sample.py).
    """
    key_a, key_b = _row_keys(seed, position)
    vocab_ids = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    bits = key_a.unsqueeze(-1) ^ vocab_ids.unsqueeze(0)
    _fmix32_(bits)
    bits ^= key_b.unsqueeze(-1)
    _fmix32_(bits)
    noise = bits.to(torch.float64)
    del bits
    noise.add_(0.5).mul_(2.0**-32)  # u in (0, 1), never 0 or 1
    noise.neg_().add_(1.0).log_().neg_()  # exponential: -log(1 - u) > 0 (1 - u exact)
    noise.log_().neg_()  # Gumbel: -log(exponential)
    return noise.to(torch.float32)


def _row_keys(seed: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent 32-bit keys per row, each a hash chain over the 32-bit words of (seed, position)."""
    words = (seed & _MASK32, (seed >> 32) & _MASK32, position & _MASK32, (position >> 32) & _MASK32)
    keys = []
    for start in (_KEY_A_START, _KEY_B_START):
        key = torch.full_like(seed, start)
        for word in words:
            key ^= word
            _fmix32_(key)
        keys.append(key)
    return keys[0], keys[1]


def _fmix32_(x: torch.Tensor) -> None:
    """murmur3's 32-bit finalizer, in place on int64 values in [0, 2**32): a bijection with full avalanche."""
    x ^= x >> 16
    _mul32_(x, 0x85EBCA6B)
    x ^= x >> 13
    _mul32_(x, 0xC2B2AE35)
    x ^= x >> 16


def _mul32_(x: torch.Tensor, constant: int) -> None:
    """x = x * constant mod 2**32, in place, for x in [0, 2**32), without any int64 overflow: the constant is
    split in 16-bit halves so each partial product stays below 2**48."""
    high = x * (constant >> 16)
    high &= _MASK16
    high <<= 16
    x *= constant & _MASK16
    x += high
    x &= _MASK32
