"""The sparse mixture-of-experts block (Mixtral, Qwen3-MoE): a router and E gated-MLP experts, stacked.

Why stacked parameters instead of E GatedMLP modules: the fused MoE op (kernels/fused_moe_ref.py, Triton in
kernels/triton_fused_moe.py) reads all experts as two tensors, w13 [E, 2I, H] (each expert's gate rows then
up rows) and w2 [E, H, I], and picks each token's experts inside one kernel launch, not E Python calls.

Tensor parallel (as vLLM's FusedMoE without expert parallelism): every rank holds every expert, but only its
share of the intermediate dimension I, the gate and up rows `tp.shard(I)` of w13 and the same columns of w2,
just as GatedMLP splits its width; the router is replicated, so every rank routes alike, and the block's
output is all-reduced once. Each rank reads only its slices of the checkpoint.

Checkpoints name experts one by one (`experts.N.w1` gate / `w3` up / `w2` down in Mixtral's hub files,
`experts.N.gate_proj` / `up_proj` / `down_proj` in Qwen3-MoE's) or, as transformers 5 holds them in memory,
stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); `load` takes either (the model
file maps the names, worker_svc/models/sparse_moe.py).

FP8 (`quantize_fp8`, set by the model loader from ModelConfig.quantization): the experts hold float8_e4m3fn
weights with one float32 scale per expert and output row, `w13_scale` [E, 2 * I / N] (split like w13's rows)
and `w2_scale` [E, H] (whole on every rank: w2's rows are the hidden size). From a compressed-tensors checkpoint
each expert's projections come float8 with `weight_scale` [out, 1] (per channel) or [1] (per tensor: that
value on every row); `--quantization fp8` loads the experts in the model's dtype and `process_after_loading`
quantizes them per (expert, row). Weight-only: the GEMMs dequantize the weights, the activations stay in the
model's dtype (kernels/fused_moe_ref.py). The router stays unquantized, as in vLLM.

Weight-only integer (`quantize_integer`: AWQ, GPTQ, compressed-tensors W4A16 / W8A16): the experts' format is
worker_svc/layers/wna16_experts.py's; the block holds `w13_<kind>` / `w2_<kind>` parameters named after the
checkpoint's tensor kinds until `process_after_loading`, then the canonical packed layout (`w13_qweight`,
`w13_scales`, `w13_zeros`, likewise w2), which the same `ops.fused_moe` reads as kernels/wna16_ref.py's
PackedExperts. The router stays unquantized (AWQ and GPTQ tools skip it).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.fp8_linear_ref import FP8_DTYPE, quantize_weight_per_channel
from kernels.layer_ops import LayerOps
from worker_svc.integer_quantization import IntegerScheme
from worker_svc.layers.checkpoint_tensor import CheckpointTensor, copy_into
from worker_svc.layers.wna16_experts import Wna16Experts
from worker_svc.quantization_config import ONLINE_FP8, QuantizationScheme
from worker_svc.tensor_parallel import TensorParallel

GATE, UP = 0, 1  # parts of w13
ALL_EXPERTS = -1  # `load`'s expert for a stacked checkpoint tensor
WEIGHTS, SCALES = ("w13_weight", "w2_weight"), ("w13_scale", "w2_scale")


class FusedMoE(nn.Module):
    """Router `gate` (a replicated [E, H] linear) and the stacked experts `w13_weight` [E, 2 * I / N, H] and
    `w2_weight` [E, H, I / N] of this rank. `renormalize`: divide the top-k weights by their sum (Mixtral;
    Qwen3-MoE's norm_topk_prob). `round_routing_weights`: the weights are cast to the activation dtype before
    they scale the expert outputs (Qwen3-MoE), or stay fp32 (Mixtral), as in transformers. `fp8`: the FP8
    scheme of the experts (None: unquantized); `w13_scale`, `w2_scale` are None until they are quantized.
    `integer`: the integer experts' format (None: float or FP8 experts), which then replaces w13_weight and
    w2_weight by its own parameters (module docstring)."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int, top_k: int, renormalize: bool,
                 round_routing_weights: bool, ops: LayerOps, tp: TensorParallel):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts")
        self.ops, self.tp = ops, tp
        self.top_k, self.renormalize, self.round_routing_weights = top_k, renormalize, round_routing_weights
        self.intermediate_size = intermediate_size
        self.shard_start, self.shard_size = tp.shard(intermediate_size)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.shard_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.shard_size))
        self.fp8: QuantizationScheme | None = None
        self.integer: Wna16Experts | None = None
        self.register_parameter("w13_scale", None)
        self.register_parameter("w2_scale", None)

    def quantize_fp8(self, scheme: QuantizationScheme) -> None:
        """Holds the experts as `scheme` loads them (on the current device: the loader's meta device): float8
        weights and float32 scales from a checkpoint, or the model's dtype until `process_after_loading`
        (online)."""
        self.fp8 = scheme
        if scheme.method == ONLINE_FP8:
            return
        for kind, scale_kind in zip(WEIGHTS, SCALES):
            weight = getattr(self, kind)
            setattr(self, kind, nn.Parameter(torch.empty(weight.shape, dtype=FP8_DTYPE), requires_grad=False))
            setattr(self, scale_kind, nn.Parameter(torch.empty(weight.shape[:2], dtype=torch.float32),
                                                   requires_grad=False))

    def quantize_integer(self, scheme: IntegerScheme, dtype: torch.dtype) -> None:
        """Holds the experts as an integer checkpoint stores them (on the current device: the loader's meta
        device), scales in `dtype`; raises if act-order or this rank's share of I cannot be served."""
        integer = Wna16Experts(scheme, self.w13_weight.shape[0], self.w13_weight.shape[2], self.intermediate_size,
                               self.shard_start, self.shard_size)
        del self.w13_weight, self.w2_weight
        self.integer = integer
        integer.create_weights(self, dtype)

    def parameter_kind(self, tensor_kind: str, down: bool) -> str:
        """Our parameter for an expert projection's checkpoint tensor `tensor_kind` ("weight", "weight_scale",
        "qweight", ...): w13_weight / w13_scale (FP8) or, integer, w13_<tensor_kind>; w2 alike when `down`."""
        projection = "w2" if down else "w13"
        float_kinds = {"weight": f"{projection}_weight", "weight_scale": f"{projection}_scale"}
        if self.integer is not None or tensor_kind not in float_kinds:  # an unknown kind names no parameter
            return f"{projection}_{tensor_kind}"
        return float_kinds[tensor_kind]

    @staticmethod
    def checkpoint_kind(parameter_kind: str) -> str:
        """The inverse of `parameter_kind`: the expert projections' tensor kind that fills a block parameter."""
        kind = parameter_kind.split("_", 1)[1]
        return {"weight": "weight", "scale": "weight_scale"}.get(kind, kind)

    @torch.no_grad()
    def process_after_loading(self) -> None:
        """Online FP8: quantizes each expert's rows (amax / 448 per (expert, row)); integer: converts the experts
        to the canonical layout; else nothing to do."""
        if self.integer is not None:
            self.integer.process_after_loading(self)
            return
        if self.fp8 is None or self.fp8.method != ONLINE_FP8:
            return
        for kind, scale_kind in zip(WEIGHTS, SCALES):
            weight, scales = quantize_weight_per_channel(getattr(self, kind))
            setattr(self, kind, nn.Parameter(weight, requires_grad=False))
            setattr(self, scale_kind, nn.Parameter(scales.contiguous(), requires_grad=False))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        router_logits = self.ops.linear(hidden, self.gate.weight, None)
        experts = (self.w13_weight, self.w2_weight) if self.integer is None else self.integer.packed(self)
        weights = (hidden, router_logits, *experts, self.top_k, self.renormalize, self.round_routing_weights)
        if self.w13_scale is None:
            output = self.ops.fused_moe(*weights)
        else:
            output = self.ops.fused_moe(*weights, w13_scale=self.w13_scale, w2_scale=self.w2_scale)
        return self.tp.all_reduce(output)

    def load(self, kind: str, checkpoint: CheckpointTensor, part: tuple[int, int] = (ALL_EXPERTS, GATE)) -> None:
        """Copies this rank's slice of a checkpoint tensor into `kind` ("w13_weight", "w2_weight"; FP8 checkpoints:
        "w13_scale", "w2_scale"). `part` is (expert, GATE or UP): one expert's [I, H] gate or up rows, or [H, I]
        down weight (or its weight_scale); expert ALL_EXPERTS for the stacked [E, 2I, H] gate|up or [E, H, I]
        down tensor (the projection part is then ignored). Integer experts: `kind` is w13_<tensor kind> or
        w2_<tensor kind> (`parameter_kind`), read per expert."""
        expert, projection = part
        if self.integer is not None:
            self._load_integer(kind, checkpoint, expert, projection)
            return
        start, size = self.shard_start, self.shard_size
        num_experts, hidden, inter = self.w13_weight.shape[0], self.w13_weight.shape[2], self.intermediate_size
        if kind not in WEIGHTS + SCALES or getattr(self, kind) is None:
            raise ValueError(f"{kind} is not a parameter of the MoE block")
        if kind in SCALES:
            self._load_scale(kind, checkpoint, expert, projection)
            return
        down = kind == "w2_weight"
        if expert == ALL_EXPERTS:
            check_shape(checkpoint, (num_experts, hidden, inter) if down else (num_experts, 2 * inter, hidden))
            if down:
                _copy_weight(self.w2_weight, checkpoint.narrow(2, start, size))
            else:
                _copy_weight(self.w13_weight[:, :size], checkpoint.narrow(1, start, size))
                _copy_weight(self.w13_weight[:, size:], checkpoint.narrow(1, inter + start, size))
            return
        if not 0 <= expert < num_experts:
            raise ValueError(f"expert {expert} is not one of the {num_experts} experts (num_experts)")
        check_shape(checkpoint, (hidden, inter) if down else (inter, hidden))
        if down:
            _copy_weight(self.w2_weight[expert], checkpoint.columns(start, size))
        else:
            _copy_weight(self.w13_weight[expert, projection * size : (projection + 1) * size],
                         checkpoint.rows(start, size))

    def _load_integer(self, kind: str, checkpoint: CheckpointTensor, expert: int, projection: int) -> None:
        num_experts = self.integer.num_experts
        if expert == ALL_EXPERTS:
            raise ValueError(f"{kind}: integer experts are read per expert, not stacked")
        if not 0 <= expert < num_experts:
            raise ValueError(f"expert {expert} is not one of the {num_experts} experts (num_experts)")
        if not hasattr(self, kind) or not kind.startswith(("w13_", "w2_")):
            raise ValueError(f"{kind} is not a parameter of the MoE block ({self.integer.scheme.describe()})")
        self.integer.load(self, kind, expert, projection, checkpoint)

    def _load_scale(self, kind: str, checkpoint: CheckpointTensor, expert: int, projection: int) -> None:
        """One expert's weight_scale: [rows, 1] per channel (this rank's rows of w13's part; w2's whole), or [1]
        per tensor, which becomes that value on each of the part's rows."""
        if expert == ALL_EXPERTS:
            raise ValueError(f"{kind}: FP8 expert scales are read per expert, not stacked")
        if not 0 <= expert < self.w13_weight.shape[0]:
            raise ValueError(f"expert {expert} is not one of the {self.w13_weight.shape[0]} experts (num_experts)")
        down = kind == "w2_scale"
        rows = self.w2_weight.shape[1] if down else self.intermediate_size
        target = self.w2_scale[expert] if down else \
            self.w13_scale[expert, projection * self.shard_size : (projection + 1) * self.shard_size]
        if self.fp8.weight_strategy == "tensor":
            check_shape(checkpoint, (1,))
            copy_into(target, checkpoint.full().reshape(1).expand(target.shape))
            return
        check_shape(checkpoint, (rows, 1))
        source = checkpoint.full() if down else checkpoint.rows(self.shard_start, self.shard_size)
        copy_into(target, source.reshape(target.shape))


def _copy_weight(target: torch.Tensor, source: torch.Tensor) -> None:
    """copy_into, except that an unquantized tensor is not cast into a float8 parameter silently."""
    if target.dtype == FP8_DTYPE and source.dtype != FP8_DTYPE:
        raise ValueError(f"the experts of an FP8 checkpoint are {FP8_DTYPE}, not {source.dtype}")
    copy_into(target, source)


def check_shape(checkpoint: CheckpointTensor, expected: tuple[int, ...]) -> None:
    """A sliced tensor's own shape must be the model's: a slice of a wider one would load silently."""
    if tuple(checkpoint.shape) != expected:
        raise ValueError(f"checkpoint shape {tuple(checkpoint.shape)} != {expected}")
