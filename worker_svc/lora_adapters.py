"""Loads the served LoRA adapters (WorkerSetup.lora_adapters) into the model's parallel linear layers, once, at setup.

Who owns what: the model's layers hold the stacked weights afterwards (`LayerLora`, layers/layer_lora.py); this
module only reads each PEFT adapter directory and places its tensors. Slot i + 1 is the i-th adapter (the
scheduler's `lora_slot`), slot 0 stays zeros (the base model).

A PEFT weights file names its tensors after the HF modules: `base_model.model.model.layers.3.self_attn.q_proj
.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]). q/k/v and gate/up go to their part of our fused
projection (the model's `_fused_target`, as the checkpoint loader does), and every layer takes this rank's slice
(layers/layer_lora.py says which). Layers an adapter leaves out (other modules, or other layers: PEFT's
layers_to_transform) keep zeros for it.

Refused, naming the adapter and what it cannot serve (a LoadRefused: the worker leaves with one line): keys the
adapter config already refuses (service_runtime/lora_modules.py), a tensor for a module the model does not have,
a tensor of any other kind (DoRA magnitudes, embeddings), shapes that do not match the model, and models whose
decoder layers are not the Llama family's (llama.py: Llama, Mistral, Qwen2, Qwen3) with a gated MLP.
"""

from __future__ import annotations

import os
import re

import torch
from safetensors.torch import load_file

from kernels.lora_ref import lora_add as lora_add_reference
from protos.pagedserve.v1 import worker_pb2
from service_runtime.load_refusal import LoadRefused
from service_runtime.lora_modules import ADAPTER_WEIGHTS, SERVED_TARGETS, LoraModule, read_adapter_config
from worker_svc.layers.gated_mlp import GatedMLP
from worker_svc.layers.layer_lora import LayerLora, LoraAdd, LoraPart
from worker_svc.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from worker_svc.models.llama import DecoderLayer, LlamaForCausalLM

_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.weight$")


def load_lora_adapters(model: torch.nn.Module, adapters: list[worker_pb2.LoraAdapterSetup], max_lora_rank: int,
                       device: torch.device, dtype: torch.dtype) -> None:
    """Gives every layer some adapter targets its `LayerLora` (all adapters stacked, padded with zeros to
    `stack_rank(max_lora_rank)`: zeros add nothing)."""
    _refuse_unserved_model(model)
    padded_rank = stack_rank(max_lora_rank)
    lora_add = lora_kernel(device, padded_rank)
    num_slots = len(adapters) + 1
    scalings = torch.zeros(num_slots, dtype=torch.float32)
    stacks: dict[str, list[list[torch.Tensor]]] = {}  # layer name -> per part [A, B]
    for slot, adapter in enumerate(adapters, start=1):
        module = LoraModule(adapter.name, adapter.path)
        try:
            config = read_adapter_config(module, max_lora_rank)
        except ValueError as error:
            raise LoadRefused(str(error)) from None
        scalings[slot] = config.scaling
        weights = load_file(os.path.join(adapter.path, ADAPTER_WEIGHTS))
        for key, tensor in weights.items():
            _place(model, stacks, key, tensor, slot, num_slots, padded_rank, config.rank, adapter.name)
    scalings = scalings.to(device)
    for name, parts in stacks.items():
        layer = model.get_submodule(name)
        layer.lora = LayerLora(
            tuple(LoraPart(layer_offset(layer, part), b.shape[1], a.to(device, dtype), b.to(device, dtype))
                  for part, (a, b) in enumerate(parts)),
            scalings, lora_add)


def stack_rank(max_lora_rank: int) -> int:
    """The rank adapters are padded to: a power of two, at least 16 (tl.dot's smallest side, for
    kernels/triton_lora.py)."""
    return max(16, 1 << (max_lora_rank - 1).bit_length())


def lora_kernel(device: torch.device, rank: int) -> LoraAdd:
    """The torch reference on the CPU; on a GPU the Triton kernel of the same interface (kernels/triton_lora.py)
    up to its largest rank (128), else the reference."""
    if device.type == "cuda":
        from kernels.triton_lora import MAX_RANK, lora_add

        if rank <= MAX_RANK:
            return lora_add
    return lora_add_reference


def layer_offset(layer: torch.nn.Module, part: int) -> int:
    """Where the fused part `part` starts in the layer's output (0 for a row-parallel layer)."""
    return layer.offsets[part] if isinstance(layer, ColumnParallelLinear) else 0


def _refuse_unserved_model(model: torch.nn.Module) -> None:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if (not isinstance(model, LlamaForCausalLM) or layers is None
            or not all(type(layer) is DecoderLayer and isinstance(layer.mlp, GatedMLP) for layer in layers)):
        raise LoadRefused(f"LoRA adapters are served on the Llama-family models with a gated MLP (Llama, Mistral, "
                          f"Qwen2, Qwen3), not on {type(model).__name__}")


def _place(model: LlamaForCausalLM, stacks: dict, key: str, tensor: torch.Tensor, slot: int, num_slots: int,
           max_rank: int, rank: int, adapter: str) -> None:
    """Copies one PEFT tensor into its layer's stack (created, zeros, on first use), this rank's slice of it."""
    match = _PEFT_KEY.match(key)
    if match is None:
        raise LoadRefused(f"LoRA adapter {adapter!r}: tensor {key!r} is not served (LoRA A/B of "
                          f"{', '.join(SERVED_TARGETS)} only)")
    hf_module, kind = match["module"], match["kind"]
    target, part = model._fused_target(hf_module + ".weight")
    layer_name = target.removesuffix(".weight")
    try:
        layer = model.get_submodule(layer_name)
    except AttributeError:
        layer = None
    if hf_module.rpartition(".")[2] not in SERVED_TARGETS or not isinstance(
            layer, (ColumnParallelLinear, RowParallelLinear)):
        raise LoadRefused(f"LoRA adapter {adapter!r}: target module {hf_module!r}: the model has no such "
                          f"projection (LoRA is served on {', '.join(SERVED_TARGETS)})")
    parts = stacks.setdefault(layer_name, [_zero_stack(layer, part, num_slots, max_rank)
                                           for part in range(_num_parts(layer))])
    lora_a, lora_b = parts[part]
    expected_rank_axis = tensor.shape[0] if kind == "lora_A" else tensor.shape[1]
    if tensor.dim() != 2 or expected_rank_axis != rank:
        raise LoadRefused(f"LoRA adapter {adapter!r}: {key}: shape {list(tensor.shape)} does not have rank {rank}")
    if kind == "lora_A":
        columns = _input_columns(layer)
        if tensor.shape[1] != _full_input_size(layer):
            raise LoadRefused(f"LoRA adapter {adapter!r}: {key}: {tensor.shape[1]} input features, the model's "
                              f"projection has {_full_input_size(layer)}")
        lora_a[slot, :rank] = tensor[:, columns[0] : columns[0] + columns[1]]
    else:
        start, rows = _output_rows(layer, part)
        if tensor.shape[0] < start + rows:
            raise LoadRefused(f"LoRA adapter {adapter!r}: {key}: {tensor.shape[0]} output features do not match "
                              "the model's projection")
        lora_b[slot, :, :rank] = tensor[start : start + rows]


def _num_parts(layer) -> int:
    return len(layer.shards) if isinstance(layer, ColumnParallelLinear) else 1


def _zero_stack(layer, part: int, num_slots: int, max_rank: int) -> list[torch.Tensor]:
    """[A, B] of zeros for every slot: A [slots, R, this rank's input], B [slots, this rank's part rows, R]."""
    _, rows = _output_rows(layer, part)
    return [torch.zeros(num_slots, max_rank, _input_columns(layer)[1]), torch.zeros(num_slots, rows, max_rank)]


def _output_rows(layer, part: int) -> tuple[int, int]:
    """(first output row in the checkpoint's part, rows) this rank computes."""
    return layer.shards[part] if isinstance(layer, ColumnParallelLinear) else (0, layer.output_size)


def _input_columns(layer) -> tuple[int, int]:
    """(first input column, columns) this rank multiplies."""
    if isinstance(layer, ColumnParallelLinear):
        return 0, layer.input_size
    return layer.input_start, layer.local_input


def _full_input_size(layer) -> int:
    return layer.input_size if isinstance(layer, ColumnParallelLinear) else layer.local_input * layer.tp.world_size
