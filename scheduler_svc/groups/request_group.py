"""What serves one client request: one scheduler request, or several (parallel sampling, beam search).

Ownership: the engine loop owns every group; a group owns the scheduler request ids it created (its members)
and the asyncio queue its gRPC stream reads. The scheduler knows nothing of groups: it sees independent
requests that happen to share blocks (through `fork_request`). A group hears about each step's outcome for
its members and decides what the client sees.

- `SingleSequence` (n == 1, no beams): streams its one request's deltas.
- `ParallelSampling` (n > 1 or best_of > 1): a prefill-only root computes all prompt tokens but the last; the
  group then forks best_of children that share the root's blocks (copy-on-write for the partial last block),
  each computing the last prompt token and sampling with its own seed. Streams when best_of == n; otherwise
  the n children with the highest cumulative logprob are sent when all have finished.
- `BeamSearch` lives in beam_search.py; `PromptOnly` (max_tokens 0) in prompt_only.py.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass

from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.step_outcome import StepOutcome
from scheduler_svc.core.token_logprobs import PromptLogprobChunk, PromptLogprobs, TokenLogprob
from scheduler_svc.core.validated_request import ResumedOutput
from scheduler_svc.groups.stream_pacing import PacedQueue
from scheduler_svc.text.output_stream import OutputDelta, OutputStream
from scheduler_svc.text.tokenizer import Tokenizer

_SEED_STRIDE = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class StreamEnd:
    """The last item on a group's queue: every sequence has sent its final message."""


@dataclass
class GroupContext:
    """What a group may touch: the scheduler, the tokenizer, and the engine's member -> group index."""

    scheduler: Scheduler
    tokenizer: Tokenizer | None
    owners: dict[str, RequestGroup]


class RequestGroup(ABC):
    def __init__(self, request_id: str, root: Request, context: GroupContext):
        self.request_id = request_id
        self.root = root
        self.queue = PacedQueue()  # the engine flushes it (stream_pacing.py)
        self.context = context
        self.members: set[str] = set()
        self.finished = False
        # sampling.prompt_logprobs: the root's (a fan-out root computes the prompt; children only its last
        # token), sent on each sequence's first message.
        self._prompt_logprobs = PromptLogprobs()

    @abstractmethod
    def start(self) -> None:
        """Adds the group's first request(s) to the scheduler."""

    @abstractmethod
    def on_step(self, request: Request, outcome: StepOutcome) -> None:
        """A member computed tokens this step (it may have finished)."""

    def publish(self) -> Request | None:
        """Streams what `on_step` held back, if anything (only `SingleSequence` holds any): the tokens of the
        steps `on_step` heard of, never those of a result applied but not yet heard of (the engine calls
        `on_step` for them first, or they are not to be streamed: a failed request's last). The engine calls it
        when it flushes the group's queue, and before it ends the group with an error. Returns the member that
        published (it may have finished)."""
        return None

    def on_prompt_logprobs(self, member_id: str, chunk: PromptLogprobChunk) -> None:
        """A member computed prompt tokens this step (maybe a chunk that does not reach its end)."""
        if member_id == self.root.request_id:
            self._prompt_logprobs.add(chunk)

    def abort(self, notify: bool) -> FinishReason:
        """Aborts every member; with notify, the stream gets an ABORT message per unfinished sequence, after
        the tokens computed before the abort (the engine lets the group hear of an applied result first).
        Returns how the group ended: ABORT, or STOP when what it held back ended it first (a stop string)."""
        if notify:
            request = self.publish()
            if self.finished:  # what it held back ended it (a stop string): nothing is left to abort
                return request.finish_reason or FinishReason.STOP
        for member in list(self.members):
            self.context.scheduler.abort_request(member)
            self._drop(member)
        if notify:
            for index in self._unfinished_indices():
                self.queue.put_nowait(dataclasses.replace(_ABORTED, index=index))
        self._end()
        return FinishReason.ABORT

    def _unfinished_indices(self) -> list[int]:
        return [0]

    def _add(self, request: Request, parent_id: str | None = None, num_shared_tokens: int = 0) -> None:
        self.members.add(request.request_id)
        self.context.owners[request.request_id] = self
        if parent_id is None:
            self.context.scheduler.add_request(request)
        else:
            self.context.scheduler.fork_request(parent_id, request, num_shared_tokens)

    def _drop(self, member: str) -> None:
        self.members.discard(member)
        self.context.owners.pop(member, None)

    def _release(self, member: str) -> None:
        """Frees a member the client never sees the end of (a fan-out root, a dropped beam)."""
        self.context.scheduler.release_request(member)
        self._drop(member)

    def _end(self) -> None:
        if not self.finished:
            self.finished = True
            self.queue.put_nowait(StreamEnd())


_ABORTED = OutputDelta(text="", token_ids=(), finish_reason=FinishReason.ABORT)


class SingleSequence(RequestGroup):
    """Publishes lazily under load: a step's tokens are only noted (`on_step`), and detokenized, checked for
    stop strings and queued when the engine flushes this stream's queue (`publish`), which stream pacing
    (stream_pacing.py) does every k-th step with hundreds of streams: the client sees the same messages at the
    same moments, and the engine's loop does the per-stream work once per flush instead of once per step
    (at 256 streams the per-step publishing was the largest part of the scheduler's host time). The first
    token and the last are published at once. The cost: a stop string is found up to k - 1 steps later, so
    its request computes up to k - 1 tokens more, which are dropped (`_drop_after_stop`)."""

    def __init__(self, request_id: str, root: Request, context: GroupContext, resume: ResumedOutput | None = None):
        super().__init__(request_id, root, context)
        self._resume = resume  # a stream resumed after a scheduler loss: root starts with its received output
        self._unpublished: Request | None = None  # the root, while it has tokens `publish` has not streamed
        # Per step noted but not published: its outcome and how many tokens the root appended in it.
        self._noted: list[tuple[StepOutcome, int]] = []
        self._num_noted = 0  # output tokens noted (or published)

    def start(self) -> None:
        self._stream = OutputStream(self.root, self.context.tokenizer)
        self._cumulative_logprob = 0.0
        self._sent_first = False
        if self._resume is not None:  # the client has the first message (prompt logprobs) and this text
            self._stream.skip_sent(self.root, self._resume.num_sent_chars)
            self._cumulative_logprob = self._resume.cumulative_logprob
            self._sent_first = True
        self._num_noted = len(self.root.output_token_ids)
        self._add(self.root)

    def on_step(self, request: Request, outcome: StepOutcome) -> None:
        num_new = len(request.output_token_ids) - self._num_noted
        self._num_noted += num_new
        if num_new:
            self._noted.append((outcome, num_new))
        self._unpublished = request
        if not self._sent_first or request.finish_reason is not None:
            self.publish()

    def publish(self) -> Request | None:
        request, self._unpublished = self._unpublished, None
        if request is None or self.finished:
            return None
        delta, stopped_by_string = self._stream.advance(request, self._num_noted)
        if stopped_by_string:
            _drop_after_stop(request, self.context.scheduler, self._stream.num_sent_tokens)
        logprobs, ranked = _noted_logprobs(request.request_id, self._noted, len(delta.token_ids))
        self._noted.clear()
        for logprob in logprobs:  # one by one, as without speculative decoding
            self._cumulative_logprob += logprob
        delta.logprobs = tuple(logprobs)
        delta.token_logprobs = tuple(ranked)
        if delta.token_ids and not self._sent_first:
            self._sent_first = True
            delta.prompt_logprobs = self._prompt_logprobs.tokens
        if delta.finish_reason is not None:
            delta.cumulative_logprob = self._cumulative_logprob
        if delta.text or delta.token_ids or delta.finish_reason is not None:
            self.queue.put_nowait(delta)
        if delta.finish_reason is not None:
            self._drop(request.request_id)
            self._end()
        return request


class ParallelSampling(RequestGroup):
    def start(self) -> None:
        params = self.root.sampling_params
        self._n, self._best_of = params.n, params.num_sequences
        self._children: list[Request] = []
        self._streams: dict[str, OutputStream] = {}
        self._index: dict[str, int] = {}
        self._logprob: dict[str, float] = {}
        self._token_logprobs: dict[str, list[float]] = {}  # best_of > n: sent with each child's whole output
        self._finals: dict[str, OutputDelta] = {}  # best_of > n: each child's whole output, sent at the end
        self._token_ranks: dict[str, list[TokenLogprob]] = {}  # best_of > n, with sampling.logprobs
        self._sent_first: set[str] = set()
        if self.root.num_prompt_tokens == 1:
            self._fork_children(parent_id=None)
        else:
            self.root.prefill_only = True
            self._add(self.root)

    def _unfinished_indices(self) -> list[int]:
        if self._best_of > self._n:
            return list(range(self._n))
        return [self._index[c.request_id] for c in self._children if c.request_id not in self._finals]

    def on_step(self, request: Request, outcome: StepOutcome) -> None:
        if request.request_id == self.request_id and request.prefill_only:
            self._fork_children(parent_id=request.request_id)
            self._release(request.request_id)
            return
        child_id = request.request_id
        delta = _advance(self._streams[child_id], request, self.context.scheduler, outcome)
        for logprob in delta.logprobs:
            self._logprob[child_id] += logprob
        self._token_logprobs[child_id].extend(delta.logprobs)
        self._token_ranks[child_id].extend(delta.token_logprobs)
        if delta.token_ids and child_id not in self._sent_first:
            self._sent_first.add(child_id)
            delta = dataclasses.replace(delta, prompt_logprobs=self._prompt_logprobs.tokens)
        streaming = self._best_of == self._n
        if delta.finish_reason is not None:
            self._drop(child_id)
            self._finals[child_id] = delta
        if streaming and (delta.text or delta.token_ids or delta.finish_reason is not None):
            self.queue.put_nowait(dataclasses.replace(delta, index=self._index[child_id],
                                                      cumulative_logprob=self._logprob[child_id]))
        if len(self._finals) == self._best_of:
            if not streaming:
                self._send_best()
            self._end()

    def _fork_children(self, parent_id: str | None) -> None:
        base_seed = self.root.sampling_params.seed
        for i in range(self._best_of):
            seed = (base_seed + (i + 1) * _SEED_STRIDE) & _SEED_MASK
            child = Request(
                request_id=f"{self.request_id}#{i}",
                prompt_token_ids=list(self.root.prompt_token_ids),
                sampling_params=dataclasses.replace(self.root.sampling_params, seed=seed),
                eos_token_ids=self.root.eos_token_ids,
                priority=self.root.priority,
                lora_name=self.root.lora_name,
                lora_path=self.root.lora_path,
                lora_generation=self.root.lora_generation,
            )
            self._children.append(child)
            self._streams[child.request_id] = OutputStream(child, self.context.tokenizer)
            self._index[child.request_id] = i
            self._logprob[child.request_id] = 0.0
            self._token_logprobs[child.request_id] = []
            self._token_ranks[child.request_id] = []
            self._add(child, parent_id, num_shared_tokens=self.root.num_prompt_tokens - 1 if parent_id else 0)

    def _send_best(self) -> None:
        ranked = sorted(self._children, key=lambda c: self._logprob[c.request_id], reverse=True)[: self._n]
        for index, child in enumerate(ranked):
            final = self._finals[child.request_id]
            self.queue.put_nowait(OutputDelta(
                text=self._streams[child.request_id].text,
                token_ids=tuple(child.output_token_ids),
                finish_reason=final.finish_reason,
                prompt_tokens=final.prompt_tokens,
                completion_tokens=final.completion_tokens,
                index=index,
                cumulative_logprob=self._logprob[child.request_id],
                logprobs=_whole_logprobs(self._token_logprobs[child.request_id], child),
                token_logprobs=_whole_logprobs(self._token_ranks[child.request_id], child),
                prompt_logprobs=self._prompt_logprobs.tokens,
            ))


def _advance(stream: OutputStream, request: Request, scheduler: Scheduler, outcome: StepOutcome) -> OutputDelta:
    delta, stopped_by_string = stream.advance(request)
    if stopped_by_string:  # no-op when the same token already ended it by length: STOP wins here
        scheduler.finish_request(request.request_id, FinishReason.STOP)
    # A step samples one token per sequence, after the drafts it kept (speculative decoding), of which the
    # request took the first len(token_ids) (a stop token ends it there).
    logprob = outcome.logprobs.get(request.request_id)
    if delta.token_ids and logprob is not None:
        drafts = outcome.accepted_draft_logprobs.get(request.request_id)
        step_logprobs = (logprob,) if drafts is None else (*drafts, logprob)
        if len(delta.token_ids) <= len(step_logprobs):
            delta.logprobs = step_logprobs[: len(delta.token_ids)]
    if len(delta.token_ids) == 1:  # rows returning logprobs (rank and alternatives) have no drafts
        ranked = outcome.token_logprobs.get(request.request_id)
        if ranked is not None:
            delta.token_logprobs = (ranked,)
    return delta


def _noted_logprobs(request_id: str, noted: list[tuple[StepOutcome, int]], num_tokens: int) -> tuple[list, list]:
    """The logprobs and ranked logprobs of a request's first `num_tokens` noted tokens, from the outcomes of
    the steps that appended them (`noted`: outcome, tokens appended), as `_advance` attaches one step's; a
    token whose step has none is left out."""
    logprobs, ranked = [], []
    for outcome, num_new in noted:
        if num_tokens <= 0:
            break
        num_taken = min(num_new, num_tokens)
        num_tokens -= num_taken
        logprob = outcome.logprobs.get(request_id)
        if logprob is not None:
            drafts = outcome.accepted_draft_logprobs.get(request_id)
            step_logprobs = (logprob,) if drafts is None else (*drafts, logprob)
            if num_new <= len(step_logprobs):
                logprobs.extend(step_logprobs[:num_taken])
        if num_new == 1:  # rows returning logprobs (rank and alternatives) have no drafts
            token_logprob = outcome.token_logprobs.get(request_id)
            if token_logprob is not None:
                ranked.append(token_logprob)
    return logprobs, ranked


def _drop_after_stop(request: Request, scheduler: Scheduler, num_output_tokens: int) -> None:
    """A stop string ended `request` at its first `num_output_tokens` outputs: it finishes (STOP wins over a
    length or stop token that ended it later), and the tokens it computed after them are no output."""
    if not scheduler.finish_request(request.request_id, FinishReason.STOP):
        # The scheduler ended it already, at a later token (a stream published late: max_tokens, or a stop
        # token): the client is told STOP, and the engine's metrics read the reason here.
        request.status = RequestStatus.finished_by(FinishReason.STOP)
        request.finish_reason = FinishReason.STOP
    del request.output_token_ids[num_output_tokens:]


def _whole_logprobs(token_logprobs: list, request: Request) -> tuple:
    """Per-token logprobs of a whole output, or none if any token's is unknown (they would not line up)."""
    return tuple(token_logprobs) if len(token_logprobs) == request.num_output_tokens else ()
