"""Exact rejection sampling of sampled drafts (worker_svc/sampling/rejection_sampler.py), on the sampler alone with
crafted target and draft logits over a small vocabulary: with a deliberately bad draft distribution q, the emitted
token at the first draft position, and at the second given the first draft kept, are distributed as the target's
processed distribution p (chi-square over many seeded draws: the seeds are fixed, so the statistic is a fixed
number and the test cannot flake; the drafts themselves fail the same test, so it has the power to see a wrong
rule); a draft is kept at the rate sum min(p, q); seeded draws repeat. The keying of a draft model's q to the
drafts a step verifies (worker_svc/draft_probabilities.py) on a hand-built batch."""

from __future__ import annotations

import math

import numpy as np
import torch

from protos.pagedserve.v1 import worker_pb2
from worker_svc.draft_probabilities import DraftProbabilities
from worker_svc.persistent_batch import PersistentBatch
from worker_svc.sampling.logits_processors import LogitsAdjustments, SparseLogits
from worker_svc.sampling.rejection_sampler import SampledDrafts, draw_proposals, verify_sampled_drafts
from worker_svc.sampling.sampler import SamplingTensors, sample

VOCAB = 16
NUM_DRAWS = 20000
POSITION = 40
# The target prefers low ids, the draft high ones: q is far from p (sum min(p, q) about 0.3).
TARGET_LOGITS = np.linspace(2.0, -1.5, VOCAB).astype(np.float32)
DRAFT_LOGITS = TARGET_LOGITS[::-1].copy()
BANNED = 1  # the target's logit_bias masks it: p(BANNED) = 0, and the draft likes it


def chi_square_bound(df: int) -> float:
    """The chi-square distribution's 0.999 quantile with `df` degrees of freedom (Wilson-Hilferty: within 1%
    for the df here, 8 to 15)."""
    z = 3.0902  # the standard normal's 0.999 quantile
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of observed `counts` against `probs` (cells of p = 0 must be empty) and its df."""
    assert counts[probs == 0].sum() == 0, "a token of target probability 0 was emitted"
    expected = probs * counts.sum()
    support = probs > 0
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum()), int(support.sum()) - 1


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The sampler's distribution, written out plainly for logits without ties: scale, keep the top k, those
    within min_p of the best, then the tokens whose better tokens weigh less than top_p; normalize."""
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled)
    kept = np.zeros(len(logits), dtype=bool)
    kept[order[: top_k if top_k > 0 else len(logits)]] = True
    weights = np.exp(scaled - scaled.max())
    kept &= weights >= min_p
    probs = np.where(kept, weights, 0.0)
    mass_before = np.cumsum(probs[order]) - probs[order]
    kept[order[mass_before >= top_p * probs.sum()]] = False
    probs = np.where(kept, weights, 0.0)
    return probs / probs.sum()


def tensors_for(num_rows: int, seeds: np.ndarray, positions: np.ndarray, adjustments=None, temperature=0.8,
                top_k=12, top_p=0.95, min_p=0.02) -> SamplingTensors:
    return SamplingTensors.from_host(temperature=np.full(num_rows, temperature), top_p=np.full(num_rows, top_p),
                                     top_k=np.full(num_rows, top_k), min_p=np.full(num_rows, min_p), seed=seeds,
                                     position=positions, adjustments=adjustments, device="cpu")


def banned_adjustments(num_rows: int) -> LogitsAdjustments:
    return LogitsAdjustments(SparseLogits.from_host(rows=np.arange(num_rows), token_ids=np.full(num_rows, BANNED),
                                                    values=np.full(num_rows, -np.inf, dtype=np.float32),
                                                    device=torch.device("cpu")))


def first_position(seeds: np.ndarray, target_logits=TARGET_LOGITS, draft_logits=DRAFT_LOGITS, **params):
    """One draft per row (seed), drawn from q at POSITION, then verified: (drafts, emitted tokens, q of a row)."""
    num = len(seeds)
    positions = np.full(num, POSITION)
    draft_params = {**params, "adjustments": None}
    drafts, q = draw_proposals(torch.from_numpy(np.tile(draft_logits, (num, 1))),
                               tensors_for(num, seeds, positions, **draft_params))
    logits = torch.from_numpy(np.tile(target_logits, (num, 1)))
    tensors = tensors_for(num, seeds, positions, **params)
    out = verify_sampled_drafts(logits, tensors, sample(logits, tensors),
                                SampledDrafts(torch.arange(num), drafts, q))
    return drafts.numpy(), out.token_ids.numpy(), q[0].numpy()


SEEDS = np.arange(NUM_DRAWS, dtype=np.int64) * 7919 + 3


def test_the_first_emitted_token_follows_the_targets_processed_distribution_not_the_bad_drafts():
    """Temperature, top-k, top-p, min_p and a logit_bias mask on the target; the draft, under the same
    temperature, top-k, top-p and min_p, prefers the tokens the target cuts."""
    params = dict(temperature=0.8, top_k=12, top_p=0.95, min_p=0.02)
    drafts, emitted, q = first_position(SEEDS, adjustments=banned_adjustments(NUM_DRAWS), **params)
    biased = TARGET_LOGITS.copy()
    biased[BANNED] = -np.inf
    p = reference_probs(biased, **params)
    statistic, df = chi_square(np.bincount(emitted, minlength=VOCAB), p)
    assert statistic < chi_square_bound(df), (statistic, df)
    np.testing.assert_allclose(q, reference_probs(DRAFT_LOGITS, **params), atol=1e-6)
    # Drafts are kept by the rule (sum min(p, q) of them), not only where a plain draw from p equals them.
    kept_rate = np.minimum(p, q).sum()
    assert abs((emitted == drafts).mean() - kept_rate) < 0.02 and kept_rate > 1.5 * (p * q).sum()
    # The drafts are q's, far from p: the same test rejects them (it would see a rule that kept too many).
    assert (np.bincount(drafts, minlength=VOCAB)[p == 0]).sum() > 0
    kept_too_often = np.where(p > 0, np.bincount(drafts, minlength=VOCAB), 0)
    assert chi_square(kept_too_often, p)[0] > 10 * chi_square_bound(df)


def test_a_draft_is_kept_at_the_rate_sum_of_min_p_q():
    params = dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0)
    drafts, emitted, q = first_position(SEEDS, **params)
    p = reference_probs(TARGET_LOGITS, **params)
    expected = np.minimum(p, q).sum()
    rate = (emitted == drafts).mean()
    assert abs(rate - expected) < 4 * math.sqrt(expected * (1 - expected) / NUM_DRAWS), (rate, expected)
    # Sample-and-match would keep sum p * q of them: fewer.
    assert (p * q).sum() < expected - 0.1
    # q = p keeps every draft; a q whose support p masks keeps none.
    drafts, emitted, _ = first_position(SEEDS[:2000], draft_logits=TARGET_LOGITS, **params)
    assert (emitted == drafts).all()
    only_banned = np.full(VOCAB, -np.inf, dtype=np.float32)
    only_banned[BANNED] = 0.0
    drafts, emitted, _ = first_position(SEEDS[:2000], draft_logits=only_banned,
                                        adjustments=banned_adjustments(2000), **params)
    assert (drafts == BANNED).all() and (emitted != BANNED).all()


def conditional_logits(base: np.ndarray, previous: np.ndarray) -> np.ndarray:
    """Logits at the second position, depending on the token before it (its parity moves mass)."""
    shift = np.where((previous % 2 == 0)[:, None], np.linspace(0.0, 2.0, VOCAB), np.linspace(2.0, 0.0, VOCAB))
    return (base[None, :] + shift).astype(np.float32)


def test_the_second_emitted_token_follows_the_targets_distribution_given_the_first_draft_kept():
    """Two drafts per row, the second drawn from q given the first; each row's logits are two entries (positions
    POSITION and POSITION + 1). Where the first draft is kept, the token at the second entry is distributed as p
    given that first token: a chi-square per parity of the first token."""
    num = NUM_DRAWS
    params = dict(temperature=1.0, top_k=-1, top_p=0.9, min_p=0.0)
    first_q = np.tile(DRAFT_LOGITS, (num, 1))
    first_drafts, q1 = draw_proposals(torch.from_numpy(first_q),
                                      tensors_for(num, SEEDS, np.full(num, POSITION), **params))
    x1 = first_drafts.numpy()
    second_draft_logits = conditional_logits(DRAFT_LOGITS, x1)
    second_drafts, q2 = draw_proposals(torch.from_numpy(second_draft_logits),
                                       tensors_for(num, SEEDS, np.full(num, POSITION + 1), **params))
    # Entries row after row: 2i at POSITION (given the context), 2i + 1 at POSITION + 1 (given x1).
    target = np.empty((2 * num, VOCAB), dtype=np.float32)
    target[0::2], target[1::2] = TARGET_LOGITS, conditional_logits(TARGET_LOGITS, x1)
    seeds, positions = np.repeat(SEEDS, 2), np.tile([POSITION, POSITION + 1], num)
    logits, tensors = torch.from_numpy(target), tensors_for(2 * num, seeds, positions, **params)
    drafts = torch.stack([first_drafts, second_drafts], dim=1).flatten()
    out = verify_sampled_drafts(logits, tensors, sample(logits, tensors),
                                SampledDrafts(torch.arange(2 * num), drafts, torch.stack([q1, q2], 1).flatten(0, 1)))
    emitted = out.token_ids.numpy().reshape(num, 2)
    first_kept = emitted[:, 0] == x1
    for parity in (0, 1):
        rows = first_kept & (x1 % 2 == parity)
        p = reference_probs(conditional_logits(TARGET_LOGITS, np.array([parity]))[0], **params)
        statistic, df = chi_square(np.bincount(emitted[rows, 1], minlength=VOCAB), p)
        assert rows.sum() > 1000 and statistic < chi_square_bound(df), (parity, statistic, df)
        q = reference_probs(conditional_logits(DRAFT_LOGITS, np.array([parity]))[0], **params)
        kept_rate = (emitted[rows, 1] == second_drafts.numpy()[rows]).mean()
        assert abs(kept_rate - np.minimum(p, q).sum()) < 0.03, (kept_rate, np.minimum(p, q).sum(), (p * q).sum())
        # The second drafts themselves, where the first was kept, fail it.
        assert chi_square(np.where(p > 0, np.bincount(second_drafts.numpy()[rows], minlength=VOCAB), 0), p)[0] \
            > 10 * chi_square_bound(df)


def test_seeded_draws_repeat_and_other_seeds_or_positions_differ():
    seeds = SEEDS[:500]
    drafts, emitted, _ = first_position(seeds)
    again_drafts, again, _ = first_position(seeds)
    np.testing.assert_array_equal(drafts, again_drafts)
    np.testing.assert_array_equal(emitted, again)
    assert (first_position(seeds + 1)[1] != emitted).mean() > 0.3


def _batch_with_drafts(drafts: list[int]) -> PersistentBatch:
    batch = PersistentBatch(max_num_seqs=4, max_model_len=32, block_size=4)
    sampling = worker_pb2.WorkerSamplingParams(temperature=1.0, top_p=1.0, top_k=-1, seed=5, num_logprobs=-1,
                                               num_prompt_logprobs=-1)
    for request_id in ("a", "b"):
        batch.add(worker_pb2.NewRequest(request_id=request_id, token_ids=[3, 4, 5], block_ids=[0, 1],
                                        num_computed_tokens=2, num_scheduled_tokens=1 + len(drafts),
                                        num_prompt_tokens=3, sampling=sampling))
    for request_id in ("a", "b"):
        batch.update(worker_pb2.ScheduledRequest(request_id=request_id, num_scheduled_tokens=1 + len(drafts),
                                                 draft_token_ids=drafts))
    return batch


def test_a_rows_q_is_used_only_for_the_drafts_proposed_after_its_current_tokens():
    """Row a's proposals are [7, 8, 9] after its 3 tokens; b's are elsewhere. a verifies a prefix of them:
    its two draft entries get their q (not its bonus entry); drafts that differ, another token count, or a row
    given to another request get none (sample-and-match verifies those)."""
    batch = _batch_with_drafts([7, 8])
    a, b = batch.row_of("a"), batch.row_of("b")
    probs = torch.arange(2 * 3 * VOCAB, dtype=torch.float32).view(2, 3, VOCAB)
    proposed = DraftProbabilities(rows=np.array([a, b]), generations=batch.generation[[a, b]].copy(),
                                  starts=np.array([3, 2]), counts=np.array([3, 3]),
                                  token_ids=np.array([[7, 8, 9], [7, 8, 9]]), probs=probs)
    rows, offsets = np.array([a, a, a, b, b, b]), np.array([0, 1, 2, 0, 1, 2])
    found = proposed.for_entries(batch, rows, offsets)
    assert found.entries.tolist() == [0, 1] and found.token_ids.tolist() == [7, 8]
    torch.testing.assert_close(found.probs, probs[0, :2])
    wrong = _batch_with_drafts([7, 6])
    assert proposed.for_entries(wrong, rows, offsets) is None
    batch.remove("a")
    batch.add(worker_pb2.NewRequest(request_id="c", token_ids=[3, 4, 5], block_ids=[0, 1], num_computed_tokens=2,
                                    num_scheduled_tokens=1, num_prompt_tokens=3,
                                    sampling=worker_pb2.WorkerSamplingParams(temperature=1.0, top_p=1.0, top_k=-1,
                                                                             num_logprobs=-1)))
    batch.update(worker_pb2.ScheduledRequest(request_id="c", num_scheduled_tokens=3, draft_token_ids=[7, 8]))
    assert batch.row_of("c") == a
    assert proposed.for_entries(batch, rows, offsets) is None
