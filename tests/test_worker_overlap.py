"""A worker launching step N+1 before it finishes step N (its input tokens still pending on the device) gives
exactly the tokens of running the steps one at a time, including when a finished request's row is handed to
a new request while the old owner's last token is still in flight."""

from __future__ import annotations

import re

import numpy as np
import pytest

from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import worker_pb2
from worker_svc.config import WorkerConfig
from worker_svc.persistent_batch import PENDING_TOKEN
from worker_svc.worker import Worker

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"), "llama", seed=3)


def make_worker(model_dir) -> Worker:
    worker = Worker(WorkerConfig(scheduler_address="", model=str(model_dir), num_kv_blocks=64, swap_space=0.01))
    worker.setup(worker_pb2.WorkerSetup(block_size=BLOCK, max_num_seqs=2, max_num_batched_tokens=256,
                                        max_model_len=128))
    return worker


def new(request_id: str, prompt: list[int], blocks: list[int], temperature: float = 0.0) -> worker_pb2.NewRequest:
    return worker_pb2.NewRequest(
        request_id=request_id, token_ids=prompt, block_ids=blocks, num_computed_tokens=0,
        num_scheduled_tokens=len(prompt), num_prompt_tokens=len(prompt),
        sampling=worker_pb2.WorkerSamplingParams(temperature=temperature, top_p=1.0, top_k=-1, seed=17,
                                                 num_logprobs=-1, num_prompt_logprobs=-1))


def decode(*request_ids: str, finished=(), new_requests=()) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(
        finished_request_ids=list(finished), new_requests=list(new_requests),
        scheduled_requests=[worker_pb2.ScheduledRequest(request_id=r, num_scheduled_tokens=1) for r in request_ids])


def plans() -> list[worker_pb2.StepPlan]:
    """a and b prefill, decode twice; then a leaves and c takes its row (a's last token may be in flight)."""
    a = new("a", [5, 9, 2, 7, 3], [0, 1])
    b = new("b", [11, 4, 8], [2, 3], temperature=0.8)
    c = new("c", [6, 6, 1, 9], [4, 5])
    steps = [worker_pb2.StepPlan(new_requests=[a, b]), decode("a", "b"), decode("a", "b"),
             decode("b", finished=["a"], new_requests=[c]), decode("b", "c"), decode("b", "c")]
    for step_id, plan in enumerate(steps):
        plan.step_id = step_id
    return steps


def tokens_of(results) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for result in results:
        for request_id, token_id in zip(result.sampled.request_ids, result.sampled.token_ids):
            out.setdefault(request_id, []).append(token_id)
    return out


def test_overlapped_steps_sample_what_sequential_steps_sample(model_dir):
    reference = make_worker(model_dir)
    sequential = tokens_of([reference.execute(plan) for plan in plans()])
    worker = make_worker(model_dir)
    results, in_flight = [], None
    for plan in plans():
        assert worker.can_overlap(plan)
        launched = worker.launch(plan, previous=in_flight)
        if in_flight is not None:
            results.append(worker.finish(in_flight))
        in_flight = launched
        rows = [worker.batch.row_of(r) for r in ("a", "b", "c") if r in worker.batch._row_of]
        assert any(worker.batch.token_ids[row, worker.batch.num_tokens[row] - 1] == PENDING_TOKEN for row in rows)
    results.append(worker.finish(in_flight))
    assert tokens_of(results) == sequential
    assert [len(t) for t in sequential.values()] == [3, 6, 3]
    c_row = worker.batch.row_of("c")
    assert list(worker.batch.token_ids[c_row, :4]) == [6, 6, 1, 9], "a's late token must not land in c's row"
    assert not np.any(worker.batch.token_ids[c_row, : worker.batch.num_tokens[c_row]] == PENDING_TOKEN)


def test_a_row_reading_its_history_is_not_overlapped(model_dir):
    worker = make_worker(model_dir)
    plan = plans()[0]
    plan.new_requests[1].sampling.repetition_penalty = 1.3
    worker.execute(plan)
    assert not worker.can_overlap(decode("a", "b")) and worker.can_overlap(decode("a"))


@pytest.mark.parametrize("masks", ["filled at the draw", "filled in the background", "filled inline"])
def test_a_grammar_row_launched_behind_a_step_draws_once_that_steps_token_is_consumed(tmp_path, masks):
    """A constrained row overlaps like any other: its forward is queued at once, its mask and draw wait for the
    token in flight (Worker.complete), so overlapped steps give the sequential steps' tokens, every one of which
    the grammar accepts, seeded draws at the same positions included. In the background (the serving loop's
    way: `begin_masks`, and the next launch draws), the masks fill while the next plan hands the constrained
    row to a request of another grammar: the draw still uses the row's old matcher. Inline (few rows: the
    default for these two), `begin_masks` fills them at once. The step timers count the constrained steps
    apart, and the grammar timing line reports the fills."""
    from llguidance import LLMatcher

    from pagedserve.testing.tiny_models import add_embedded_tokenizer
    from scheduler_svc.text.tokenizer_loading import load_tokenizer

    model = add_embedded_tokenizer(make_tiny_model(tmp_path, "llama", seed=3, vocab_size=49216, eos_token_id=2))
    tokenizer = load_tokenizer(str(model))
    grammar = LLMatcher.grammar_from_regex("(cat|dog)s? [0-9]{1,6}")
    other_grammar = LLMatcher.grammar_from_regex("(red|blue) [a-z]{1,8}")

    def constrained_worker() -> Worker:
        worker = Worker(WorkerConfig(scheduler_address="", model=str(model), num_kv_blocks=64, swap_space=0.01))
        worker.setup(worker_pb2.WorkerSetup(
            block_size=BLOCK, max_num_seqs=2, max_num_batched_tokens=256, max_model_len=128,
            structured_output_tokenizer=worker_pb2.StructuredOutputTokenizer(tokenizer_json=tokenizer.to_json(),
                                                                              eos_token_ids=[2])))
        return worker

    def steps() -> list[worker_pb2.StepPlan]:
        a, b = new("a", [5, 9, 2, 7, 3], [0, 1], temperature=0.9), new("b", [11, 4, 8], [2, 3])
        c = new("c", [6, 6, 1, 9], [4, 5], temperature=0.9)
        a.sampling.structured_grammar = grammar
        c.sampling.structured_grammar = other_grammar
        out = [worker_pb2.StepPlan(step_id=0, new_requests=[a, b])]
        out += [decode("a", "b") for _ in range(4)]
        return out + [decode("b", finished=["a"], new_requests=[c])] + [decode("b", "c") for _ in range(4)]

    reference = constrained_worker()
    sequential = tokens_of([reference.execute(plan) for plan in steps()])
    worker = constrained_worker()
    if masks == "filled in the background":
        worker.batch.grammars.inline_rows = 0
    results, in_flight = [], None
    for plan in steps():
        assert worker.can_overlap(plan)
        launched = worker.launch(plan, previous=in_flight)
        if in_flight is not None:
            assert launched.deferred_sample is not None, "the grammar row's draw waits for the token in flight"
            results.append(worker.finish(in_flight))
        if masks == "filled at the draw":
            worker.complete(launched)
        else:
            worker.begin_masks(launched)
            assert launched.draw_pending == (in_flight is not None) == (launched.masks is not None)
            if launched.masks is not None and masks == "filled inline":
                assert launched.masks.done()
        in_flight = launched
    results.append(worker.finish(in_flight))
    overlapped = tokens_of(results)
    assert overlapped == sequential
    assert [len(overlapped[r]) for r in "abc"] == [5, 10, 5]
    assert re.fullmatch(r"(cat|dog)s?( [0-9]{0,6})?", tokenizer.decode(overlapped["a"]))
    assert re.fullmatch(r"(red|blue)( [a-z]{0,8})?", tokenizer.decode(overlapped["c"]))
    assert "decode constrained x" in worker.step_timer.summary()
    assert re.search(r"grammar masks: fill x \d+ \(1 rows\)", worker.grammar_summary())
