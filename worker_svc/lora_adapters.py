"""The worker's LoRA adapters: --max-loras GPU slots in every servable layer, and an LRU of adapters read into host
memory (--max-cpu-loras), so that loading one again into a slot skips the disk.

Who owns what: the scheduler decides which adapter sits in which slot (scheduler_svc/core/lora_slots.py) and
says so in the plan (`StepPlan.lora_loads`, applied before the step's forward pass: `load`); this object owns the
host copies and writes the slots; the model's layers hold the stacked slots (`LayerLora`, layers/layer_lora.py),
created at setup, zeros, for every served projection of every decoder layer (q|k|v, o, gate|up, down: an adapter
loaded later may target any of them). Slot s (NewRequest.lora_slot s >= 1) is index s - 1 of the stacks; base
tokens carry slot -1. The CUDA graphs captured the stacks' storage (worker_svc/decode_graphs.py, mixed_graphs.py), so
a load only ever copies into them in place, never re-allocates.

Loads on a side stream (on a GPU): a load's copies (host -> slot) run on a stream of their own, which first waits
for the work already queued on the step's stream (the previous step's forward pass may still read the slot's old
adapter: the scheduler evicts only an adapter no running row uses, but a row aborted while that pass is in flight
was using it), and an event after the copies marks the slot loaded. The step that first runs a token in the slot
has its stream wait on that event (`wait_for_loads`), so the copies overlap the step stream's work until then
instead of being queued in it. On the CPU the copies run at once and nothing waits.

Host copies are keyed by (name, path, generation): the scheduler's registry counts every runtime load of a name,
so an adapter unloaded, rewritten on disk and loaded again under the same name and path is read from its files
again rather than served from the host copy of its earlier weights.

A PEFT weights file names its tensors after the HF modules: `base_model.model.model.layers.3.self_attn.q_proj
.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]). q/k/v and gate/up go to their part of our fused
projection (the model's `_fused_target`, as the checkpoint loader does), and every layer takes this rank's slice
(layers/layer_lora.py says which). Layers an adapter leaves out (other modules, or other layers: PEFT's
layers_to_transform) hold zeros for it.

Refused, naming the adapter and what it cannot serve (a LoadRefused: the worker leaves with one line): keys the
adapter config already refuses (service_runtime/lora_modules.py), a tensor for a module the model does not have,
a tensor of any other kind (DoRA magnitudes, embeddings), shapes that do not match the model, and models whose
decoder layers are not the Llama family's (llama.py: Llama, Mistral, Qwen2, Qwen3) with a gated MLP. The
adapters of --lora-modules are read at setup (WorkerSetup.lora_adapters), so those refusals come before the
server starts; one loaded at run time was checked by the scheduler (config, tensor names and ranks), and only a
size mismatch with the model is left to fail here.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import load_file

from kernels.lora_ref import lora_add_fused as lora_add_reference
from protos.pagedserve.v1 import worker_pb2
from service_runtime.load_refusal import LoadRefused
from service_runtime.lora_modules import ADAPTER_WEIGHTS, SERVED_TARGETS, LoraModule, read_adapter_config
from worker_svc.layers.gated_mlp import GatedMLP
from worker_svc.layers.layer_lora import LayerLora, LoraAddFused
from worker_svc.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from worker_svc.models.llama import DecoderLayer, LlamaForCausalLM

_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.weight$")


@dataclass(frozen=True)
class HostAdapter:
    """One adapter read and sliced for this rank, in host memory: `tensors` maps (layer name, part, "lora_A" or
    "lora_B") to this rank's slice at the adapter's own rank (A [r, columns], B [rows, r])."""

    scaling: float
    rank: int
    tensors: dict[tuple[str, int, str], torch.Tensor]


class LoraAdapterSlots:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        _refuse_unserved_model(model)
        self._model, self._device, self._dtype = model, device, dtype
        self._max_lora_rank = max_lora_rank
        self._max_cpu_loras = max(max_cpu_loras, 1)
        self._pin = device.type == "cuda"
        padded_rank = stack_rank(max_lora_rank)
        lora_add = lora_kernel(device, padded_rank)
        # Whether CUDA graphs may capture the delta: the Triton kernel has no host sync; the torch reference (the
        # CPU, or a padded rank above the kernel's largest) loops over the slots present, so those run eagerly.
        self.capturable = lora_add is not lora_add_reference
        self.scalings = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.layers: dict[str, LayerLora] = {}
        for name, layer in servable_layers(model).items():
            part_rows = tuple(_output_rows(layer, part)[1] for part in range(_num_parts(layer)))
            if any(layer_offset(layer, part) != sum(part_rows[:part]) for part in range(len(part_rows))):
                raise ValueError(f"{name}: LoRA needs the fused parts' output columns in order, without gaps")
            layer.lora = self.layers[name] = LayerLora.zeros(part_rows, max_loras, padded_rank,
                                                             _input_columns(layer)[1], dtype, self.scalings, lora_add)
        self._host: OrderedDict[tuple[str, str, int], HostAdapter] = OrderedDict()
        self._load_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._loaded: dict[int, torch.cuda.Event] = {}  # slot index -> its last load's copies done (GPU only)

    def read(self, adapters: list[worker_pb2.LoraAdapterSetup]) -> None:
        """Reads the adapters of --lora-modules at setup (refusing one the model cannot serve) and keeps the
        last --max-cpu-loras of them in host memory."""
        for adapter in adapters:
            self._host_adapter(adapter.name, adapter.path)

    def load(self, loads: list[worker_pb2.LoraLoad]) -> None:
        """Writes each adapter into its GPU slot (every layer's, zeros where it has no tensor), on the load stream
        after the step stream's queued work (module docstring); `wait_for_loads` orders a step after them."""
        if not loads:
            return
        if self._load_stream is None:
            self._write_slots(loads)
            return
        self._load_stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._load_stream):
            self._write_slots(loads)
            for load in loads:
                event = torch.cuda.Event()
                event.record(self._load_stream)
                self._loaded[load.slot - 1] = event

    def wait_for_loads(self, token_slots: np.ndarray) -> None:
        """Orders the step stream's next work after the loads of the slots these tokens use (slot indexes, -1 for
        base tokens) that no earlier step waited for. A wait on the device: the host goes on."""
        if not self._loaded:
            return
        for index in np.unique(token_slots).tolist():
            event = self._loaded.pop(index, None)
            if event is not None:
                torch.cuda.current_stream(self._device).wait_event(event)

    def _write_slots(self, loads: list[worker_pb2.LoraLoad]) -> None:
        """The copies of `load` on the current stream: in place into the stacks the graphs captured."""
        for load in loads:
            adapter = self._host_adapter(load.name, load.path, load.generation)
            index = load.slot - 1
            self.scalings[index].fill_(adapter.scaling)
            for name, layer_lora in self.layers.items():
                for part_index, part in enumerate(layer_lora.parts):
                    part.lora_a[index].zero_()
                    part.lora_b[index].zero_()
                    lora_a = adapter.tensors.get((name, part_index, "lora_A"))
                    lora_b = adapter.tensors.get((name, part_index, "lora_B"))
                    if lora_a is not None:
                        part.lora_a[index, : adapter.rank].copy_(lora_a, non_blocking=self._pin)
                    if lora_b is not None:
                        part.lora_b[index, :, : adapter.rank].copy_(lora_b, non_blocking=self._pin)

    def _host_adapter(self, name: str, path: str, generation: int = 0) -> HostAdapter:
        """The adapter from the host LRU (moved to its end), else read from disk and cached (the least recently
        used dropped beyond --max-cpu-loras). Another generation of the same name and path is read again."""
        key = (name, path, generation)
        adapter = self._host.get(key)
        if adapter is not None:
            self._host.move_to_end(key)
            return adapter
        adapter = self._read(name, path)
        self._host[key] = adapter
        while len(self._host) > self._max_cpu_loras:
            self._host.popitem(last=False)
        return adapter

    def _read(self, name: str, path: str) -> HostAdapter:
        try:
            config = read_adapter_config(LoraModule(name, path), self._max_lora_rank)
        except (ValueError, OSError) as error:
            raise LoadRefused(str(error)) from None
        tensors = {}
        for key, tensor in load_file(os.path.join(path, ADAPTER_WEIGHTS)).items():
            layer_name, part, kind, sliced = self._slice(key, tensor, config.rank, name)
            sliced = sliced.to(self._dtype).contiguous()
            tensors[(layer_name, part, kind)] = sliced.pin_memory() if self._pin else sliced
        return HostAdapter(config.scaling, config.rank, tensors)

    def _slice(self, key: str, tensor: torch.Tensor, rank: int, adapter: str) -> tuple[str, int, str, torch.Tensor]:
        """One PEFT tensor's layer, part and kind, and this rank's slice of it; LoadRefused if it fits nothing."""
        match = _PEFT_KEY.match(key)
        if match is None:
            raise LoadRefused(f"LoRA adapter {adapter!r}: tensor {key!r} is not served (LoRA A/B of "
                              f"{', '.join(SERVED_TARGETS)} only)")
        hf_module, kind = match["module"], match["kind"]
        target, part = self._model._fused_target(hf_module + ".weight")
        layer_name = target.removesuffix(".weight")
        layer = self._model.get_submodule(layer_name) if layer_name in self.layers else None
        if hf_module.rpartition(".")[2] not in SERVED_TARGETS or layer is None:
            raise LoadRefused(f"LoRA adapter {adapter!r}: target module {hf_module!r}: the model has no such "
                              f"projection (LoRA is served on {', '.join(SERVED_TARGETS)})")
        rank_axis = tensor.shape[0] if kind == "lora_A" else tensor.shape[-1]
        if tensor.dim() != 2 or rank_axis != rank:
            raise LoadRefused(f"LoRA adapter {adapter!r}: {key}: shape {list(tensor.shape)} does not have rank {rank}")
        if kind == "lora_A":
            start, columns = _input_columns(layer)
            if tensor.shape[1] != _full_input_size(layer):
                raise LoadRefused(f"LoRA adapter {adapter!r}: {key}: {tensor.shape[1]} input features, the model's "
                                  f"projection has {_full_input_size(layer)}")
            return layer_name, part, kind, tensor[:, start : start + columns]
        start, rows = _output_rows(layer, part)
        if tensor.shape[0] < start + rows:
            raise LoadRefused(f"LoRA adapter {adapter!r}: {key}: {tensor.shape[0]} output features do not match "
                              "the model's projection")
        return layer_name, part, kind, tensor[start : start + rows]


def servable_layers(model: LlamaForCausalLM) -> dict[str, torch.nn.Module]:
    """Every decoder layer's projections an adapter may target, by module name (our fused names: qkv_proj,
    o_proj, gate_up_proj, down_proj)."""
    fused = {source.rpartition(".")[2]: target.rpartition(".")[2] for source, (target, _) in
             model._fused_slices().items()}
    names = {fused.get(target, target) for target in SERVED_TARGETS}
    return {name: module for name, module in model.named_modules()
            if name.rpartition(".")[2] in names and isinstance(module, (ColumnParallelLinear, RowParallelLinear))}


def stack_rank(max_lora_rank: int) -> int:
    """The rank adapters are padded to: a power of two, at least 16 (tl.dot's smallest side, for
    kernels/triton_lora.py)."""
    return max(16, 1 << (max_lora_rank - 1).bit_length())


def lora_kernel(device: torch.device, rank: int) -> LoraAddFused:
    """The torch reference on the CPU; on a GPU the Triton kernel of the same interface (kernels/triton_lora.py)
    up to its largest rank (128), else the reference."""
    if device.type == "cuda":
        from kernels.triton_lora import MAX_RANK, lora_add_fused

        if rank <= MAX_RANK:
            return lora_add_fused
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


def _num_parts(layer) -> int:
    return len(layer.shards) if isinstance(layer, ColumnParallelLinear) else 1


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
