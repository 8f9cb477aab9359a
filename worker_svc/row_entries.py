"""Variable-length per-row entries (a token id and a float32 value each), kept in one flat pool per kind.

Why a pool: each step gathers the entries of up to hundreds of rows (their logit_bias, their min_tokens
masks). With one small array per row that is a Python loop over the rows, milliseconds of host time a step at
a few hundred rows, where the pools take a few hundredths of that (docs/benchmarks.md, "Kernel tuning"). Here
a row's entries are one contiguous run of
the pool (`start`, `length` per row), so the entries of any set of rows are gathered with a few whole-array
operations (`take`).

Setting a row writes its run at the pool's end and leaves its old run dead. When the end is reached the live
runs are copied to the front (whole-array too), into a pool grown to twice the live entries (the new run
included) when they would fill more than half of it, so compaction stays rare. Owned by `PersistentBatch`;
host numpy only.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


class RowEntries:
    def __init__(self, max_rows: int, capacity: int = 1024):
        self.start = np.zeros(max_rows, dtype=np.int64)
        self.length = np.zeros(max_rows, dtype=np.int64)
        self._ids = np.zeros(capacity, dtype=np.int64)
        self._values = np.zeros(capacity, dtype=np.float32)
        self._end = 0  # pool entries written (live or dead)
        self._num_live = 0

    def set(self, row: int, ids: npt.ArrayLike, values: npt.ArrayLike) -> None:
        """Replaces the row's entries with `ids` and their `values` (one value: the same for every id)."""
        self.clear(row)
        count = len(ids)
        if not count:
            return
        if self._end + count > len(self._ids):
            self._compact(count)
        self._ids[self._end : self._end + count] = ids
        self._values[self._end : self._end + count] = values
        self.start[row], self.length[row] = self._end, count
        self._end += count
        self._num_live += count

    def clear(self, row: int) -> None:
        self._num_live -= int(self.length[row])
        self.length[row] = 0

    def take(self, rows: np.ndarray, lengths: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The ids and values of `rows`' entries, row after row: each row's first `lengths[i]` entries
        (default: all of them)."""
        index = _runs(self.start[rows], self.length[rows] if lengths is None else lengths)
        return self._ids[index], self._values[index]

    def _compact(self, room: int) -> None:
        """Moves the live runs to the pool's front, leaving at least `room` entries free after them."""
        live = np.flatnonzero(self.length)
        index = _runs(self.start[live], self.length[live])
        capacity = max(len(self._ids), 2 * (self._num_live + room))
        ids, values = np.zeros(capacity, dtype=np.int64), np.zeros(capacity, dtype=np.float32)
        ids[: len(index)], values[: len(index)] = self._ids[index], self._values[index]
        self._ids, self._values = ids, values
        self.start[live] = np.cumsum(self.length[live]) - self.length[live]
        self._end = len(index)


def _runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices of the runs [starts[i], starts[i] + lengths[i]), one after another."""
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)
