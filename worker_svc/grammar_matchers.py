"""The llguidance matchers of a worker's constrained rows: the grammar state of each, the allowed-token bitmask
of the rows that sample, and the advance by each sampled token.

Who owns what: the scheduler builds and validates each request's grammar (WorkerSamplingParams.structured_grammar)
and sends its tokenizer once, at setup (WorkerSetup.structured_output_tokenizer); the `PersistentBatch` owns one
`GrammarMatchers` and calls `add` / `remove` with its rows and `advance` when the sampled tokens reach the host;
the worker asks for the bitmask after the step's forward pass is queued (the GPU is busy meanwhile) and applies
it to the logits before the logits processors and sampling (kernels/token_bitmask_ref.py). A row's matcher is a
pure function of its grammar and its output tokens, so a resumed row (after preemption or a worker restart)
replays its output into a new matcher, and every tensor-parallel rank, which sees the same plans and samples
the same tokens, keeps identical matchers without talking to the others.

A row may start inactive (WorkerSamplingParams.structured_grammar_after_token_id: a reasoning model's end of
thought, vLLM's structured outputs with a reasoning parser): its matcher exists but is neither applied nor
advanced until the row samples that token; from the next token on the row is constrained. `waiting` marks
such rows: a step launched behind another defers their draw as it does a constrained row's, since the token
in flight may be the one that activates the grammar.

Why the tokenizer is built lazily: llguidance's token table costs about half a second for a 50k vocabulary; a
worker that never sees a constrained request never pays it. Its vocabulary is the model's (the logits' width)
when that is at least the tokenizer's: ids past the tokenizer's are never allowed. Its EOS ids are the
scheduler's (the model's and generation_config's): the ids a complete grammar allows, and the only ones a
stopped matcher allows.

Why a row's grammar error ends only its request: every matcher is built under the scheduler's limits
(WorkerSetup.structured_output_limits, the ones it tried the grammar with), so one mask or advance has bounded
work; a row whose grammar still reaches a limit, or rejects its sampled token, is taken out of the constrained
rows and reported by `advance` (a short reason, no parser state), and the scheduler ends that request with an
error (StepResult.failed_requests) while the worker goes on with the others.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher, LLParserLimits, LLTokenizer
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from protos.pagedserve.v1 import worker_pb2
from worker_svc.grammar_timing import GrammarTiming
from worker_svc.spare_matchers import SpareMatchers

logger = logging.getLogger(__name__)


class GrammarViolation(RuntimeError):
    """A resumed row's output that its grammar rejects."""


def short_reason(matcher: LLMatcher) -> str:
    """A matcher's error fit for a client: its first line (the limit or the rejection), never its parser state
    or grammar (matchers are built without verbose errors, and a `<state>` block is cut anyway)."""
    lines = matcher.get_error().strip().splitlines()
    reason = lines[0].split("<state>")[0].strip() if lines else ""
    return (reason or "the grammar's matcher stopped")[:300]


def mask_threads(world_size: int) -> int:
    """llguidance's threads for one worker: the CPUs it may run on, shared by the host's tensor-parallel
    ranks, less one for the worker's own thread (it prepares the next step while the masks fill), at most
    32. llguidance's default, 80% of every CPU, leaves cores idle on a one-GPU host and oversubscribes a
    multi-GPU one."""
    return max(1, min(32, len(os.sched_getaffinity(0)) // max(world_size, 1) - 1))


class GrammarMatchers:
    def __init__(self, tokenizer: worker_pb2.StructuredOutputTokenizer | None, vocab_size: int, max_num_seqs: int,
                 pin_memory: bool = False, num_threads: int | None = None, inline_rows: int = 4,
                 limits: worker_pb2.StructuredOutputLimits | None = None):
        self._tokenizer_source = tokenizer
        # The scheduler's limits (unset ones: llguidance's defaults); verbose errors off (no state in reasons).
        given = {} if limits is None else {field.name: value for field, value in limits.ListFields()}
        self._limits = LLParserLimits(**given, verbose_errors=False)
        self._vocab_size = vocab_size
        self._pin_memory = pin_memory
        self._num_threads = num_threads
        # Up to this many rows, masks are filled and tokens consumed on the calling thread: handing them to
        # llguidance's pool (and a fill to the background thread) wakes threads, which costs more than a row's
        # mask, and would be most of a lone constrained request's extra time per token.
        self.inline_rows = inline_rows
        self._tokenizer: LLTokenizer | None = None
        self._executor: LLExecutor | None = None
        self._background: ThreadPoolExecutor | None = None  # waits on llguidance's pool, the GIL released
        self._matchers: list[LLMatcher | None] = [None] * max_num_seqs
        self._grammars: list[str | None] = [None] * max_num_seqs
        # Matchers of the plan being applied, built ahead in parallel (`prepare`), by grammar.
        self._prepared: defaultdict[str, list[LLMatcher]] = defaultdict(list)
        self._builders: ThreadPoolExecutor | None = None
        self._spares = SpareMatchers(max_num_seqs)
        # Removed rows' matchers that a background fill may still read: spares once it is done.
        self._retired: list[tuple[str, LLMatcher]] = []
        self._filling: Future | None = None
        self.constrained = np.zeros(max_num_seqs, dtype=bool)
        # Rows whose grammar starts after `start_token_id[row]`, not sampled yet (see the module docstring).
        self.waiting = np.zeros(max_num_seqs, dtype=bool)
        self.start_token_id = np.full(max_num_seqs, -1, dtype=np.int64)
        self.timing = GrammarTiming()

    @property
    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            source = self._tokenizer_source
            if source is None or not source.tokenizer_json:
                raise ValueError("a constrained request, but the scheduler sent no tokenizer at setup")
            eos = list(source.eos_token_ids) or None
            try:
                self._tokenizer = LLTokenizer(source.tokenizer_json, n_vocab=self._vocab_size, eos_token=eos)
            except ValueError:  # a tokenizer larger than the model's vocabulary: its own size
                self._tokenizer = LLTokenizer(source.tokenizer_json, eos_token=eos)
            self._executor = LLExecutor(self._num_threads)
            self._background = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
            self._builders = ThreadPoolExecutor(self._num_threads or mask_threads(1),
                                                thread_name_prefix="grammar-builds")
        return self._tokenizer

    def add(self, row: int, grammar: str, output_token_ids: Sequence[int], after_token_id: int | None = None) -> None:
        """Gives `row` a matcher of `grammar` that has consumed the row's output so far (a resumed row's); with
        `after_token_id`, only the output after that token's first occurrence, and none (the row waits) until
        the output holds it."""
        matcher = self._new_matcher(row, grammar)
        output = [int(t) for t in output_token_ids]
        waiting = False
        if after_token_id is not None:
            waiting = after_token_id not in output
            output = [] if waiting else output[output.index(after_token_id) + 1 :]
        if output and not matcher.consume_tokens(output):
            raise GrammarViolation(f"row {row}: the grammar rejects the resumed output: {matcher.get_error()}")
        self._matchers[row] = matcher
        self._grammars[row] = grammar
        self.constrained[row] = not waiting
        self.waiting[row] = waiting
        self.start_token_id[row] = -1 if after_token_id is None else after_token_id

    def prepare(self, grammars: Sequence[str]) -> None:
        """Builds a start-state matcher for each of `grammars` (the constrained new requests of a plan) that
        no spare covers (`SpareMatchers`: finished rows' matchers, reset at `add`), on threads, for the `add`s
        that follow. A build parses and compiles its grammar, and the threads barely overlap builds, which is
        why spares come first. (A copy of one built matcher would be cheaper still, but the copies share a
        locked cache: their masks then fill one at a time.) Matchers built but not taken become spares at the
        next call. Where finished rows' matchers would spare builds but a background fill still holds them, it
        waits for the fill first."""
        for grammar, matchers in self._prepared.items():
            for matcher in matchers:
                if not matcher.is_error():
                    self._spares.put(grammar, matcher)
        self._prepared.clear()
        self._release_retired()
        needed = Counter(grammars)
        to_build = self._not_spared(needed)
        if len(to_build) >= 2 and any(grammar in needed for grammar, _ in self._retired):
            wait([self._filling])  # the masks in flight (a few ms) hold matchers that save builds
            self._release_retired()
            to_build = self._not_spared(needed)
        if len(to_build) < 2:
            return
        self.tokenizer  # noqa: B018 (built here, not on the builders' threads)
        for grammar, matcher in zip(to_build, self._builders.map(self._build, to_build)):
            self._prepared[grammar].append(matcher)

    def _not_spared(self, needed: Counter) -> list[str]:
        """The grammars of `needed` (grammar -> rows) left to build once each grammar's spares are taken."""
        return [grammar for grammar, count in needed.items() for _ in range(count - self._spares.count(grammar))]

    def _build(self, grammar: str) -> LLMatcher:
        return LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)  # errors: is_error()

    def _new_matcher(self, row: int, grammar: str) -> LLMatcher:
        """A matcher of `grammar` in its start state: a finished row's, reset; else one `prepare` built; else
        built now."""
        self._release_retired()
        matcher = self._spares.take(grammar)
        if matcher is not None:
            matcher.reset()
            return matcher
        prepared = self._prepared.get(grammar)
        matcher = prepared.pop() if prepared else self._build(grammar)
        if matcher.is_error():
            raise ValueError(f"row {row}: the grammar does not compile: {matcher.get_error()}")
        return matcher

    def remove(self, row: int) -> None:
        matcher, grammar = self._matchers[row], self._grammars[row]
        if matcher is not None:  # not asked anything now: a background fill may hold it
            self._retired.append((grammar, matcher))
        self._matchers[row] = None
        self._grammars[row] = None
        self.constrained[row] = False
        self.waiting[row] = False

    def _release_retired(self) -> None:
        """Retired matchers become spares once no background fill can be reading them (llguidance refuses a
        call on a matcher in use on another thread); one in error is dropped."""
        if self._filling is not None and not self._filling.done():
            return
        for grammar, matcher in self._retired:
            if not matcher.is_error():
                self._spares.put(grammar, matcher)
        self._retired.clear()

    def follows_sampled_tokens(self, rows: np.ndarray) -> bool:
        """Whether a row of `rows` needs the token sampled before its own to be masked: a constrained row, or
        one waiting for the token that starts its grammar."""
        return bool(self.constrained[rows].any() or self.waiting[rows].any())

    def bitmask(self, rows: np.ndarray) -> tuple[np.ndarray, torch.Tensor] | None:
        """(indices into `rows` of the constrained ones, their allowed-token bitmask int32 [M, ceil(V / 32)] on
        the host, pinned on a GPU machine), or None when no row in `rows` is constrained. Filled by llguidance's
        thread pool with the GIL released."""
        fill = self._bitmask_fill(rows)
        return None if fill is None else fill()

    def bitmask_in_background(self, rows: np.ndarray) -> Future | None:
        """`bitmask(rows)` filled while the caller goes on (it prepares the next step meanwhile): a Future of
        it, or None when no row in `rows` is constrained. The rows' matchers are taken now, so `add` and
        `remove` may hand the rows to other requests before the Future is done; `advance` must wait for it."""
        fill = self._bitmask_fill(rows)
        if fill is None:
            return None
        if self.constrained[rows].sum() <= self.inline_rows:
            self._filling = Future()
            self._filling.set_result(fill())
        else:
            self._filling = self._background.submit(fill)
        return self._filling

    def _bitmask_fill(self, rows: np.ndarray) -> Callable[[], tuple[np.ndarray, torch.Tensor]] | None:
        """The fill of `bitmask(rows)` with its rows' matchers and buffer taken now, or None (no constraint)."""
        indices = np.flatnonzero(self.constrained[rows])
        if not len(indices):
            return None
        words = -(-self.tokenizer.vocab_size // 32)
        bitmask = torch.empty((len(indices), words), dtype=torch.int32, pin_memory=self._pin_memory)
        matchers = [(self._matchers[row], i) for i, row in enumerate(rows[indices].tolist())]

        def fill() -> tuple[np.ndarray, torch.Tensor]:
            started = time.perf_counter()
            if len(matchers) <= self.inline_rows:
                for matcher, index in matchers:
                    fill_next_token_bitmask(matcher, bitmask.numpy(), index)
            else:
                fill_next_token_bitmask_par(self._executor, matchers, bitmask.numpy())
            self.timing.add("fill", len(matchers), time.perf_counter() - started)
            return indices, bitmask

        return fill

    def advance(self, rows: np.ndarray, token_ids: np.ndarray) -> list[tuple[int, str]]:
        """Each constrained row of `rows` consumes its sampled token; a waiting row that sampled its start token
        is constrained from its next token. A stopped matcher (its grammar complete,
        EOS consumed) takes nothing more: a token sampled after it, in a step planned before the scheduler saw
        the EOS, is one the scheduler drops. Returns the rows whose grammar failed, with a short reason: in
        error (a limit reached while computing a mask, which then allowed EOS only) or rejecting the token;
        they are constrained no more (their requests end; module docstring)."""
        failed: list[tuple[int, str]] = []
        constrained = self.constrained[rows]  # before any row starts: its start token is not the grammar's
        starting = self.waiting[rows] & (token_ids == self.start_token_id[rows])
        if starting.any():
            started = rows[starting]
            self.waiting[started] = False
            self.constrained[started] = True
        advancing = []
        for row, token_id in zip(rows[constrained].tolist(), token_ids[constrained].tolist()):
            matcher = self._matchers[row]
            if not matcher.is_stopped():
                advancing.append((row, token_id))
            elif matcher.is_error():  # e.g. a parser limit reached while computing a mask: it allowed EOS only
                failed.append((row, f"the grammar reached a limit: {short_reason(matcher)}"))
        if advancing:
            failed += self._consume(advancing)
        for row, reason in failed:
            logger.warning("row %d: its grammar failed, its request ends: %s", row, reason)
            self.constrained[row] = False
        return failed

    def _consume(self, advancing: list[tuple[int, int]]) -> list[tuple[int, str]]:
        """Each (row, token) consumed by its row's matcher; the rows whose matcher rejected it, with why."""
        started = time.perf_counter()
        if len(advancing) <= self.inline_rows:
            accepted = [self._matchers[row].consume_token(token) for row, token in advancing]
        else:  # in llguidance's thread pool, the GIL released
            accepted = self._executor.consume_token_par([(self._matchers[row], token) for row, token in advancing])
        self.timing.add("advance", len(advancing), time.perf_counter() - started)
        return [(row, f"the grammar rejected sampled token {token_id}: {short_reason(self._matchers[row])}")
                for (row, token_id), ok in zip(advancing, accepted) if not ok]
