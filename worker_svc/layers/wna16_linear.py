"""Weight-only integer linear method (W4A16, W8A16): AWQ, GPTQ and compressed-tensors pack-quantized checkpoints.

Who owns what: a layer first holds the checkpoint's own tensors, under the checkpoint's names and with this
rank's shapes (`create_weights`), so llama.py's name mapping loads them unchanged and each parallel layer
takes its slice where `layout` says the output or input dimension lies:

- awq: qweight int32 [K, N/p] (packed along N in AWQ's interleaved order), qzeros int32 [K/G, N/p] (likewise),
  scales [K/G, N];
- gptq: qweight int32 [K/p, N] (packed along K), qzeros int32 [K/G, N/p] (v1: zero - 1), scales [K/G, N],
  g_idx [K];
- pack-quantized: weight_packed int32 [N, K/p], weight_scale [N, K/G], weight_zero_point int32 [N/p, K/G]
  (asymmetric), weight_shape [2], weight_g_idx [K] (actorder "group");

(one fused part on one rank: N output rows, K input columns, G per group, p = 32 // bits values per int32).
`process_after_loading` turns them into the one layout the kernels read (kernels/wna16_ref.py: qweight int32
[K/p, N] packed along K, scales [K/G, N] in the model's dtype, zeros [K/G, N] as floats or None for
symmetric), and frees the originals. Per channel (GPTQ group_size -1, compressed-tensors strategy channel),
G is this rank's K: the scales are whole on every rank.

Act-order (GPTQ desc_act, compressed-tensors actorder "group"): g_idx gives each input column its group, out of
order. The loader sorts K by g_idx, so the groups are contiguous, and `apply` permutes x's columns alike: the
same product. All fused parts must share one g_idx (GPTQ gives the projections of one input the same order);
a row-parallel layer split over ranks is refused (its groups span ranks).

Where it runs, chosen once at load: on a CUDA device kernels/triton_wna16_linear.py (the Triton GEMM for a
decode's few rows, the dequantized weight and a dense matmul for more), elsewhere (the CPU: CI) the torch
reference, which dequantizes in float32 and multiplies in x's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import nn

from kernels.wna16_ref import pack_factor, pack_rows, unpack_rows, wna16_linear_ref
from worker_svc.integer_quantization import AWQ, GPTQ, PACK_QUANTIZED, IntegerScheme
from worker_svc.layers.checkpoint_tensor import PER_PART, TensorLayout

# AWQ packs the eight 4-bit columns n0 .. n0 + 7 of a word in the order 0, 2, 4, 6, 1, 3, 5, 7 (lowest bits
# first): column j sits at position AWQ_POSITION[j].
AWQ_POSITION = (0, 4, 1, 5, 2, 6, 3, 7)
INDEX_KINDS = ("g_idx", "weight_g_idx")  # one group index per input column
SCALE_KINDS = ("scales", "weight_scale")
# Output columns converted at a time at load: unpacked, a 70B layer's integers would take GBs of temporaries.
CONVERT_COLUMNS = 4096


class CanonicalWeights(NamedTuple):
    """One layer's weights in the canonical layout (kernels/wna16_ref.py); `input_permutation`: act-order's
    permutation of x's columns (None: in order)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    input_permutation: torch.Tensor | None


class Wna16Linear:
    """The weight-only integer method of one model (module docstring); `triton`: run the Triton GEMM (a CUDA
    device), else the torch reference."""

    def __init__(self, scheme: IntegerScheme, triton: bool):
        self.scheme = scheme
        self.bits = scheme.bits
        self.pack = pack_factor(scheme.bits)
        if triton:
            from kernels.triton_wna16_linear import wna16_linear

            self.kernel = wna16_linear
        else:
            self.kernel = wna16_linear_ref

    def create_weights(self, layer: nn.Module, output_size: int, input_size: int, num_parts: int,
                       dtype: torch.dtype | None) -> None:
        if self.scheme.act_order and layer.splits_input:
            raise ValueError(f"{self.scheme.describe()}: act-order (g_idx) on a row-parallel layer split over "
                             f"tensor-parallel ranks is not served (its groups span ranks); serve it on one rank")
        for kind, (shape, kind_dtype) in self.checkpoint_shapes(output_size, input_size, num_parts, dtype).items():
            setattr(layer, kind, nn.Parameter(torch.empty(shape, dtype=kind_dtype), requires_grad=False))

    def checkpoint_shapes(self, output_size: int, input_size: int, num_parts: int,
                          dtype: torch.dtype | None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The checkpoint tensors one layer (or one MoE expert: worker_svc/layers/wna16_experts.py) of this shard
        holds before `canonical_weights`: kind -> (shape, dtype)."""
        scheme, pack = self.scheme, self.pack
        group = scheme.group_size or input_size  # a shard that splits a group is refused by the layer (layout)
        groups = input_size // group
        dtype = dtype or torch.get_default_dtype()
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
        if scheme.checkpoint_format == PACK_QUANTIZED:
            shapes = {"weight_packed": ((output_size, input_size // pack), torch.int32),
                      "weight_scale": ((output_size, groups), dtype),
                      "weight_shape": ((num_parts, 2), torch.int64)}
            if not scheme.symmetric:
                shapes["weight_zero_point"] = ((output_size // pack, groups), torch.int32)
            if scheme.act_order:
                shapes["weight_g_idx"] = ((num_parts, input_size), torch.int32)
        else:
            packed = (input_size, output_size // pack) if scheme.method == AWQ else (input_size // pack, output_size)
            shapes = {"qweight": (packed, torch.int32), "scales": ((groups, output_size), dtype)}
            # Written even when symmetric: GPTQ's 2**(bits - 1) - 1 (unread), AWQ zero_point=False's 2**(bits - 1) (read).
            shapes["qzeros"] = ((groups, output_size // pack), torch.int32)
            if scheme.method == GPTQ:
                shapes["g_idx"] = ((num_parts, input_size), torch.int32)
        return shapes

    def layout(self, kind: str) -> TensorLayout:
        pack, group = self.pack, self.scheme.group_size
        packed = f"{pack} {self.bits}-bit values packed in an int32"
        grouped = f"one scale per group of {group} input columns"
        per_group = None if group is None else 0  # the checkpoint's group axis, for the [K/G, N] formats
        if self.scheme.checkpoint_format == PACK_QUANTIZED:
            return {
                "weight_packed": TensorLayout(0, 1, 1, pack, packed),
                "weight_scale": TensorLayout(0, 1, None if group is None else 1, group or 1, grouped),
                "weight_zero_point": TensorLayout(0, pack, None if group is None else 1, group or 1,
                                                  f"{packed}, {grouped}"),
                "weight_g_idx": TensorLayout(None, 1, 0, 1),
            }.get(kind, PER_PART)  # weight_shape: one per part
        layouts = {
            "qweight": TensorLayout(1, pack, 0, 1, packed) if self.scheme.method == AWQ
            else TensorLayout(1, 1, 0, pack, packed),
            "qzeros": TensorLayout(1, pack, per_group, group or 1, f"{packed}, {grouped}"),
            "scales": TensorLayout(1, 1, per_group, group or 1, grouped),
            "g_idx": TensorLayout(None, 1, 0, 1),
        }
        if kind not in layouts:  # e.g. a fused checkpoint tensor (Phi-3) of a kind the format does not have
            raise ValueError(f"{self.scheme.describe()} has no checkpoint tensor {kind!r}")
        return layouts[kind]

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module, part_rows: list[int]) -> None:
        tensors = {name: tensor for name, tensor in layer.named_parameters(recurse=False) if name != "bias"}
        canonical = self.canonical_weights(tensors)
        for kind in tensors:
            delattr(layer, kind)
        layer.qweight = nn.Parameter(canonical.qweight, requires_grad=False)
        layer.scales = nn.Parameter(canonical.scales, requires_grad=False)
        layer.zeros = None if canonical.zeros is None else nn.Parameter(canonical.zeros, requires_grad=False)
        layer.input_permutation = canonical.input_permutation

    @torch.no_grad()
    def canonical_weights(self, tensors: Mapping[str, torch.Tensor]) -> CanonicalWeights:
        """One layer's (or one MoE expert's) checkpoint tensors, as `checkpoint_shapes` names them -> the canonical
        layout (kernels/wna16_ref.py); act-order: K sorted by group, and the permutation x needs alike."""
        if self.scheme.checkpoint_format == PACK_QUANTIZED:
            qweight = tensors["weight_packed"].t()
            scales = tensors["weight_scale"].t()
            zeros = None if self.scheme.symmetric else unpack_rows(tensors["weight_zero_point"], self.bits).t()
            g_idx = tensors.get("weight_g_idx")
        elif self.scheme.method == AWQ:  # zero points always read (zero_point false: written as 2**(bits - 1))
            qweight = _by_columns(tensors["qweight"], lambda words: pack_rows(self._unpack_awq(words), self.bits),
                                  widen=self.pack)
            scales = tensors["scales"]
            zeros = self._unpack_awq(tensors["qzeros"])
            g_idx = None
        else:
            qweight, scales, g_idx = tensors["qweight"], tensors["scales"], tensors["g_idx"]
            zeros = None if self.scheme.symmetric else unpack_rows(tensors["qzeros"].t(), self.bits).t()
            if zeros is not None and self.scheme.checkpoint_format == GPTQ:  # v1 stores zero - 1
                zeros = (zeros + 1) & ((1 << self.bits) - 1)
        permutation = self._act_order(g_idx) if self.scheme.act_order else None
        if permutation is not None:
            qweight = _by_columns(qweight, lambda words: pack_rows(unpack_rows(words, self.bits)[permutation],
                                                                   self.bits))
        return CanonicalWeights(qweight.contiguous(), scales.contiguous(),
                                None if zeros is None else zeros.to(scales.dtype).contiguous(), permutation)

    def apply(self, layer: nn.Module, hidden: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.input_permutation is not None:
            hidden = hidden[..., layer.input_permutation]
        group_size = layer.qweight.shape[0] * self.pack // layer.scales.shape[0]
        return self.kernel(hidden, layer.qweight, layer.scales, layer.zeros, self.bits, group_size, bias=bias)

    @torch.no_grad()
    def fill_random(self, kind: str, parameter: torch.Tensor, generator: torch.Generator) -> None:
        """Random checkpoint tensors for `--load-format dummy`, that dequantize to weights of about N(0, 0.02):
        random integers, small scales (0.04 / 2**bits: a difference of two random `bits`-bit values has a
        standard deviation of about 2**bits / 2.5), trivial group indices."""
        if kind in SCALE_KINDS:
            parameter.fill_(0.04 / 2**self.bits)
        elif kind in INDEX_KINDS:
            columns = parameter.shape[-1]
            group = self.scheme.group_size or columns
            parameter.copy_((torch.arange(columns, device=parameter.device) // group).expand(parameter.shape))
        elif kind == "weight_shape":
            parameter.zero_()
        else:
            parameter.copy_(torch.randint(-2**31, 2**31, parameter.shape, generator=generator,
                                          device=parameter.device, dtype=torch.int64).to(torch.int32))

    def _unpack_awq(self, packed: torch.Tensor) -> torch.Tensor:
        """AWQ's int32 [R, N / 8] (eight columns per word, interleaved) -> the values [R, N] in column order."""
        by_position = unpack_rows(packed.t(), self.bits)  # [N, R]: row w * 8 + i holds word w's position i
        columns = torch.arange(by_position.shape[0], device=packed.device)
        order = torch.tensor(AWQ_POSITION, device=packed.device)
        return by_position[columns - columns % 8 + order[columns % 8]].t()

    def _act_order(self, g_idx: torch.Tensor) -> torch.Tensor | None:
        """The input permutation that sorts K by group (None: already sorted); raises if the fused parts'
        g_idx differ or a group does not hold exactly group_size columns."""
        if not all(torch.equal(g_idx[0], part) for part in g_idx[1:]):
            raise ValueError(f"{self.scheme.describe()}: the fused parts of this layer have different act orders "
                             f"(g_idx); serving them as one matmul needs one")
        order = g_idx[0].long()
        permutation = torch.argsort(order, stable=True)
        columns = torch.arange(order.numel(), device=order.device)
        if not torch.equal(order[permutation], columns // self.scheme.group_size):
            raise ValueError(f"{self.scheme.describe()}: g_idx does not give every group exactly "
                             f"{self.scheme.group_size} input columns")
        return None if torch.equal(permutation, columns) else permutation


def _by_columns(source: torch.Tensor, convert: Callable[[torch.Tensor], torch.Tensor], widen: int = 1) -> torch.Tensor:
    """`convert` applied to chunks of `source`'s columns (CONVERT_COLUMNS output columns each; `widen`: output
    columns per source column), concatenated along the columns: a conversion's temporaries stay small."""
    step = max(1, CONVERT_COLUMNS // widen)
    return torch.cat([convert(source[:, start : start + step]) for start in range(0, source.shape[1], step)], dim=1)
