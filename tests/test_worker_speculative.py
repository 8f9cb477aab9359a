"""Speculative decoding on the worker: a row with draft tokens computes them with its last known token in one
chunk, samples at each position exactly as decoding one token at a time would (same parameters, same seeded
position), keeps the drafts while they match and answers the token sampled after the last kept one. So a run
with drafts, right or wrong, gives the tokens of the run without them, and the rows stay consistent for the
steps after (computed tokens, known tokens, the rejected drafts' slots overwritten)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import worker_pb2
from worker_svc.config import WorkerConfig
from worker_svc.persistent_batch import PersistentBatch
from worker_svc.worker import Worker

BLOCK = 16
PROMPTS = {"a": [5, 9, 2, 7, 3, 5, 9], "b": [11, 4, 8], "c": [6, 6, 1, 9, 12, 3, 3, 7, 1, 2, 4, 8, 6, 13, 5, 1, 9, 9]}
# d's prompt leaves it two tokens to sample before max_model_len (48).
PROMPTS["d"] = (PROMPTS["c"] * 3)[:46]
BLOCKS = {"a": [0, 1, 2], "b": [3, 4, 5], "c": [6, 7, 8], "d": [9, 10, 11]}
NUM_DECODES = 9


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"), "llama", seed=3)


def make_worker(model_dir) -> Worker:
    worker = Worker(WorkerConfig(scheduler_address="", model=str(model_dir), num_kv_blocks=32, swap_space=0.01))
    worker.setup(worker_pb2.WorkerSetup(block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=256,
                                        max_model_len=48))
    return worker


def new(request_id: str, num_scheduled: int | None = None, blocks=None, **sampling) -> worker_pb2.NewRequest:
    prompt = PROMPTS[request_id]
    params = dict(temperature=0.0, top_p=1.0, top_k=-1, seed=17, num_logprobs=-1, num_prompt_logprobs=-1)
    return worker_pb2.NewRequest(
        request_id=request_id, token_ids=prompt, block_ids=BLOCKS[request_id] if blocks is None else blocks,
        num_computed_tokens=0,
        num_scheduled_tokens=num_scheduled or len(prompt), num_prompt_tokens=len(prompt),
        sampling=worker_pb2.WorkerSamplingParams(**{**params, **sampling}))


def scheduled(request_id: str, drafts=(), num_tokens: int = 1, new_blocks=()) -> worker_pb2.ScheduledRequest:
    return worker_pb2.ScheduledRequest(request_id=request_id, num_scheduled_tokens=num_tokens + len(drafts),
                                       draft_token_ids=list(drafts), new_block_ids=list(new_blocks))


def decode(*requests: worker_pb2.ScheduledRequest, new_requests=()) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(new_requests=list(new_requests), scheduled_requests=list(requests),
                               has_draft_tokens=any(r.draft_token_ids for r in requests))


def output_of(worker: Worker, plans: list[worker_pb2.StepPlan],
              logprobs: dict[str, list[float]] | None = None) -> dict[str, list[int]]:
    """Each request's tokens as the scheduler learns them: a row's kept drafts, then its sampled token (and,
    into `logprobs`, their logprobs: the kept drafts' from accepted_draft_logprobs, row after row)."""
    out: dict[str, list[int]] = {}
    for plan in plans:
        drafts = {s.request_id: list(s.draft_token_ids) for s in plan.scheduled_requests}
        sampled = worker.execute(plan).sampled
        accepted = list(sampled.num_accepted_drafts) or [0] * len(sampled.request_ids)
        assert len(accepted) == len(sampled.request_ids)
        assert bool(sampled.num_accepted_drafts) == any(drafts.values()), "filled only when some row had drafts"
        assert len(sampled.accepted_draft_logprobs) == sum(accepted)
        kept_logprobs = iter(sampled.accepted_draft_logprobs)
        for request_id, token_id, logprob, kept in zip(sampled.request_ids, sampled.token_ids, sampled.logprobs,
                                                       accepted):
            out.setdefault(request_id, []).extend(drafts.get(request_id, [])[:kept] + [token_id])
            if logprobs is not None:
                logprobs.setdefault(request_id, []).extend([next(kept_logprobs) for _ in range(kept)] + [logprob])
    return out


def reference_output(model_dir, **sampling) -> list[int]:
    """a's prefill token, then NUM_DECODES tokens decoded one at a time."""
    plans = [decode(new_requests=[new("a", **sampling)])] + [decode(scheduled("a"))] * NUM_DECODES
    return output_of(make_worker(model_dir), plans)["a"]


def assert_row_consistent(worker: Worker, request_id: str, output: list[int]) -> None:
    batch = worker.batch
    row = batch.row_of(request_id)
    known = PROMPTS[request_id] + output
    assert batch.num_tokens[row] == len(known) and batch.num_computed_tokens[row] == len(known) - 1
    assert batch.token_ids[row, : len(known)].tolist() == known
    assert batch.num_drafts[row] == 0 and batch.num_rows_with_drafts == 0


@pytest.mark.parametrize("sampling", [{}, dict(temperature=1.0, top_p=0.9, seed=1234),
                                      dict(presence_penalty=-2.0, repetition_penalty=0.9)],
                         ids=["greedy", "seeded", "penalized"])
def test_right_drafts_are_all_kept_and_wrong_ones_give_the_plain_token(model_dir, sampling):
    """Steps with right drafts, a wrong one in the middle, a wrong first one, and plain decodes between, give
    the plain run's tokens (seeded sampling too: each position's noise is keyed by its own position; penalties
    too, though the scheduler sends them no drafts: each position counts the drafts before it; negative ones,
    so that this model's output repeats tokens and the counts matter)."""
    ref = reference_output(model_dir, **sampling)
    wrong = [(token + 1) % 50 for token in ref]
    steps = [
        (scheduled("a", ref[1:4]), 3),  # all three kept: the 5th token comes from the position after them
        (scheduled("a"), 0),  # a plain decode right after, from the kept tokens
        (scheduled("a", [ref[6], wrong[7], ref[8]]), 1),  # kept up to the wrong one, which is replaced
        (scheduled("a", [wrong[8]]), 0),
        (scheduled("a"), 0),
    ]
    worker = make_worker(model_dir)
    output = output_of(worker, [decode(new_requests=[new("a", **sampling)])])["a"]
    for request, kept in steps:
        result = worker.execute(decode(request)).sampled
        assert list(result.num_accepted_drafts) == ([kept] if request.draft_token_ids else [])
        output += list(request.draft_token_ids)[:kept] + list(result.token_ids)
        assert_row_consistent(worker, "a", output)
    assert output == ref[: len(output)] and len(output) == 10


def test_a_row_with_drafts_beside_a_prefill_chunk_and_a_plain_decode(model_dir):
    """One step: b decodes one token, c's prompt is in its first chunk (it samples nothing yet), a has three
    drafts (two right); every request's tokens are those of the run without drafts."""
    def plans(a_drafts) -> list[worker_pb2.StepPlan]:
        return [decode(new_requests=[new("a"), new("b")]), decode(scheduled("a"), scheduled("b")),
                decode(scheduled("b"), scheduled("a", a_drafts), new_requests=[new("c", num_scheduled=10)]),
                decode(scheduled("a"), scheduled("b"), scheduled("c", num_tokens=8)),
                decode(scheduled("a"), scheduled("b"), scheduled("c"))]

    reference = output_of(make_worker(model_dir), plans([]) + [decode(scheduled("a"))] * 2)
    right = reference["a"][2:4]
    worker = make_worker(model_dir)
    output = output_of(worker, plans(right + [(reference["a"][4] + 1) % 50]))
    assert len(output["a"]) == 7 and output["a"] == reference["a"]
    assert output["b"] == reference["b"] and output["c"] == reference["c"]
    for request_id, tokens in output.items():
        assert_row_consistent(worker, request_id, tokens)


def test_kept_drafts_report_the_logprobs_of_decoding_them_one_at_a_time(model_dir):
    """Two rows keep drafts in one step: each kept draft's logprob comes back, row after row, equal to its
    token's logprob in the run without drafts (so cumulative logprobs and per-token logprobs do not change)."""
    first = decode(new_requests=[new("a"), new("b")])
    reference_logprobs: dict[str, list[float]] = {}
    reference = output_of(make_worker(model_dir), [first] + [decode(scheduled("a"), scheduled("b"))] * 4,
                          reference_logprobs)
    a, b = reference["a"], reference["b"]
    logprobs: dict[str, list[float]] = {}
    output = output_of(make_worker(model_dir), [first, decode(scheduled("a", [a[1], a[2], (a[3] + 1) % 50]),
                                                              scheduled("b", [b[1], b[2], b[3]]))], logprobs)
    assert output == {"a": a[:4], "b": b[:5]}
    for request_id, tokens in output.items():
        assert logprobs[request_id] == pytest.approx(reference_logprobs[request_id][: len(tokens)], abs=1e-5)


def test_drafts_crossing_into_a_new_block_then_rejected_leave_the_next_block_after_the_kept_ones(model_dir):
    """a's drafts run from its first block into a second one (allocated with them); the wrong ones are rejected,
    so the scheduler frees that block and gives it to b, and a's next block (5) must follow its first: a and b
    then write different slots, and both give the tokens of the run without drafts."""
    first_decodes = [decode(new_requests=[new("a", blocks=[0])])] + [decode(scheduled("a"))] * 7  # 14 computed
    after = [decode(scheduled("a", new_blocks=[5]), new_requests=[new("b", blocks=[1])]),
             decode(scheduled("a"), scheduled("b")), decode(scheduled("a"), scheduled("b"))]
    reference = output_of(make_worker(model_dir), first_decodes + [decode(scheduled("a"))] * 2 + after)
    ref = reference["a"]
    worker = make_worker(model_dir)
    wrong = [(token + 1) % 50 for token in ref]
    with_drafts = decode(scheduled("a", [ref[8], wrong[9], wrong[10]], new_blocks=[1]))  # positions 15, 16, 17
    output = output_of(worker, first_decodes + [with_drafts])
    row = worker.batch.row_of("a")
    assert worker.batch.num_blocks[row] == 1, "16 computed tokens: the block of the rejected drafts is dropped"
    for request_id, tokens in output_of(worker, after).items():
        output.setdefault(request_id, []).extend(tokens)
    assert worker.batch.block_table[row, : worker.batch.num_blocks[row]].tolist() == [0, 5]
    assert output == reference
    for request_id, tokens in output.items():
        assert_row_consistent(worker, request_id, tokens)


def test_a_plain_row_reaching_max_model_len_beside_a_row_with_drafts(model_dir):
    """d samples its last token (the 48th of max_model_len 48) in a step where a verifies drafts: only the draft
    entries are read back from the rows, and both give the tokens of the run without drafts."""
    def plans(a_drafts) -> list[worker_pb2.StepPlan]:
        return [decode(new_requests=[new("a"), new("d")]), decode(scheduled("d"), scheduled("a", a_drafts))]

    reference = output_of(make_worker(model_dir), plans([]) + [decode(scheduled("a"))] * 2)
    worker = make_worker(model_dir)
    output = output_of(worker, plans(reference["a"][1:3] + [(reference["a"][3] + 1) % 50]))
    assert len(output["d"]) == 2 and len(PROMPTS["d"]) + 2 == 48
    assert output["d"] == reference["d"] and output["a"] == reference["a"]
    for request_id, tokens in output.items():
        assert_row_consistent(worker, request_id, tokens)


def test_a_plan_with_drafts_is_not_overlapped_nor_launched_behind_one(model_dir):
    worker = make_worker(model_dir)
    worker.execute(decode(new_requests=[new("a"), new("b")]))
    assert worker.can_overlap(decode(scheduled("a"), scheduled("b")))
    with_drafts = decode(scheduled("a", [3, 4]), scheduled("b"))
    assert not worker.can_overlap(with_drafts)
    in_flight = worker.launch(with_drafts)
    assert not worker.can_overlap(decode(scheduled("b"))), "the step in flight's drafts are verified first"
    worker.finish(in_flight)
    assert worker.can_overlap(decode(scheduled("a"), scheduled("b")))
    unmarked = decode(scheduled("a", [3, 4]), scheduled("b"))
    unmarked.has_draft_tokens = False  # the flag can_overlap reads: a plan without it is refused, not overlapped
    with pytest.raises(ValueError, match="has_draft_tokens"):
        worker.execute(unmarked)


def test_drafts_for_a_row_returning_logprobs_are_refused(model_dir):
    worker = make_worker(model_dir)
    worker.execute(decode(new_requests=[new("a", num_logprobs=2)]))
    with pytest.raises(ValueError, match="draft tokens"):
        worker.execute(decode(scheduled("a", [3, 4])))


def test_sampling_entries_of_a_mixed_step():
    """Decode rows sample once at their token, a chunk ending its prompt at its last token, a chunk in the
    middle not at all; a row with d drafts 1 + d times, at its last known token and each draft (offsets 0..d)."""
    batch = PersistentBatch(max_num_seqs=4, max_model_len=48, block_size=BLOCK)
    for request_id, num_computed in (("a", 6), ("b", 2), ("c", 0)):
        batch.add(worker_pb2.NewRequest(request_id=request_id, token_ids=PROMPTS[request_id],
                                        block_ids=BLOCKS[request_id], num_computed_tokens=num_computed,
                                        sampling=worker_pb2.WorkerSamplingParams(num_logprobs=-1)))
    batch.update(scheduled("a", [40, 41, 42]))
    rows = np.asarray([batch.row_of("b"), batch.row_of("c"), batch.row_of("a")])
    inputs = batch.build_inputs(rows, np.asarray([1, 10, 4]))
    assert inputs.num_draft_tokens == 3
    assert inputs.input_ids[-4:].tolist() == [9, 40, 41, 42]
    assert inputs.sample_rows.tolist() == [rows[0]] + [rows[2]] * 4
    assert inputs.sample_offsets.tolist() == [0, 0, 1, 2, 3]
    assert inputs.logits_indices.tolist() == [0, 11, 12, 13, 14]
    assert batch.num_tokens[rows[2]] == len(PROMPTS["a"]), "drafts are not known tokens"
