"""The copy-heavy speculation benchmark's pure parts (benchmarks/speculative_copy_heavy.py; its own run on the CPU is
the check of the rest): each chat holds a passage its answer should copy, and a phase's spec_decode figures are
the counters gained between two stats snapshots."""

from types import SimpleNamespace

from benchmarks.speculative_copy_heavy import PASSAGES, TASKS, copy_prompt, with_typos
from benchmarks.speculative_tpot import spec_decode_figures


def _stats(drafts: int, draft_tokens: int, accepted: int, per_position: tuple[int, ...]) -> SimpleNamespace:
    return SimpleNamespace(spec_decode_num_drafts=drafts, spec_decode_num_draft_tokens=draft_tokens,
                           spec_decode_num_accepted_tokens=accepted,
                           spec_decode_num_accepted_tokens_per_pos=per_position)


def test_spec_decode_figures_count_only_what_was_gained_since_the_earlier_stats():
    before, after = _stats(3, 6, 4, (3, 1)), _stats(13, 46, 24, (10, 8, 4, 2))
    assert spec_decode_figures(after, since=before) == {
        "drafts": 10, "draft_tokens": 40, "accepted_tokens": 20, "accepted_tokens_per_position": [7, 7, 4, 2],
        "tokens_per_verification": 3.0}
    assert spec_decode_figures(before)["tokens_per_verification"] == 1 + 4 / 3
    assert spec_decode_figures(_stats(0, 0, 0, ()))["tokens_per_verification"] is None


def test_every_chat_holds_its_passage_whole_or_with_a_few_swapped_letters():
    chats = [copy_prompt(i)[0]["content"] for i in range(len(PASSAGES) * len(TASKS))]
    for index, content in enumerate(chats):
        passage = PASSAGES[index % len(PASSAGES)].text
        if TASKS[index % len(TASKS)] == "fix typos":
            typed = with_typos(passage)
            assert typed in content and typed != passage
            changed = [(a, b) for a, b in zip(passage.split(), typed.split()) if a != b]
            assert len(typed.split()) == len(passage.split()) and len(changed) <= len(passage.split()) // 9
            assert all(sorted(a) == sorted(b) for a, b in changed)
        else:
            assert passage in content
