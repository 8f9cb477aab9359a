"""How a client rides out the loss of its scheduler: a stream in flight resumes where it stopped, and a new
call waits for the restarted scheduler instead of failing.

Why the client: when the scheduler process dies (a crash, SIGKILL, an OOM kill), its supervisor (`pagedserve
serve`, or compose's restart policy) starts a new one with fresh workers, but every request in flight lived
in the dead process. The one party that still knows each stream is the client holding it: the SDK here, and
through it the HTTP gateway. `StreamProgress` records what a stream delivered (its request id, its seed from
the first message, the token ids, the characters of text and the logprob sum of sequence 0) and turns the
original request into a resumed one (GenerateRequest.resume). The new scheduler recomputes prompt + output
and sends only what follows, so the caller sees one unbroken stream: greedy and seeded output continue
token-exact, with no token sent twice and none missing (the seed travels in sampling.seed; seeded draws are
keyed by output position, and the output keeps its positions because it travels as output, not prompt).

When a client waits: after an UNAVAILABLE from a scheduler it had reached before (a stream message, an
accepted stream or any answer on this client). It then polls health until SERVING, for at most
`resume_timeout` seconds per loss (and within the call's own timeout), and goes on. A scheduler that ends work on purpose is not waited for: one shutting down, or one that stopped after losing its
workers for good (`the engine stopped: ...`; it exits 1, which `pagedserve serve` does not restart). A
client that never reached a server keeps the plain retry policy (client/retry.py), so a wrong address still
fails fast. A stream of several sequences (n > 1, best_of, beam search) that had delivered anything cannot
resume (the client does not hold every sequence's state): it ends with ServerUnavailableError saying so. So
does a stream that lost its scheduler twice in a row with no message in between: the scheduler has no
poison-request rule of its own (the workers' is in scheduler_svc/worker_loss_suspects.py), and a request that
crashes it would otherwise be re-sent after each restart until the restarts ran out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from client.errors import PagedServeError, ServerUnavailableError
from protos.pagedserve.v1 import generate_pb2

# Losses of the scheduler in a row, with no message of the stream in between, after which it is not re-sent.
MAX_LOSSES_WITHOUT_PROGRESS = 2

# What a live scheduler says when it ends work on purpose (scheduler_svc/service.py: its drain, and its stop
# after losing its workers for good, which its supervisor does not undo): not a loss to wait out.
_DELIBERATE_ENDS = ("the server is shutting down", "the engine stopped")


@dataclass(frozen=True)
class ResumePolicy:
    """`resume_timeout`: seconds to wait for a lost scheduler to serve again, per loss; 0 turns resuming off."""

    resume_timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.resume_timeout < 0:
            raise ValueError(f"resume_timeout must be >= 0, got {self.resume_timeout}")

    def wait_deadline(self, error: PagedServeError, server_reached: bool, call_deadline: float | None) -> float | None:
        """The monotonic time until which to wait for the scheduler after `error`, or None: do not wait."""
        if (self.resume_timeout == 0 or not server_reached or not isinstance(error, ServerUnavailableError)
                or any(end in error.details for end in _DELIBERATE_ENDS)):
            return None
        deadline = time.monotonic() + self.resume_timeout
        return deadline if call_deadline is None else min(deadline, call_deadline)

    def lost_error(self, error: PagedServeError) -> ServerUnavailableError:
        """The error when the scheduler did not serve again in time."""
        return ServerUnavailableError(error.code, f"{error.details} (the scheduler did not serve again within "
                                                  f"resume_timeout, {self.resume_timeout:g} s, or the call's timeout)")


class StreamProgress:
    """What one Generate stream delivered so far, and the request that goes on from there."""

    def __init__(self, request: generate_pb2.GenerateRequest) -> None:
        self._request = request
        self._request_id = request.request_id
        self._seed: int | None = None
        self._token_ids: list[int] = []
        self._num_chars = 0
        self._cumulative_logprob = 0.0
        self.num_messages = 0
        self.finished = False  # sequence 0's last message arrived (n == 1: the stream is complete)
        self._messages_at_last_loss = -1
        self._losses_without_progress = 0

    def saw(self, response: generate_pb2.GenerateResponse) -> None:
        self.num_messages += 1
        self._request_id = self._request_id or response.request_id
        if response.HasField("seed"):
            self._seed = response.seed
        if response.index == 0:
            self._token_ids.extend(response.token_ids)
            self._num_chars += len(response.text)
            self._cumulative_logprob += sum(response.logprobs)
            self.finished = response.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED

    @property
    def complete(self) -> bool:
        """Nothing is left to resume: a single sequence that already got its last message."""
        return self.finished and not _several_sequences(self._request.sampling)

    def check_resumable(self, error: PagedServeError) -> None:
        """Called at each loss of the scheduler; raises ServerUnavailableError if the stream cannot go on: several
        sequences (n > 1, best_of or beam search) of which something was delivered, or a second loss in a row
        with no message in between (the request may be what crashes the scheduler: re-sending it again would
        take every other stream down with it each time)."""
        if self.num_messages and _several_sequences(self._request.sampling):
            raise ServerUnavailableError(grpc.StatusCode.UNAVAILABLE, f"{error.details} (the scheduler was lost "
                                         "mid-stream, and a stream of several sequences cannot resume)")
        progressed = self.num_messages != self._messages_at_last_loss
        self._losses_without_progress = 1 if progressed else self._losses_without_progress + 1
        self._messages_at_last_loss = self.num_messages
        if self._losses_without_progress >= MAX_LOSSES_WITHOUT_PROGRESS:
            raise ServerUnavailableError(grpc.StatusCode.UNAVAILABLE, f"{error.details} (the scheduler was lost "
                                         f"{self._losses_without_progress} times in a row with no message of this "
                                         "stream in between; it is not re-sent again, since it may be what crashes it)")

    def next_request(self) -> generate_pb2.GenerateRequest:
        """The request to send now: the original before any message arrived, else the resumed one."""
        if self.num_messages == 0:
            return self._request
        resumed = generate_pb2.GenerateRequest()
        resumed.CopyFrom(self._request)
        resumed.request_id = self._request_id
        if self._seed is not None:
            resumed.sampling.seed = self._seed
        resumed.resume.token_ids.extend(self._token_ids)
        resumed.resume.num_sent_chars = self._num_chars
        resumed.resume.cumulative_logprob = self._cumulative_logprob
        return resumed


def _several_sequences(sampling: generate_pb2.SamplingParams) -> bool:
    return sampling.n > 1 or sampling.best_of > 1 or sampling.beam_width > 1

