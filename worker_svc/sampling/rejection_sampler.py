"""Exact rejection sampling of sampled drafts (Leviathan et al. 2023; Chen et al. 2023), and the draft's side of it:
drawing a proposal from the draft's distribution q.

The rule, at each draft position j of a row (p: the target's distribution there, given the drafts before j):
draft x ~ q is kept with probability min(1, p(x) / q(x)); the first draft not kept is replaced by a draw from the
residual norm(max(0, p - q)), and the row's step ends there; when every draft is kept, the token after the last
one is drawn from p as usual. Each emitted token is then distributed exactly as p, and a draft is kept with
probability sum_x min(p(x), q(x)), more than the p(x) that sample-and-match keeps it with whenever q is not a
point mass. n-gram drafts, and a draft model's greedy ones, are point masses (q(x) = 1): the rule then keeps x
with probability p(x) and otherwise draws from p with x removed, which is exactly what sample-and-match does
(draw from p, keep the draft if the draw equals it), so those stay sample-and-match
(PersistentBatch.accepted_drafts), which is also token-identical to speculation off for the same seed.

p is the distribution the sampler draws from (sampler.py, kernels/sample_ref.py): the logits after the grammar
masks and the logits processors (penalties, logit_bias, bad words, min_tokens), scaled by 1 / temperature,
restricted to top-k, min_p and top-p with ties kept together, softmaxed. q is the draft's logits under the same
temperature, top-k, top-p and min_p (as vLLM's draft sampler: the draft sees no penalties or masks; any q is
exact, a closer one keeps more).

Randomness, all keyed by the request's (seed, position) like every other draw (kernels/gumbel_ref.py), so a
seeded request gets the same tokens for the same drafts, in any batch, and again after a preemption:
- the draft's proposal at a position draws with the noise the target's own sampler uses there: a draft equal to
  the target proposes exactly the token speculation off samples, and keeps it (p = q);
- the acceptance uniforms and the residual draws use two other streams of the same seed (the seed XOR a
  constant), independent of the proposal's noise and of each other, as the rule requires. A position whose
  draft is rejected, or that lies after one, influences no emitted token, so the next step may draw there again.

Everything is whole-batch tensor work on the logits' device (no loop over rows or the vocabulary). The top-k and
top-p restrictions sort the vocabulary of the rows that have them; only rows with drafts of a sampled draft
pay it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels.gumbel_ref import gumbel_noise
from kernels.sample_ref import kth_largest, mass_above
from worker_svc.sampling.logits_processors import apply_adjustments
from worker_svc.sampling.sampler import GREEDY_TEMPERATURE, SamplerOutput, SamplingTensors

# Streams of a request's seeded noise: its seed XOR one of these (each below 2**63: an int64), so that the
# acceptance test and the residual draw at a position are independent of the proposal drawn there with the seed.
ACCEPTANCE_STREAM = 0x2545F4914F6CDD1D
RESIDUAL_STREAM = 0x5851F42D4C957F2D


@dataclass(frozen=True)
class SampledDrafts:
    """The draft entries of one step's draw that a draft model sampled from a distribution q it kept, on the
    logits' device. Why a record: the runner's draw takes it whole, next to the step's SamplingTensors.

    - entries int64 [E]: each one's row in the draw's logits (a sampling entry at a draft's position);
    - token_ids int64 [E]: the draft at that entry;
    - probs float32 [E, V]: q at that entry (the draft's distribution the draft was drawn from).
    """

    entries: torch.Tensor
    token_ids: torch.Tensor
    probs: torch.Tensor


def kept_scaled_logits(processed: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """float32 [N, V]: processed / temperature on each row's kept set (top-k, min_p, top-p as the sampler keeps
    them, kernels/sample_ref.py), -inf elsewhere; its softmax is the row's sampling distribution. Greedy rows of
    `tensors` are scaled by 1 (their result is not a distribution they draw from). The host flags of `tensors`
    skip the sorts of top-k and top-p when no row has them."""
    temperature = torch.where(tensors.temperature >= GREEDY_TEMPERATURE, tensors.temperature,
                              torch.ones_like(tensors.temperature))
    scaled = processed * (1.0 / temperature).unsqueeze(-1)
    max_scaled = scaled.max(dim=-1, keepdim=True).values
    kept = scaled > float("-inf")
    if tensors.max_top_k > 0:
        kept &= processed >= kth_largest(processed, tensors.top_k).threshold.unsqueeze(-1)
    min_p = tensors.min_p
    min_p_threshold = torch.where(min_p > 0, torch.log(min_p), torch.full_like(min_p, float("-inf")))
    kept &= scaled >= max_scaled + min_p_threshold.unsqueeze(-1)
    if tensors.restricts:
        top_p = tensors.top_p
        weight = torch.where(kept, torch.exp(scaled - max_scaled), 0.0).to(torch.float64)
        above = mass_above(scaled, weight)
        kept &= (top_p >= 1).unsqueeze(-1) | (above < top_p.to(torch.float64).unsqueeze(-1) * weight.sum(-1, True))
    return torch.where(kept, scaled, float("-inf"))


def draw_proposals(logits: torch.Tensor, tensors: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft model's proposal per row (`logits`: the draft's, over the target's vocabulary; `tensors`: the
    rows' sampling parameters, `position` the proposed token's): greedy rows take the argmax; the others draw
    from their distribution q with the request's seeded noise there. Returns the tokens int64 [N] and q float32
    [N, V] (zero for greedy rows: their drafts are point masses, verified by sample-and-match; None when every
    row is greedy)."""
    tokens = logits.argmax(dim=-1)
    if tensors.all_greedy:
        return tokens, None
    sampled = tensors.temperature >= GREEDY_TEMPERATURE
    kept = kept_scaled_logits(logits, tensors)
    drawn = (kept + gumbel_noise(tensors.seed, tensors.position, logits.shape[-1])).argmax(dim=-1)
    probs = torch.where(sampled.unsqueeze(-1), torch.softmax(kept, dim=-1), 0.0)
    return torch.where(sampled, drawn, tokens), probs


def verify_sampled_drafts(logits: torch.Tensor, tensors: SamplingTensors, out: SamplerOutput,
                          drafts: SampledDrafts) -> SamplerOutput:
    """The draw `out` (the sampler's, of every entry of `logits`: the step's logits after the grammar masks) with
    each sampled draft's entry replaced by the rule's token there: the draft itself when kept, else a draw from
    the residual (never the draft: a rejected x has p(x) < q(x), so the residual is 0 there). The caller's
    sample-and-match (PersistentBatch.accepted_drafts) then ends each row at its first entry whose token differs
    from its draft, which is its first rejection. Logprobs are recomputed for the replaced tokens (of the raw
    logits, as the sampler's); ranks and top logprobs are left as drawn (rows with drafts ask for none). The
    entries must be rows that sample (a draft model keeps q for those only)."""
    entries, draft_ids = drafts.entries, drafts.token_ids
    processed = apply_adjustments(logits, tensors.adjustments)[entries]
    at_entries = _select(tensors, entries)
    target = torch.softmax(kept_scaled_logits(processed, at_entries), dim=-1)
    draft = drafts.probs[:, : target.shape[-1]]
    seed, position = at_entries.seed, at_entries.position
    target_at = target.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    draft_at = draft.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    # Kept with probability min(1, p(x) / q(x)); never where p(x) = 0 (q(x) may have underflowed to 0 too).
    uniform = keyed_uniform(seed ^ ACCEPTANCE_STREAM, position)
    kept = (target_at > 0) & ((draft_at <= target_at) | (uniform * draft_at < target_at))
    residual = (target - draft).clamp_(min=0.0)
    # Rounding can leave no residual mass although p(x) < q(x) (p and q equal but for the last bits): then p
    # without x, the residual's limit.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target.scatter(-1, draft_ids.unsqueeze(-1), 0.0), residual)
    noise = gumbel_noise(seed ^ RESIDUAL_STREAM, position, residual.shape[-1])
    resampled = (torch.log(residual) + noise).argmax(dim=-1)
    token_ids = out.token_ids.clone()
    token_ids[entries] = torch.where(kept, draft_ids, resampled)
    logprobs = out.logprobs.clone()
    rows = logits[entries]
    logprobs[entries] = rows.gather(-1, token_ids[entries].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(rows, -1)
    return dataclasses.replace(out, token_ids=token_ids, logprobs=logprobs)


def _select(tensors: SamplingTensors, entries: torch.Tensor) -> SamplingTensors:
    """The sampling parameters of some entries (the host flags kept: they may only overstate the work)."""
    return dataclasses.replace(
        tensors, temperature=tensors.temperature[entries], top_p=tensors.top_p[entries],
        min_p=tensors.min_p[entries], top_k=tensors.top_k[entries], seed=tensors.seed[entries],
        position=tensors.position[entries], adjustments=None)


def keyed_uniform(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """float32 [N] in (0, 1] (1 by rounding only), a pure function of (seed, position): the CDF of the keyed
    Gumbel noise's first column (exp(-exp(-g)) of a standard Gumbel g is uniform)."""
    return torch.exp(-torch.exp(-gumbel_noise(seed, position, 1)[:, 0]))

