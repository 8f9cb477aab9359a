"""Whether a model and a machine can run at a tensor-parallel size, decided before any weight loads.

Why a module of its own, without torch: `pagedserve serve` refuses a bad --tensor-parallel-size before it
starts a process (one clear message, instead of N ranks each failing in its own log, or blocking in a process
group whose peers never come), and each worker checks again, since docker compose starts workers without the
launcher. Both read the same rules here, so their messages are the same.

The rules: attention heads are split evenly over the ranks (each rank owns whole heads), so the head count
must divide, and so must the KV heads, or the ranks must be a multiple of them (fewer KV heads than ranks: the
model replicates each on N / num_key_value_heads ranks, as vLLM does); on GPUs each rank owns one GPU, so
there must be as many visible. A draft model (speculative decoding) runs in the target's group, so the same
rules apply to it, and its vocabulary must hold the target's token ids (`draft_refusal`).
"""

from __future__ import annotations

from worker_svc.model_config import ModelConfig

FLAG = "--tensor-parallel-size"


def shard_refusal(model_config: ModelConfig, tensor_parallel_size: int, flag: str = FLAG) -> str | None:
    """Why `model_config` cannot be split over `tensor_parallel_size` ranks (its heads, KV heads or MLP width),
    or None if it can (`flag`: how
    the size was given: `serve`'s --tensor-parallel-size, a standalone worker's --world-size)."""
    heads = model_config.num_attention_heads
    if tensor_parallel_size < 1:
        return f"{flag} must be at least 1 (got {tensor_parallel_size})"
    if heads % tensor_parallel_size:
        return (f"{flag} {tensor_parallel_size} does not divide the model's {heads} attention heads "
                f"(num_attention_heads); use a size that divides {heads}")
    kv_heads = model_config.num_key_value_heads
    if (kv_heads % tensor_parallel_size if kv_heads >= tensor_parallel_size else tensor_parallel_size % kv_heads):
        return (f"{flag} {tensor_parallel_size} and the model's {kv_heads} KV heads (num_key_value_heads) do not "
                f"split evenly: the size must divide {kv_heads} or be a multiple of it")
    if model_config.intermediate_size % tensor_parallel_size:
        return (f"{flag} {tensor_parallel_size} does not divide the model's MLP width "
                f"(intermediate_size {model_config.intermediate_size})")
    experts_width = model_config.hf_config.get("moe_intermediate_size")  # Qwen3-MoE's experts (Mixtral's: above)
    if experts_width and experts_width % tensor_parallel_size:
        return (f"{flag} {tensor_parallel_size} does not divide the model's expert width "
                f"(moe_intermediate_size {experts_width})")
    return None


def gpus_refusal(tensor_parallel_size: int, first_gpu: int, visible_gpus: int) -> str | None:
    """Why ranks on GPUs first_gpu .. first_gpu + size - 1 cannot start on a machine with `visible_gpus`
    visible GPUs, or None if they can."""
    needed = first_gpu + tensor_parallel_size
    if needed <= visible_gpus:
        return None
    on = f" from cuda:{first_gpu}" if first_gpu else ""
    return (f"{FLAG} {tensor_parallel_size} needs {tensor_parallel_size} GPUs{on} (one per rank), "
            f"but {visible_gpus} {'is' if visible_gpus == 1 else 'are'} visible")


def first_gpu_index(device: str) -> int:
    """The GPU index of a `--device` of "cuda" (0) or "cuda:N" (N)."""
    _, _, index = device.partition(":")
    return int(index) if index else 0


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device when the engine's `--device` is `device`: the rank-th GPU from the given one on
    CUDA, the CPU for every rank otherwise."""
    if device.startswith("cuda"):
        return f"cuda:{first_gpu_index(device) + rank}"
    return device


def draft_refusal(draft: ModelConfig, target: ModelConfig, world_size: int,
                  max_model_len: int | None) -> str | None:
    """Why this draft cannot serve beside this target, or None. Its vocabulary must hold every target token id
    (the target's tokens are its inputs; a larger, padded one is cut to the target's when proposing), its
    context must reach the served one (`max_model_len`, None: the target's: the draft computes every position
    the target does, and its rotary table ends at its own limit), and its heads must shard over the target's
    ranks (the draft runs in the same tensor-parallel group)."""
    if draft.vocab_size < target.vocab_size:
        return (f"the draft model's vocabulary ({draft.vocab_size} ids) is smaller than the target's "
                f"({target.vocab_size}): a draft model must share the target's tokenizer")
    context = max_model_len or target.max_position_embeddings
    if draft.max_position_embeddings < context:
        return (f"the draft model's context ({draft.max_position_embeddings} tokens) is shorter than the served "
                f"{context}: lower --max-model-len to at most {draft.max_position_embeddings}")
    refusal = shard_refusal(draft, world_size, "--tensor-parallel-size")
    return None if refusal is None else f"the draft model: {refusal}"
