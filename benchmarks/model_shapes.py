"""The benchmark model shapes of DESIGN.md, as Hugging Face configs (random weights: no hub on GPU machines).

MoE shapes (Qwen3-30B-A3B, Mixtral-8x7B): a decode step reads every non-expert weight and, in each sparse
layer, only the experts some token of the batch chose. `decode_weight_bytes` counts those, with the expected
number of distinct experts a batch of B tokens picks under uniform routing, E * (1 - (1 - k / E)^B): at
W1's 256 sequences that is every expert of both shapes (the floor is then all weight bytes), at batch 1 only k.
"""

from __future__ import annotations

from pathlib import Path

SHAPES = {
    "qwen2.5-1.5b": dict(
        architecture="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1_000_000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
    ),
    "llama-3.1-8b": dict(
        architecture="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
        rope_theta=500_000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
    ),
    "qwen3-30b-a3b": dict(
        architecture="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
        rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    ),
    "mixtral-8x7b": dict(
        architecture="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False,
        rope_theta=1_000_000.0, max_position_embeddings=32768, rms_norm_eps=1e-5,
        num_local_experts=8, num_experts_per_tok=2,
    ),
}
CONFIG_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
                  "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
                  "mixtral": ("MixtralConfig", "MixtralForCausalLM")}


def hf_config(shape: str, **overrides):
    """The transformers config of `shape`, with `overrides` (e.g. num_hidden_layers) applied before it is built,
    so that fields derived from them (such as layer_types) follow."""
    import transformers

    fields = {**SHAPES[shape], **overrides}
    config_name, model_class = CONFIG_CLASSES[fields.pop("architecture")]
    config_class = getattr(transformers, config_name)
    return config_class(**fields, bos_token_id=1, eos_token_id=2, architectures=[model_class])


def write_config_dir(shape: str, directory: Path) -> Path:
    """A model directory holding only config.json: served with --load-format dummy."""
    directory.mkdir(parents=True, exist_ok=True)
    hf_config(shape).save_pretrained(directory)
    return directory


def head_dim(shape: str) -> int:
    s = SHAPES[shape]
    return s.get("head_dim") or s["hidden_size"] // s["num_attention_heads"]


def experts(shape: str) -> tuple[int, int, int]:
    """(experts per sparse layer, chosen per token, expert width); (0, 0, 0) for a dense shape. Every layer of
    both MoE shapes is sparse."""
    s = SHAPES[shape]
    num_experts = s.get("num_experts") or s.get("num_local_experts") or 0
    width = s.get("moe_intermediate_size") or s["intermediate_size"]
    return (num_experts, s["num_experts_per_tok"], width) if num_experts else (0, 0, 0)


def _always_read_parameters(shape: str) -> int:
    """Parameters every step reads: attention, norms, routers, dense MLPs, embeddings and head."""
    s = SHAPES[shape]
    h, layers, v = s["hidden_size"], s["num_hidden_layers"], s["vocab_size"]
    q, kv = s["num_attention_heads"] * head_dim(shape), s["num_key_value_heads"] * head_dim(shape)
    num_experts = experts(shape)[0]
    per_layer = 2 * h * q + 2 * h * kv + 2 * h + (h * num_experts if num_experts else 3 * h * s["intermediate_size"])
    if "head_dim" in s:  # Qwen3's q/k norms
        per_layer += 2 * head_dim(shape)
    if s["architecture"] == "qwen2":  # q/k/v biases
        per_layer += q + 2 * kv
    embeddings = v * h * (1 if s["tie_word_embeddings"] else 2)
    return layers * per_layer + embeddings + h


def parameter_bytes(shape: str, bytes_per_param: int = 2) -> int:
    num_experts, _, width = experts(shape)
    expert_params = SHAPES[shape]["num_hidden_layers"] * num_experts * 3 * SHAPES[shape]["hidden_size"] * width
    return (_always_read_parameters(shape) + expert_params) * bytes_per_param


def expected_experts_read(shape: str, batch: int) -> float:
    """Distinct experts a sparse layer reads for `batch` tokens routed uniformly: E * (1 - (1 - k / E)^B)."""
    num_experts, top_k, _ = experts(shape)
    return num_experts * (1 - (1 - top_k / num_experts) ** batch) if num_experts else 0.0


def decode_weight_bytes(shape: str, batch: int, bytes_per_param: int = 2) -> float:
    """Weight bytes one decode step of `batch` sequences reads: all of a dense shape; for MoE the always-read
    parameters plus, per layer, 3 * hidden * width for each expert read (expected_experts_read)."""
    num_experts, _, width = experts(shape)
    if not num_experts:
        return parameter_bytes(shape, bytes_per_param)
    s = SHAPES[shape]
    read_experts = s["num_hidden_layers"] * expected_experts_read(shape, batch) * 3 * s["hidden_size"] * width
    return (_always_read_parameters(shape) + read_experts) * bytes_per_param


def active_parameters_per_token(shape: str) -> int:
    """Parameters one token multiplies by (its k experts only): the prefill FLOPs are 2 per parameter."""
    num_experts, top_k, width = experts(shape)
    s = SHAPES[shape]
    return _always_read_parameters(shape) + s["num_hidden_layers"] * top_k * 3 * s["hidden_size"] * width


def kv_bytes_per_token(shape: str, bytes_per_value: int = 2) -> int:
    s = SHAPES[shape]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * head_dim(shape) * bytes_per_value
