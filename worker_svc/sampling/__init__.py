"""Sampling: turning a step's logits into tokens. sampler.py (the sampler and its kernels' calls),
sampling_inputs.py (per-row parameters as tensors from the persistent batch), logits_processors.py
(penalties, logit bias, min_tokens and bad-words masks), prompt_logprobs.py, rejection_sampler.py (a draft
model's sampled drafts: its proposals' draws, and their verification by exact rejection sampling).

May import: torch, numpy, kernels/, protos/ and the worker's batch modules (persistent_batch.py,
host_to_device.py, row_entries.py); never models/ or the serving loop.
"""
