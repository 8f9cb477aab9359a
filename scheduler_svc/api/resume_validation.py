"""GenerateRequest.resume: a stream that a client resumes after losing its scheduler, checked at the edge.

Why the scheduler accepts resumed requests at all: the scheduler is the one process whose death would lose
work (a worker's death is recovered inside it). The fronts that hold the streams (the SDK, and through it
the HTTP gateway) survive a scheduler restart, and each knows exactly what its client received: the token
ids, the characters of text, the logprobs and (from the first message) the request's seed. Re-submitting
the request with that output lets the new scheduler recompute the KV of prompt + output, as after a
preemption by recompute, and go on token-exact for greedy and seeded sampling.

The output travels as output, not appended to the prompt: presence/frequency penalties, min_tokens,
max_tokens, stop strings from min_tokens on and the per-position seeded draws all count output positions,
so they continue unchanged; the seed comes back in sampling.seed. Only one sequence can resume: with n > 1,
best_of or beam search the client does not hold every sequence's state, so such a resume is refused.
"""

from __future__ import annotations

from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.validated_request import InvalidRequestError, ResumedOutput

FIELD = "resume"


def resumed_output(request: generate_pb2.GenerateRequest, sampling: SamplingParams,
                   vocab_size: int) -> ResumedOutput | None:
    """The request's resumed output, or None for a new request; raises InvalidRequestError naming the field
    when the resume cannot go on exactly."""
    if not request.HasField("resume"):
        return None
    resume = request.resume
    if sampling.num_sequences > 1 or sampling.use_beam_search:
        raise InvalidRequestError(FIELD, "only a single sequence resumes (not n > 1, best_of or beam search)")
    if sampling.seed is None and not sampling.is_greedy:
        raise InvalidRequestError("sampling.seed", "a resumed sampled stream needs the seed of its first message "
                                  "(GenerateResponse.seed)")
    token_ids = tuple(resume.token_ids)
    if len(token_ids) >= sampling.max_tokens:
        raise InvalidRequestError(f"{FIELD}.token_ids", f"{len(token_ids)} tokens leave none of max_tokens "
                                  f"({sampling.max_tokens}) to generate")
    if any(not 0 <= token_id < vocab_size for token_id in token_ids):
        raise InvalidRequestError(f"{FIELD}.token_ids", f"token ids must be in [0, {vocab_size})")
    return ResumedOutput(token_ids, resume.num_sent_chars, resume.cumulative_logprob)
