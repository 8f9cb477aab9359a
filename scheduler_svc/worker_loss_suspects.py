"""Which request a worker loss is blamed on, and in which order its suspects are recomputed (poison requests).

Owned by the `Engine` (its loop's thread; pure Python, no lock). A poison request crashes every worker that runs
it, at the same point: at its admission, or when it reaches some output token, again after a recompute replays
it up to there. Unless it is found and failed, it takes every restart and then the whole server with it. Random
losses (a killed process, the chaos run) must not fail the requests that merely lived through them.

- Blame. A loss is blamed on every request scheduled in the steps the worker lost (it may have died computing
  any of them). Each gets a crash point: the furthest output token it may have reached on that worker (tokens
  back, plus those it was to sample in the lost steps). A request that gets a token at or past it on a new
  worker ran beyond anywhere it could have crashed the old one: it is cleared. One blamed again before that
  (a poison request replayed up to its crash point) counts one more loss.
- Conviction. After a loss, the request blamed with the highest count is failed when that count reaches
  `max_losses` and no other request blamed for the loss shares it. Requests that shared every step (a batch
  decoding together, then recomputed together) carry the same evidence: none is failed, they are recomputed
  one at a time (below) and the next loss singles one out. A random loss can land while one of them is
  recomputed alone, though (kills from outside, as in a chaos run on a loaded machine, land there often
  enough to fail requests that crash nothing), so while a restart is left, a request's first loss alone after
  a tie earns it one more try, first and alone.
  A poison request decoding among others is thus failed at its third loss when that used the last restart
  (the default --max-worker-restarts 3), else at its fourth; one that crashes at its admission at its second.
- Order. After a loss the requests not suspected run at once; the suspects wait in waves, each released once
  every request of the waves before it is cleared (or gone): first those with one loss that were running before
  the lost steps, together; then those with one loss that joined the worker in them, together (a crash at
  admission is likelier theirs; recomputed apart from the rest, a repeat is theirs alone); then each request
  with two losses or more, alone. A request is failed for random losses only when one lands while it is
  recomputed up to its crash point a second time with no other suspect sharing the steps (a few steps after a
  restart), or (after a tie) twice in a row while it is recomputed alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from scheduler_svc.core.lost_work import LostWork


@dataclass(frozen=True)
class _Suspicion:
    losses: int  # losses blamed on it since it last got past a crash point
    crash_point: int  # output tokens it may have had when the last lost worker died
    joined: bool  # it joined the worker in the lost steps, unsuspected before
    order: int  # when it was first suspected (the solo waves go in this order)

    def wave(self) -> tuple[int, int, int]:
        if self.losses == 1:
            return (int(self.joined), 0, 0)
        return (2, -self.losses, self.order)


class WorkerLossSuspects:
    def __init__(self, max_losses: int):
        self._max_losses = max_losses
        self._suspects: dict[str, _Suspicion] = {}  # scheduler request id -> its suspicion
        self._released: set[str] = set()  # client requests whose wave came since the last loss
        self._num_suspected = 0

    def __bool__(self) -> bool:
        return bool(self._suspects)

    def losses(self, request_id: str) -> int:
        suspicion = self._suspects.get(request_id)
        return suspicion.losses if suspicion is not None else 0

    def on_worker_loss(self, lost: Iterable[LostWork], restarts_left: int = 0) -> dict[str, int]:
        """Blames a loss on the requests scheduled in its lost steps; `restarts_left`: how many more losses can be
        recovered. Returns the one to fail (request id -> losses blamed on it), if any; it is no longer
        tracked."""
        blamed: dict[str, int] = {}
        self._released = set()  # every request waits again (the scheduler sent them all back to waiting)
        for work in lost:
            previous = self._suspects.get(work.request_id)
            repeat = previous is not None and work.num_output_tokens < previous.crash_point
            if previous is None:
                self._num_suspected += 1
            self._suspects[work.request_id] = _Suspicion(
                losses=previous.losses + 1 if repeat else 1,
                crash_point=work.num_output_tokens + max(1, work.num_lost_samples),
                joined=work.joined and previous is None,
                order=previous.order if previous is not None else self._num_suspected,
            )
            blamed[work.request_id] = self._suspects[work.request_id].losses
        if not blamed:
            return {}
        most = max(blamed.values())
        culprits = [request_id for request_id, losses in blamed.items() if losses == most]
        if most < self._max_losses or len(culprits) > 1:
            return {}
        if most == self._max_losses + 1 and restarts_left:
            return {}  # its first loss alone after a tie: once more alone while a restart is left (docstring)
        del self._suspects[culprits[0]]
        return {culprits[0]: most}

    def on_token(self, request_id: str, num_output_tokens: int) -> bool:
        """A request got a token on the current worker; True when that clears it (past its crash point)."""
        suspicion = self._suspects.get(request_id)
        if suspicion is None or num_output_tokens < suspicion.crash_point:
            return False
        del self._suspects[request_id]
        return True

    def drop_gone(self, is_gone: Callable[[str], bool]) -> bool:
        """Stops tracking requests that ended (finished, aborted, released). True when any did."""
        gone = [request_id for request_id in self._suspects if is_gone(request_id)]
        for request_id in gone:
            del self._suspects[request_id]
        return bool(gone)

    def held(self, group_of: Callable[[str], str] = lambda request_id: request_id) -> set[str]:
        """The suspects to keep out of the steps for now: all but the wave released last, and the next wave goes
        only once every request of that one is cleared or gone (module docstring). A client
        request's members (`group_of`: member id -> client request id) wait and go together, in the wave of its
        earliest member: a beam search's rows wait for one another, so one row held while its siblings are
        released would hold them all forever. Once released, a client request stays so until the next loss
        (its members may be running: the scheduler holds only waiting requests)."""
        if not self._suspects:
            return set()
        if not any(group_of(request_id) in self._released for request_id in self._suspects):
            waves: dict[str, tuple[int, int, int]] = {}
            for request_id, suspicion in self._suspects.items():
                group = group_of(request_id)
                waves[group] = min(waves.get(group, suspicion.wave()), suspicion.wave())
            first = min(waves.values())
            self._released.update(group for group, wave in waves.items() if wave == first)
        return {request_id for request_id in self._suspects if group_of(request_id) not in self._released}
