"""Phi-3 (mini, small-attention-free variants: Phi3ForCausalLM): the Llama layout with q/k/v and gate/up stored
fused in the checkpoint (`self_attn.qkv_proj`, `mlp.gate_up_proj`), longrope scaling for the 128k-context models
(worker_svc/layers/rope_scaling.py, the table choice in rotary_embedding.py) and a sliding window on every layer
when the config has one (read by ModelConfig for every family).

Loading splits each fused checkpoint tensor into its parts as blocks that are still read lazily (`Block`), and
hands them to llama.py's loader under the unfused names, so each rank reads only its q, k, v, gate and up rows,
exactly as from a checkpoint that stores them apart. A quantized checkpoint's tensors are split where the fused
layer's linear method says their output dimension lies (an AWQ qweight: its packed columns); one that is not
per output row (a g_idx, a per-tensor scale) goes to every part whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from worker_svc.layers.checkpoint_tensor import Block, CheckpointTensor
from worker_svc.layers.parallel_linear import checkpoint_layout
from worker_svc.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        config = self.config
        q_rows = config.num_attention_heads * config.head_dim
        kv_rows = config.num_key_value_heads * config.head_dim
        parts = {
            ".self_attn.qkv_proj.": [(".self_attn.q_proj.", 0, q_rows), (".self_attn.k_proj.", q_rows, kv_rows),
                                     (".self_attn.v_proj.", q_rows + kv_rows, kv_rows)],
            ".mlp.gate_up_proj.": [(".mlp.gate_proj.", 0, config.intermediate_size),
                                   (".mlp.up_proj.", config.intermediate_size, config.intermediate_size)],
        }
        for name, tensor in weights:
            fused = next((marker for marker in parts if marker in name), None)
            if fused is None:
                yield name, tensor
                continue
            module_name, _, kind = name.rpartition(".")
            layer = self.get_submodule(module_name)
            layout = checkpoint_layout(layer, kind)
            if layout.output_axis is None:
                for marker, _, _ in parts[fused]:
                    yield name.replace(fused, marker), tensor
                continue
            axis, per_entry = layout.output_axis, layout.output_per_entry
            expected = sum(rows for _, _, rows in parts[fused])
            if tensor.shape[axis] * per_entry != expected:
                raise ValueError(f"{name}: {tensor.shape[axis] * per_entry} output rows, expected {expected}")
            for marker, start, rows in parts[fused]:
                if start % per_entry or rows % per_entry:
                    raise ValueError(f"{name}: its part {marker.strip('.')} (rows {start}..{start + rows - 1}) does "
                                     f"not fall on a boundary of the {per_entry} rows each entry holds")
                yield name.replace(fused, marker), Block(tensor, axis, start // per_entry, rows // per_entry)
