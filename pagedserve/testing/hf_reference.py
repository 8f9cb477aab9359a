"""Reference answers from Hugging Face transformers (CPU), the correctness oracle: float32 greedy tokens
and logits, and bf16 prefill logits.

bf16 (`bf16_prefill_errors`) runs transformers' model code with one substitution: attention is
`rounded_probs_attention`, flash attention's rounding, which is what transformers' sdpa runs on a GPU.
Why not sdpa or eager: on the CPU, eager rounds the scores and the normalized probabilities to bf16, and
sdpa runs torch's CPU flash kernel, which rounds like flash attention but, for reasons internal to it,
still differs from this function in 1-5% of its outputs by an ulp. A bf16 model amplifies any one-ulp
difference to bf16's whole error (one flipped element of one attention output in layer 0 of a 28-layer
Qwen2.5-1.5B-shaped model moved its logits by 2.4%, as far as bf16 is from fp32), so only an attention
with a defined rounding lets a comparison tell a wrong rounding point from noise.
"""

from __future__ import annotations

import functools

import torch

ROUNDED_PROBS_ATTENTION = "rounded_probs"  # not "flash...": transformers would look for a flash kernel


@functools.lru_cache(maxsize=4)
def _load(model_dir: str, gguf_file: str | None = None, dtype: torch.dtype = torch.float32,
          attn_implementation: str | None = None):
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(ROUNDED_PROBS_ATTENTION, rounded_probs_attention)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attn_implementation, **kwargs
    )
    return model.eval()


def rounded_probs_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """A transformers attention function (query [B, Hq, S, D], key/value [B, Hkv, L, D]; causal, no
    padding; a `sliding_window` W keeps each query's last W keys) with flash attention's rounding: scores and softmax in fp32, the unnormalized
    probabilities rounded to the activation dtype for P @ V, the fp32 row sum dividing the result."""
    groups = query.shape[1] // key.shape[1]
    key = key.float().repeat_interleave(groups, dim=1)
    value = value.float().repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.float(), key.transpose(2, 3)) * scaling
    query_len, key_len = scores.shape[-2:]
    visible = torch.ones(query_len, key_len, dtype=torch.bool, device=scores.device).tril(key_len - query_len)
    window = kwargs.get("sliding_window")  # Mistral's and Qwen2's sliding layers pass theirs
    if window is not None:
        visible &= ~torch.ones_like(visible).tril(key_len - query_len - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.exp(scores - scores.amax(-1, keepdim=True))
    output = torch.matmul(probs.to(query.dtype).float(), value) / probs.sum(-1, keepdim=True)
    return output.to(query.dtype).transpose(1, 2).contiguous(), None


def bf16_prefill_errors(model_dir: str, prompt_ids: list[int], ours: torch.Tensor) -> tuple[float, float]:
    """(ours vs transformers bf16, transformers bf16 vs fp32): relative errors ||a - b|| / ||b|| of the
    prefill logits [len(prompt_ids), vocab], `ours` being our bf16 model's."""
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        bf16 = _load(str(model_dir), None, torch.bfloat16, ROUNDED_PROBS_ATTENTION)(input_ids).logits[0].float()
        fp32 = _load(str(model_dir))(input_ids).logits[0]
    return float((ours.float() - bf16).norm() / bf16.norm()), float((bf16 - fp32).norm() / fp32.norm())


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
