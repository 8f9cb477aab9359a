"""N-gram (prompt lookup) draft proposals: guess a request's next tokens from its own earlier tokens.

Who owns it: the `StepPlanner` (one, stateless: every call reads only the tokens it is given). Outputs that
repeat their context (code edits, quoting, extraction, lists) continue an n-gram that occurred before the
way it continued then; proposing that continuation costs no model and the worker verifies it losslessly.

The rule (vLLM's): find the longest suffix of the tokens, n from `max_n` down to `min_n`, that also occurred
earlier; propose the up to `k` tokens that followed its most recent earlier occurrence. No occurrence: no
drafts. One difference: when that continuation runs into the end of the known tokens (the occurrence is less
than k tokens back, as in a repeated token or a short repeated phrase), vLLM proposes fewer tokens; we go on
with the same period (the suffix recurs every P tokens, so token i of the proposal is the one P before it),
which is what a repeating output does next: k drafts instead of one in a run of one repeated token. Cost per call: for each n, one backwards scan for the suffix's last token, comparing the n-gram only
where that token matches (`list.index` on a reversed view is C speed), so a few thousand tokens take well
under a millisecond unless the text is one token repeated, where the first candidate already matches.
"""

from __future__ import annotations


def propose_ngram_drafts(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix n-gram of
    `token_ids` (min_n <= n <= max_n); [] when none occurred earlier or k < 1."""
    num_tokens = len(token_ids)
    if k < 1:
        return []
    reversed_ids = token_ids[num_tokens - 2 :: -1] if num_tokens >= 2 else []  # ends before the last token
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        start = _last_earlier_occurrence(token_ids, reversed_ids, n)
        if start is not None:
            follow = start + n
            drafts = token_ids[follow : follow + k]
            period = num_tokens - follow  # the suffix recurs every `period` tokens
            while len(drafts) < k:  # the slice held every known token after the occurrence: `period` of them
                drafts.append(drafts[len(drafts) - period])
            return drafts
    return []


def _last_earlier_occurrence(token_ids: list[int], reversed_ids: list[int], n: int) -> int | None:
    """The start of the last occurrence of the final n tokens that begins before them (overlap allowed), or
    None; `reversed_ids` is every token but the last, newest first."""
    num_tokens = len(token_ids)
    suffix = token_ids[num_tokens - n :]
    last = suffix[-1]
    offset = 0
    while True:
        try:
            offset = reversed_ids.index(last, offset)
        except ValueError:
            return None
        end = num_tokens - 1 - offset  # the candidate occurrence is token_ids[end - n : end]
        if end - n < 0:
            return None
        if token_ids[end - n : end] == suffix:
            return end - n
        offset += 1
