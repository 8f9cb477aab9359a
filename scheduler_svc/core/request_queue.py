"""The order every scheduler queue keeps: (priority, arrival_seq, fork_seq), lower first.

Who owns it: the `Scheduler`, which keeps its waiting, running and swapped requests in three of these. The
order is total and fixed for a request's life (the three numbers never change once it is queued), so it is
the one ranking used everywhere: who is scheduled first, who is admitted or swapped in first, and who is
preempted (the last of the running queue). A preempted request goes back to its place, not to the back.

Why (priority, arrival_seq, fork_seq): priority first (lower value first), then FCFS; a forked child inherits
its parent's priority and arrival_seq and takes a fresh fork_seq, so it sorts after its parent and before any
request that arrived later: the n sequences of one client request keep that request's place in line.

Why a sorted list and not a heap: the scheduler walks the running queue in order every step, removes from the
middle (aborts, admissions that skip a request) and pops from both ends; with at most a few thousand
requests, bisect plus a list's memmove is cheaper than keeping a heap and its lazy deletions.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from scheduler_svc.core.request import Request


def scheduling_key(request: Request) -> tuple[int, int, int]:
    return request.priority, request.arrival_seq, request.fork_seq


class RequestQueue:
    def __init__(self) -> None:
        self._requests: list[Request] = []

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]

    def add(self, request: Request) -> None:
        bisect.insort(self._requests, request, key=scheduling_key)

    def index(self, request: Request) -> int:
        index = bisect.bisect_left(self._requests, scheduling_key(request), key=scheduling_key)
        if index == len(self._requests) or self._requests[index] is not request:
            raise ValueError(f"request {request.request_id} is not in this queue")
        return index

    def remove(self, request: Request) -> None:
        del self._requests[self.index(request)]

    def pop(self, index: int) -> Request:
        return self._requests.pop(index)

