"""Prompt logprobs: the logprob (and rank, and top alternatives) of each prompt token given the ones before it.

Who owns what: the worker calls `prompt_logprobs` after a forward pass, with the step's hidden states; the
rows that asked (num_prompt_logprobs >= 0) are found in the persistent batch. Each step scores the prompt
tokens its chunk reaches: the hidden state at position p gives the logits of token p + 1, so a chunk over
positions [c, c + n) scores prompt tokens c + 1 .. min(c + n, num_prompt_tokens - 1). Chunked prefill thus
sends a request's prompt logprobs over several steps, each tagged with its first position, and a recompute
after preemption sends them again (the scheduler keeps the first). The scheduler never gives such a request a
prefix-cache hit, so every prompt position is computed once. This costs an extra logits projection and one
extra device-to-host copy, only in steps where some row asked.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.sample_ref import logprob_details
from protos.pagedserve.v1 import worker_pb2
from worker_svc.persistent_batch import PersistentBatch, StepInputs


def prompt_logprobs(compute_logits, hidden: torch.Tensor, batch: PersistentBatch,
                    inputs: StepInputs) -> list[worker_pb2.PromptLogprobs]:
    """`compute_logits`: the model's hidden -> logits projection."""
    wanted = np.flatnonzero(batch.num_prompt_logprobs[inputs.rows] >= 0)
    spans = []  # (row, first scored position, token indices in the step)
    for index in wanted.tolist():
        row = inputs.rows[index]
        start, end = inputs.query_start_loc[index], inputs.query_start_loc[index + 1]
        first_position = inputs.positions[start] + 1
        last_position = min(inputs.positions[end - 1] + 1, batch.num_prompt_tokens[row] - 1)
        if last_position >= first_position:
            spans.append((row, int(first_position), np.arange(start, start + last_position - first_position + 1)))
    if not spans:
        return []
    token_index = np.concatenate([indices for _, _, indices in spans])
    targets = np.concatenate([batch.token_ids[row, first : first + len(indices)] for row, first, indices in spans])
    device = hidden.device
    logits = compute_logits(hidden[torch.from_numpy(token_index).to(device)]).float()
    target_ids = torch.from_numpy(targets).to(device)
    chosen = logits.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    log_normalizer = torch.logsumexp(logits, dim=-1)
    k = int(batch.num_prompt_logprobs[[row for row, _, _ in spans]].max())
    ranks, top_ids, top_logprobs = logprob_details(logits, target_ids, log_normalizer, k)
    packed = torch.cat([(chosen - log_normalizer).unsqueeze(-1).double(), ranks.unsqueeze(-1).double(),
                        top_ids.double(), top_logprobs.double()], dim=-1).cpu().numpy()
    results, offset = [], 0
    for row, first, indices in spans:
        row_k = int(batch.num_prompt_logprobs[row])
        tokens = []
        for line, target in zip(packed[offset : offset + len(indices)], targets[offset : offset + len(indices)]):
            top = [worker_pb2.TokenCandidate(token_id=int(t), logprob=v)
                   for t, v in zip(line[2 : 2 + row_k], line[2 + k : 2 + k + row_k])]
            tokens.append(worker_pb2.PromptTokenLogprob(token_id=int(target), logprob=line[0], rank=int(line[1]),
                                                        top=top))
        offset += len(indices)
        results.append(worker_pb2.PromptLogprobs(request_id=batch.request_id_of(row), first_position=first,
                                                 tokens=tokens))
    return results
