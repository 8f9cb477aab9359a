"""Tiny random PEFT LoRA adapters of the tiny models (tiny_models.py), and PEFT's own greedy output with them.

Why random B: PEFT initialises B to zeros, so a fresh adapter changes nothing and a server ignoring it would
pass. Here every A and B is drawn from a seeded generator, large enough that greedy output differs from the
base model's and between adapters. The adapter directory is what `save_pretrained` writes, so the server reads
exactly the files a user would bring.
"""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_adapter(model_dir: Path, out_dir: Path, rank: int, target_modules: list[str], seed: int,
                      alpha: float = 16.0, use_rslora: bool = False, **config) -> Path:
    """A PEFT LoRA adapter of the model at `model_dir`, saved under `out_dir` (returned)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules,
                                                 use_rslora=use_rslora, lora_dropout=0.0, **config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(out_dir)
    return Path(out_dir)


def peft_greedy(model_dir: Path, adapter_dir: Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    """PEFT's `PeftModel` greedy continuation of `prompt` (the base model's with `adapter_dir` None)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def generate_with_adapters(server, requests: list[tuple[str | None, list[int]]], max_tokens: int) -> list[list[int]]:
    """Each (adapter name or None, prompt)'s greedy token ids from `server` (a running_server), all requests at
    once so the adapters and the base model share steps."""
    from concurrent.futures import ThreadPoolExecutor

    def one(request):
        name, prompt = request
        with server.client() as client:
            return list(client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                        lora_name=name).outputs[0].token_ids)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def write_random_adapter(config: dict, out_dir: Path, rank: int, seed: int, a_scale: float = 1.0,
                         b_scale: float = 0.3, dtype: torch.dtype = torch.float32) -> Path:
    """A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors, PEFT's tensor names) of rank
    `rank` on all seven projections of every layer of a Llama-family model of HF `config` (a config.json's dict,
    or benchmarks/model_shapes.py's), written without PEFT or the model's weights: what the GPU tests and the LoRA
    benchmark need (PEFT is not on every GPU image, and a benchmark model's weights are random anyway). A is
    randn * a_scale / sqrt(in_features), B randn * b_scale, both in `dtype`."""
    import json

    from safetensors.torch import save_file

    from service_runtime.lora_modules import ADAPTER_CONFIG, ADAPTER_WEIGHTS, SERVED_TARGETS

    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size, kv_size = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    sizes = {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
             "o_proj": (q_size, hidden), "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
             "down_proj": (intermediate, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in SERVED_TARGETS:
            module = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{module}.{target}"
            in_features, out_features = sizes[target]
            lora_a = torch.randn(rank, in_features, generator=generator) * a_scale / in_features ** 0.5
            tensors[f"{prefix}.lora_A.weight"] = lora_a.to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_features, rank, generator=generator)
                                                  * b_scale).to(dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / ADAPTER_WEIGHTS)
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2.0 * rank, "target_modules": list(SERVED_TARGETS),
                      "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(adapter_config))
    return out_dir
