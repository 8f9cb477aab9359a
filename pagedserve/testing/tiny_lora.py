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
