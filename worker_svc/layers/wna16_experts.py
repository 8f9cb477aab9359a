"""Weight-only integer MoE experts (W4A16, W8A16: AWQ, GPTQ, compressed-tensors pack-quantized) of a FusedMoE block.

Who owns what: the block (worker_svc/layers/fused_moe.py) owns the parameters; this object knows their format.
As a dense integer layer (worker_svc/layers/wna16_linear.py), the block first holds the checkpoint's own tensors,
stacked per expert under `w13_<kind>` / `w2_<kind>` (kind: qweight, qzeros, scales, g_idx; or weight_packed,
weight_scale, weight_zero_point, weight_shape), each expert's slot shaped as `Wna16Linear.checkpoint_shapes` gives
for one linear layer of this rank: w13 = the gate and up projections fused (2 parts of I / N output rows, input H),
w2 = the down projection (output H, input I / N). Each expert's gate, up and down tensors load into their slot,
this rank's slice taken where the format's `TensorLayout` puts the dimension tensor parallel splits (w13's output
rows, w2's input columns). `process_after_loading` converts every expert with `Wna16Linear.canonical_weights` (the
same code as the dense layers: AWQ's un-interleave, GPTQ v1's zero - 1, compressed-tensors' transposes) and
replaces them by the canonical layout stacked (kernels/wna16_ref.py's `PackedExperts`): `w13_qweight` int32
[E, H / p, 2I / N] (gate columns, then up), `w13_scales` [E, H / G, 2I / N], `w13_zeros` alike or None;
`w2_qweight` [E, I / N / p, H], `w2_scales` [E, I / N / G, H], `w2_zeros`.

Refused, naming why: act-order (GPTQ desc_act, compressed-tensors actorder "group": the experts' inputs would
need a permutation per expert, which the grouped GEMM does not apply), and a tensor-parallel split of I that
breaks a packed int32 or a group.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.wna16_ref import PackedExperts
from worker_svc.integer_quantization import IntegerScheme
from worker_svc.layers.checkpoint_tensor import CheckpointTensor, copy_into, copy_part
from worker_svc.layers.wna16_linear import Wna16Linear

W13, W2 = "w13", "w2"
CANONICAL_KINDS = ("qweight", "scales", "zeros")


class Wna16Experts:
    """The integer format of one FusedMoE block's experts (module docstring): E experts, hidden size H, this rank's
    intermediate columns shard_start .. shard_start + shard_size - 1 of `intermediate_size`."""

    def __init__(self, scheme: IntegerScheme, num_experts: int, hidden_size: int, intermediate_size: int,
                 shard_start: int, shard_size: int):
        if scheme.act_order:
            raise ValueError(f"{scheme.describe()}: act-order (g_idx) on MoE experts is not served (the fused MoE "
                             f"kernel does not permute each expert's input); serve a checkpoint without act-order "
                             f"(GPTQ desc_act false)")
        self.scheme = scheme
        self.format = Wna16Linear(scheme, triton=False)  # its shapes, layouts and conversion; the block picks the kernel
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.shard_start, self.shard_size = shard_start, shard_size

    def create_weights(self, block: nn.Module, dtype: torch.dtype) -> None:
        """Registers the checkpoint tensors' stacked slots on `block`; raises if this rank's share of I would split
        an entry (a packed int32, a group) of one of them."""
        start, size = self.shard_start, self.shard_size
        shapes = {W13: (2 * size, self.hidden_size, 2), W2: (self.hidden_size, size, 1)}
        for projection, (output_size, input_size, num_parts) in shapes.items():
            for kind, (shape, kind_dtype) in self.format.checkpoint_shapes(output_size, input_size, num_parts,
                                                                           dtype).items():
                layout = self.format.layout(kind)
                axis, per_entry = ((layout.output_axis, layout.output_per_entry) if projection == W13
                                   else (layout.input_axis, layout.input_per_entry))
                if axis is not None and (start % per_entry or size % per_entry):
                    raise ValueError(f"{projection}_{kind}: the experts' intermediate size {self.intermediate_size} "
                                     f"split over tensor-parallel ranks gives this rank columns {start}.."
                                     f"{start + size - 1}, which do not fall on a boundary of the {per_entry} each "
                                     f"entry holds ({layout.entry})")
                parameter = torch.empty((self.num_experts, *shape), dtype=kind_dtype)
                setattr(block, f"{projection}_{kind}", nn.Parameter(parameter, requires_grad=False))

    def load(self, block: nn.Module, param_kind: str, expert: int, part: int, checkpoint: CheckpointTensor) -> None:
        """Copies this rank's slice of one expert's checkpoint tensor into its slot: `param_kind` is
        "<w13|w2>_<checkpoint kind>", `part` GATE (0) or UP (1) for w13."""
        projection, kind = param_kind.split("_", 1)
        layout = self.format.layout(kind)
        target = getattr(block, param_kind)[expert]
        start, size = self.shard_start, self.shard_size
        if projection == W2:
            source = checkpoint.full() if layout.input_axis is None else \
                layout.along(checkpoint, layout.input_axis, start, size)
            if layout.output_axis is None:  # one per part (a g_idx: this rank's input rows of it)
                copy_part(target[0], source)
            else:
                copy_into(target, source)
        elif layout.output_axis is None:
            copy_part(target[part], checkpoint.full())
        else:
            axis, per_entry = layout.output_axis, layout.output_per_entry
            place = target.narrow(axis, part * size // per_entry, size // per_entry)
            copy_into(place, layout.along(checkpoint, axis, start, size))

    @torch.no_grad()
    def process_after_loading(self, block: nn.Module) -> None:
        """Converts every expert to the canonical layout (module docstring) and frees the checkpoint tensors."""
        for projection in (W13, W2):
            prefix = f"{projection}_"
            kinds = [name.removeprefix(prefix) for name, _ in block.named_parameters(recurse=False)
                     if name.startswith(prefix)]
            converted = [self.format.canonical_weights({kind: getattr(block, prefix + kind)[expert] for kind in kinds})
                         for expert in range(self.num_experts)]
            for kind in kinds:
                delattr(block, prefix + kind)
            for index, kind in enumerate(CANONICAL_KINDS):
                tensors = [weights[index] for weights in converted]
                stacked = None if tensors[0] is None else nn.Parameter(torch.stack(tensors), requires_grad=False)
                setattr(block, prefix + kind, stacked)

    def packed(self, block: nn.Module) -> tuple[PackedExperts, PackedExperts]:
        """(w13, w2) as the fused MoE ops read them."""
        return tuple(PackedExperts(getattr(block, f"{projection}_qweight"), getattr(block, f"{projection}_scales"),
                                   getattr(block, f"{projection}_zeros"), self.scheme.bits)
                     for projection in (W13, W2))

    @torch.no_grad()
    def fill_random(self, param_kind: str, parameter: torch.Tensor, generator: torch.Generator) -> None:
        """`--load-format dummy`: each slot as the dense layers fill theirs (random integers, small scales)."""
        self.format.fill_random(param_kind.split("_", 1)[1], parameter, generator)
