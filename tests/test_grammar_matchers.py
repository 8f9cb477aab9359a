"""The worker's grammar matchers (worker_svc/grammar_matchers.py) inside the persistent batch: a row's bitmask
allows exactly its grammar's next tokens and never an id past the tokenizer's vocabulary (a padded model vocab);
a resumed row first replays its output; a complete grammar allows only the scheduler's EOS ids, and a stopped one
takes the token of a step planned before the EOS was seen; a token the grammar rejects, or a grammar that reaches
one of the scheduler's limits while masking, fails that row's request alone (a short reason, no parser state) and
the other rows go on; a resumed output the grammar rejects raises; a token of a row
handed to another request is not fed to the new owner's matcher; a constrained row reads its history (no overlap);
masked logits sample only allowed tokens; and a grammar that starts after a token (a reasoning model's end of
thought) is neither applied nor advanced before it, constrains from the token after it, and a resumed row
whose output holds it starts constrained, its matcher advanced over the tokens after it. Each runs with the
masks and advances on llguidance's pool and, for a few rows, on the calling thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from llguidance import LLMatcher

from kernels.token_bitmask_ref import allowed_tokens, apply_token_bitmask
from protos.pagedserve.v1 import worker_pb2
from scheduler_svc.text.tokenizer_loading import load_tokenizer
from service_runtime.model_source import resolve_model
from worker_svc.grammar_matchers import GrammarMatchers, GrammarViolation
from worker_svc.persistent_batch import PersistentBatch

MODEL_VOCAB = 49216  # SmolLM2's 49152 tokens, padded
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None).path)


@pytest.fixture(scope="module")
def source(tokenizer):
    return worker_pb2.StructuredOutputTokenizer(tokenizer_json=tokenizer.to_json(), eos_token_ids=[EOS])


@pytest.fixture(params=[0, 4], ids=["pool", "inline"])
def batch(source, request):
    """Masks filled and tokens consumed on llguidance's pool, or (up to 4 rows) on the calling thread."""
    return PersistentBatch(4, 128, 16, GrammarMatchers(source, MODEL_VOCAB, 4, inline_rows=request.param))


@pytest.fixture
def pooled_batch(source):
    return PersistentBatch(4, 128, 16, GrammarMatchers(source, MODEL_VOCAB, 4, inline_rows=0))


GRAMMAR = LLMatcher.grammar_from_regex(r"(cat|dog)s? [0-9]{2}")


def new_request(request_id: str, token_ids: list[int], num_prompt_tokens: int, grammar: str = GRAMMAR,
                after_token_id: int | None = None):
    sampling = worker_pb2.WorkerSamplingParams(temperature=1.0, structured_grammar=grammar,
                                               structured_grammar_after_token_id=after_token_id)
    return worker_pb2.NewRequest(request_id=request_id, token_ids=token_ids, num_prompt_tokens=num_prompt_tokens,
                                 sampling=sampling, num_scheduled_tokens=len(token_ids))


def allowed(batch, row: int) -> list[int]:
    indices, bitmask = batch.grammars.bitmask(np.array([row]))
    assert indices.tolist() == [0]
    return allowed_tokens(bitmask, MODEL_VOCAB)[0].nonzero().flatten().tolist()


def decoded(tokenizer, ids: list[int]) -> set[str]:
    return {tokenizer.decode([i]) for i in ids}


def fill(batch, rows: list[int], tokens: list[int], generations=None) -> list[worker_pb2.FailedRequest]:
    from worker_svc.persistent_batch import PendingTokens

    rows_array = np.array(rows)
    generations = batch.generation[rows_array].copy() if generations is None else np.array(generations)
    positions = batch.num_tokens[rows_array].copy()
    batch.num_tokens[rows_array] += 1
    return batch.fill(PendingTokens(rows_array, generations, positions), np.array(tokens))


def test_the_bitmask_allows_the_grammars_next_tokens_only_within_the_tokenizer(batch, tokenizer):
    row = batch.add(new_request("a", [10, 11], 2))
    first = allowed(batch, row)
    assert first and max(first) < 49152
    assert all(text and ("cats".startswith(text) or "dogs".startswith(text)) for text in decoded(tokenizer, first))
    plain = batch.add(worker_pb2.NewRequest(request_id="b", token_ids=[5], num_prompt_tokens=1,
                                            sampling=worker_pb2.WorkerSamplingParams(temperature=1.0)))
    indices, _ = batch.grammars.bitmask(np.array([plain, row]))
    assert indices.tolist() == [1]  # only the constrained row gets a mask
    assert batch.grammars.bitmask(np.array([plain])) is None
    # Its mask waits for the token in flight inside the worker (Worker.complete), not by refusing to overlap.
    assert not batch.reads_history(row) and not batch.reads_history(plain)


def test_a_resumed_row_replays_its_output_and_a_complete_grammar_allows_only_eos(batch, tokenizer):
    output = tokenizer.encode("dogs 4", add_special_tokens=False)
    row = batch.add(new_request("a", [10, 11, *output], 2))
    assert decoded(tokenizer, allowed(batch, row)) <= {str(d) for d in range(10)}
    fill(batch, [row], tokenizer.encode("7", add_special_tokens=False))
    assert allowed(batch, row) == [EOS]
    fill(batch, [row], [EOS])
    assert allowed(batch, row) == [EOS]  # stopped: the step planned before the scheduler saw EOS
    fill(batch, [row], [EOS])


def test_a_token_the_grammar_rejects_fails_its_request_alone_and_the_other_rows_go_on(batch, tokenizer):
    bad = batch.add(new_request("bad", [10], 1))
    good = batch.add(new_request("good", [10], 1))
    seven, dog = (tokenizer.encode(text, add_special_tokens=False)[0] for text in ("7", "dog"))
    failed = fill(batch, [bad, good], [seven, dog])
    assert [f.request_id for f in failed] == ["bad"] and "rejected sampled token" in failed[0].reason
    assert "<state>" not in failed[0].reason and "Tokens:" not in failed[0].reason  # no parser state
    assert not batch.grammars.constrained[bad]  # not asked for masks or advanced again: it ends
    assert fill(batch, [bad], [seven]) == []  # reported once
    assert decoded(tokenizer, allowed(batch, good)) >= {"s", " "}  # the other row's grammar went on: "dog" + ...


def test_a_grammar_that_reaches_a_limit_while_masking_fails_its_request_alone(source, tokenizer):
    """The scheduler's limits bound every mask: a JSON object's first mask needs more Earley items than a
    step_max_items of 2, so its matcher stops there (EOS only), and the advance reports its request instead of
    raising; a one-literal grammar fits the same limits and goes on."""
    limits = worker_pb2.StructuredOutputLimits(step_max_items=2)
    batch = PersistentBatch(4, 128, 16, GrammarMatchers(source, MODEL_VOCAB, 4, limits=limits))
    costly = batch.add(new_request("costly", [10], 1, grammar=LLMatcher.grammar_from_json_schema({"type": "object"})))
    other = batch.add(new_request("other", [10], 1, grammar=LLMatcher.grammar_from_lark('start: "x"')))
    assert allowed(batch, costly) == [EOS]  # the limit hit: nothing but the end
    x = tokenizer.encode("x", add_special_tokens=False)[0]
    failed = fill(batch, [costly, other], [EOS, x])
    assert [f.request_id for f in failed] == ["costly"] and "limit" in failed[0].reason, failed
    assert "<state>" not in failed[0].reason
    assert allowed(batch, other) == [EOS]  # the other row consumed its token and is complete


def test_a_resumed_output_the_grammar_rejects_raises_and_leaves_no_row(batch, tokenizer):
    with pytest.raises(GrammarViolation):
        batch.add(new_request("a", [10, *tokenizer.encode("7", add_special_tokens=False)], 1))
    assert len(batch) == 0 and not batch.grammars.constrained.any()


def test_a_late_token_of_a_rows_previous_owner_does_not_reach_the_new_owners_matcher(batch, tokenizer):
    row = batch.add(new_request("old", [10], 1))
    generation = batch.generation[row]
    batch.remove("old")
    assert batch.add(new_request("new", [10], 1)) == row
    fill(batch, [row], tokenizer.encode("7", add_special_tokens=False), generations=[generation])  # no raise
    texts = decoded(tokenizer, allowed(batch, row))  # the new owner's grammar is still at its start
    assert texts and all("cats".startswith(text) or "dogs".startswith(text) for text in texts)


def test_masked_logits_sample_only_allowed_tokens(batch):
    from worker_svc.sampling.sampler import SamplingTensors, sample

    row = batch.add(new_request("a", [10], 1))
    indices, bitmask = batch.grammars.bitmask(np.array([row]))
    logits = torch.randn(1, MODEL_VOCAB) * 5
    apply_token_bitmask(logits, bitmask, torch.as_tensor(indices))
    allowed_ids = set(allowed(batch, row))
    for seed in range(5):
        tensors = SamplingTensors.from_host(temperature=[1.0], top_p=[1.0], top_k=[-1], seed=[seed], position=[1],
                                            device="cpu")
        assert sample(logits, tensors).token_ids.item() in allowed_ids


def test_a_worker_without_tokenizer_refuses_a_constrained_row():
    batch = PersistentBatch(2, 64, 16, GrammarMatchers(None, MODEL_VOCAB, 2))
    with pytest.raises(ValueError, match="no tokenizer"):
        batch.add(new_request("a", [1], 1))
    assert len(batch) == 0


THINK_END = 11  # any id: the token that ends the thought


def test_a_grammar_after_a_token_waits_for_it_then_constrains_from_the_next(batch, tokenizer):
    row = batch.add(new_request("a", [10], 1, after_token_id=THINK_END))
    assert batch.grammars.bitmask(np.array([row])) is None  # not applied while thinking
    assert batch.grammars.follows_sampled_tokens(np.array([row]))  # a draw behind another step waits
    for token in tokenizer.encode("7 7", add_special_tokens=False):  # not advanced: "7" would be rejected
        fill(batch, [row], [token])
    fill(batch, [row], [THINK_END])  # the end token itself is not the grammar's
    texts = decoded(tokenizer, allowed(batch, row))
    assert texts and all("cats".startswith(text) or "dogs".startswith(text) for text in texts)
    assert [f.request_id for f in fill(batch, [row], tokenizer.encode("7", add_special_tokens=False))] == ["a"]


def test_a_resumed_row_past_its_start_token_replays_only_the_tokens_after_it(batch, tokenizer):
    thought = tokenizer.encode("7 x", add_special_tokens=False)
    answer = tokenizer.encode("dogs 4", add_special_tokens=False)
    row = batch.add(new_request("a", [10, *thought, THINK_END, *answer], 1, after_token_id=THINK_END))
    assert decoded(tokenizer, allowed(batch, row)) <= {str(d) for d in range(10)}
    waiting = batch.add(new_request("b", [10, *thought], 1, after_token_id=THINK_END))
    assert batch.grammars.bitmask(np.array([waiting])) is None


def test_a_plans_grammars_are_built_ahead_and_each_row_advances_apart(batch, tokenizer, monkeypatch):
    """`prepare` builds the matchers of a plan's new constrained rows on threads; the `add`s then build none,
    rows of one grammar advance apart, a resumed row replays from its prepared matcher, and a grammar that
    does not compile is refused at its `add` as when built there."""
    import worker_svc.grammar_matchers as module

    built = []

    def building(tokenizer, grammar, **options):
        built.append(grammar)
        return LLMatcher(tokenizer, grammar, **options)

    monkeypatch.setattr(module, "LLMatcher", building)
    other, broken = LLMatcher.grammar_from_regex("yes|no"), LLMatcher.grammar_from_regex("(")
    batch.grammars.prepare([GRAMMAR, GRAMMAR, other, GRAMMAR, broken])
    assert sorted(built) == sorted([GRAMMAR, GRAMMAR, other, GRAMMAR, broken])
    first = batch.add(new_request("a", [10, 11], 2))
    start = allowed(batch, first)
    fill(batch, [first], tokenizer.encode("dog", add_special_tokens=False)[:1])
    second = batch.add(new_request("b", [10, 12], 2))
    resumed = batch.add(new_request("c", [10, *tokenizer.encode("cats 1", add_special_tokens=False)], 1))
    yes_no = batch.add(new_request("d", [10], 1, grammar=other))
    assert len(built) == 5, "every add took a prepared matcher"
    assert allowed(batch, second) == start != allowed(batch, first)
    assert decoded(tokenizer, allowed(batch, resumed)) <= {str(d) for d in range(10)}
    assert all("yes".startswith(text) or "no".startswith(text) for text in decoded(tokenizer, allowed(batch, yes_no)))
    batch.remove("d")
    with pytest.raises(ValueError, match="does not compile"):
        batch.add(new_request("e", [10], 1, grammar=broken))


def test_a_finished_rows_matcher_serves_the_next_row_of_its_grammar_from_the_start(batch, tokenizer, monkeypatch):
    """A removed row's matcher is a spare of its grammar: the next new row of that grammar gets it back reset
    (the start state's mask, not the old row's), `prepare` builds only the rows spares do not cover, a resumed
    row replays its output into a spare, and a matcher in error is not kept."""
    import worker_svc.grammar_matchers as module

    built = []

    def building(tokenizer, grammar, **options):
        built.append(grammar)
        return LLMatcher(tokenizer, grammar, **options)

    monkeypatch.setattr(module, "LLMatcher", building)
    first = batch.add(new_request("a", [10, 11], 2))
    start = allowed(batch, first)
    old = batch.grammars._matchers[first]
    fill(batch, [first], tokenizer.encode("dog", add_special_tokens=False)[:1])
    second = batch.add(new_request("b", [10, 11], 2))
    batch.remove("a")
    assert len(built) == 2
    batch.grammars.prepare([GRAMMAR] * 3)  # the spare covers one row: two builds ahead
    assert len(built) == 4
    third = batch.add(new_request("c", [10, 12], 2))
    assert batch.grammars._matchers[third] is old and allowed(batch, third) == start
    resumed = batch.add(new_request("d", [10, *tokenizer.encode("cats 1", add_special_tokens=False)], 1))
    assert len(built) == 4, "the add took a build prepare made"
    assert decoded(tokenizer, allowed(batch, resumed)) <= {str(d) for d in range(10)}
    assert fill(batch, [second], tokenizer.encode("x", add_special_tokens=False)[:1])  # its request fails
    batch.remove("b")  # its matcher is in error now: not a spare
    batch.remove("c")
    batch.grammars.prepare([])  # the build prepare made and no add took becomes a spare too
    batch.add(new_request("e", [10], 1))
    batch.add(new_request("f", [10], 1))
    batch.add(new_request("g", [10], 1))
    assert len(built) == 5


def test_spare_matchers_keep_at_most_their_capacity_dropping_the_least_recent_grammar():
    from worker_svc.spare_matchers import SpareMatchers

    spares = SpareMatchers(3)
    for grammar, matcher in (("a", "a1"), ("b", "b1"), ("a", "a2"), ("c", "c1")):
        spares.put(grammar, matcher)
    assert (spares.count("a"), spares.count("b"), spares.count("c")) == (2, 0, 1)  # b: least recently returned
    spares.put("c", "c2")  # now a is: its oldest goes
    assert spares.count("a") == 1
    assert spares.take("c") == "c2" and spares.take("c") == "c1" and spares.take("c") is None
    assert spares.take("a") == "a2" and spares.take("a") is None


@pytest.fixture
def held_fill(monkeypatch):
    """Background mask fills wait until the returned Event is set (then compute as usual)."""
    import worker_svc.grammar_matchers as module

    release = threading.Event()
    real_fill = module.fill_next_token_bitmask_par

    def held(*args):
        release.wait(30)
        real_fill(*args)

    monkeypatch.setattr(module, "fill_next_token_bitmask_par", held)
    return release


def test_a_few_rows_masks_fill_on_the_calling_thread_and_more_in_the_background(source, held_fill):
    """Up to `inline_rows` rows, `bitmask_in_background` fills at once (no thread handoff: a lone request's
    latency); past it, on the background thread (held here until released)."""
    batch = PersistentBatch(4, 128, 16, GrammarMatchers(source, MODEL_VOCAB, 4, inline_rows=2))
    rows = np.array([batch.add(new_request(name, [10, 11], 2)) for name in "abc"])
    few = batch.grammars.bitmask_in_background(rows[:2])
    assert few.done() and few.result()[0].tolist() == [0, 1]
    many = batch.grammars.bitmask_in_background(rows)
    assert not many.done()
    held_fill.set()
    indices, bitmask = many.result(30)
    assert indices.tolist() == [0, 1, 2] and torch.equal(bitmask[:2], few.result()[1])


def test_a_matcher_that_a_background_fill_still_reads_is_not_reused_until_the_fill_is_done(pooled_batch, held_fill):
    """`bitmask_in_background` reads the rows' matchers on another thread; a row removed and a new row of the
    same grammar added meanwhile must get another matcher (resetting the one being read would corrupt the
    mask); once the fill is done, the next new row gets it."""
    batch = pooled_batch
    row = batch.add(new_request("a", [10, 11], 2))
    old = batch.grammars._matchers[row]
    pending = batch.grammars.bitmask_in_background(np.array([row]))
    batch.remove("a")
    other = batch.add(new_request("b", [10, 11], 2))
    assert batch.grammars._matchers[other] is not old
    held_fill.set()
    indices, bitmask = pending.result(30)
    assert indices.tolist() == [0]
    assert batch.grammars._matchers[batch.add(new_request("c", [10, 11], 2))] is old


def test_a_plan_that_finished_rows_could_spare_builds_waits_for_the_fill_holding_them(pooled_batch, held_fill,
                                                                                      monkeypatch):
    """Rows finish while their step's masks still fill in the background and the plan brings new rows of their
    grammar: `prepare` waits for the fill and reuses the finished rows' matchers instead of building."""
    batch = pooled_batch
    rows = [batch.add(new_request(name, [10, 11], 2)) for name in "ab"]
    finished = {id(batch.grammars._matchers[row]) for row in rows}
    pending = batch.grammars.bitmask_in_background(np.array(rows))
    batch.remove("a")
    batch.remove("b")
    built = []
    monkeypatch.setattr(batch.grammars, "_build", lambda grammar: built.append(grammar))
    threading.Timer(0.2, held_fill.set).start()
    batch.grammars.prepare([GRAMMAR] * 3)
    assert pending.done() and built == [], "two spares leave one build, made at its add"
    reused = {id(batch.grammars._matchers[batch.add(new_request(name, [10, 11], 2))]) for name in "cd"}
    assert reused == finished
