"""Rotary inverse frequencies of each rope scaling type, as transformers computes them (modeling_rope_utils).

Why our own: the worker does not import transformers. Each function returns (inv_freq [rotary_dim / 2] fp32,
attention factor): the factor multiplies cos and sin (yarn's mscale, longrope's attention factor; 1 for the
others). The parameters are config.json's `rope_parameters` (or older `rope_scaling`), parsed and checked in
worker_svc/model_config.py (`parse_hf_rope`, which refuses every other type, naming the key).

- "linear": frequencies divided by `factor`.
- "llama3": long wavelengths divided by `factor`, short ones kept, a smooth blend between.
- "yarn": NTK-by-parts: interpolated (/factor) below the correction range, extrapolated above it, a linear ramp
  between; cos/sin scaled by 0.1 ln(factor) + 1 (or mscale / mscale_all_dim, or `attention_factor`).
- "longrope" (Phi-3): per-frequency `short_factor`s, and `long_factor`s for sequences longer than
  `original_max_position_embeddings`; cos/sin scaled by sqrt(1 + ln(factor) / ln(original)).
  `long_inv_freq` gives the long set; which set a token uses is RotaryEmbedding's rule (rotary_embedding.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (base**exponents)


def scaled_inv_freq(params: dict[str, Any] | None, base: float, dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor) for `params` (None: no scaling); longrope's short set."""
    rope_type = None if params is None else params["rope_type"]
    if rope_type is None:
        return default_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        return default_inv_freq(base, dim) / params["factor"], 1.0
    if rope_type == "llama3":
        return llama3_inv_freq(params, base, dim), 1.0
    if rope_type == "yarn":
        return yarn_inv_freq(params, base, dim)
    if rope_type == "longrope":
        return longrope_inv_freq(params, base, dim, params["short_factor"]), longrope_attention_factor(params)
    raise ValueError(f"rope_type {rope_type!r} has no frequencies here")


def llama3_inv_freq(params: dict[str, Any], base: float, dim: int) -> torch.Tensor:
    inv_freq = default_inv_freq(base, dim)
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_inv_freq(params: dict[str, Any], base: float, dim: int) -> tuple[torch.Tensor, float]:
    factor = params["factor"]
    original = params["original_max_position_embeddings"]

    def mscale(scale: float, coefficient: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def longrope_inv_freq(params: dict[str, Any], base: float, dim: int, factors) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * base**exponents)


def longrope_attention_factor(params: dict[str, Any]) -> float:
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params["factor"]
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(params["original_max_position_embeddings"]))
