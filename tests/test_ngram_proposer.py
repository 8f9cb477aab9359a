"""The n-gram proposer (speculative decoding): the longest suffix n-gram wins, its most recent earlier
occurrence is continued, at most k tokens, nothing without a match. Pure Python."""

from __future__ import annotations

import random
import time

from scheduler_svc.core.ngram_proposer import propose_ngram_drafts


def test_the_tokens_after_an_earlier_occurrence_of_the_suffix_are_proposed():
    assert propose_ngram_drafts([1, 2, 3, 4, 5, 9, 2, 3], 1, 3, 3) == [4, 5, 9]


def test_the_longest_n_wins_over_a_more_recent_shorter_match():
    # The 2-gram [2, 3] occurred at 0 (followed by 7); the 1-gram [3] occurred more recently (followed by 8).
    tokens = [2, 3, 7, 3, 8, 2, 3]
    assert propose_ngram_drafts(tokens, 1, 2, 1) == [7]
    assert propose_ngram_drafts(tokens, 1, 1, 1) == [8]


def test_the_most_recent_earlier_occurrence_is_continued():
    assert propose_ngram_drafts([5, 6, 1, 5, 6, 2, 5, 6], 2, 2, 1) == [2]


def test_no_match_no_drafts_and_min_n_bounds_the_search():
    assert propose_ngram_drafts([1, 2, 3, 4], 1, 3, 3) == []
    assert propose_ngram_drafts([1, 2, 9, 2], 2, 3, 3) == []  # only a 1-gram matches
    assert propose_ngram_drafts([7], 1, 3, 3) == []
    assert propose_ngram_drafts([1, 2, 1, 2], 1, 2, 0) == []


def test_k_caps_the_drafts_and_past_the_known_tokens_the_period_goes_on():
    assert propose_ngram_drafts([1, 2, 3, 4, 5, 6, 1, 2], 1, 2, 2) == [3, 4]
    # [1, 2] recurs 3 tokens later: after the known [3, 1, 2] the drafts go on with period 3 (vLLM stops there).
    assert propose_ngram_drafts([1, 2, 3, 1, 2], 2, 2, 7) == [3, 1, 2, 3, 1, 2, 3]


def test_an_overlapping_occurrence_counts_a_repeated_token_continues_itself():
    # [4, 4, 4] at 0, followed by the last 4; the period is 1: a run of one token proposes k of it.
    assert propose_ngram_drafts([4, 4, 4, 4], 1, 3, 3) == [4, 4, 4]


def test_a_few_thousand_tokens_cost_little():
    rng = random.Random(0)
    tokens = [rng.randrange(50) for _ in range(4000)]  # frequent last tokens, rare long matches
    start = time.perf_counter()
    for _ in range(20):
        propose_ngram_drafts(tokens, 1, 5, 4)
    assert time.perf_counter() - start < 1.0
