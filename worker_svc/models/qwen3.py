"""Qwen3 (dense): the Llama layout with a per-head RMSNorm on queries and keys before rotary (`q_norm`,
`k_norm`, weights [head_dim]), an explicit head_dim (config.json's, not hidden / heads), no q/k/v bias and
usually tied embeddings. Everything else, tensor parallelism included, is the Llama family's (llama.py); the
norm is the shared layer's (worker_svc/layers/attention.py, `qk_norm`).
"""

from __future__ import annotations

from worker_svc.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
