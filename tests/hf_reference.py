"""Reference answers from Hugging Face transformers (float32, CPU, greedy), the correctness oracle."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def _load(model_dir: str, gguf_file: str | None = None):
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    return model.eval()


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int, gguf_file: str | None = None,
              stop_at_eos: bool = False, **generate_kwargs) -> list[int]:
    """Token ids transformers' `generate(do_sample=False)` appends to the prompt; `generate_kwargs` add
    logits processors (e.g. repetition_penalty=1.3)."""
    model = _load(str(model_dir), gguf_file)
    input_ids = torch.tensor([prompt_ids])
    eos = model.generation_config.eos_token_id if stop_at_eos else None
    with torch.no_grad():
        output = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=max_new_tokens,
            min_new_tokens=0 if stop_at_eos else max_new_tokens, eos_token_id=eos, pad_token_id=0,
            temperature=None, top_p=None, top_k=None, **generate_kwargs,
        )
    return output[0, len(prompt_ids):].tolist()


def hf_log_softmax(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """float32 [len(token_ids), vocab]: row p is log_softmax of the logits after token_ids[: p + 1]."""
    model = _load(str(model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
