"""The persistent batch's per-row entry pools (`RowEntries`): through any sequence of sets and clears, which
fills, compacts and grows a tiny pool many times, `take` returns each asked row's entries (or their first
`lengths[i]`), row after row, exactly as a dict of per-row lists holds them."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_svc.row_entries import RowEntries

NUM_ROWS = 6

_entries = st.lists(st.tuples(st.integers(0, 1000), st.integers(-100, 100)), max_size=5)
_operation = st.tuples(st.integers(0, NUM_ROWS - 1), st.none() | _entries)  # None: clear the row


def _expected(reference: dict[int, list], rows, lengths) -> tuple[list[int], list[float]]:
    entries = [entry for row, length in zip(rows, lengths) for entry in reference.get(row, [])[:length]]
    return [token_id for token_id, _ in entries], [float(value) for _, value in entries]


@settings(max_examples=200, deadline=None)
@given(st.lists(_operation, max_size=40), st.lists(st.integers(0, NUM_ROWS - 1), max_size=8), st.randoms())
def test_take_returns_the_rows_entries_in_order_through_sets_clears_and_compactions(operations, rows, random):
    pool = RowEntries(NUM_ROWS, capacity=2)
    reference: dict[int, list] = {}
    for row, entries in operations:
        if entries is None:
            pool.clear(row)
            reference.pop(row, None)
        else:
            pool.set(row, [token_id for token_id, _ in entries], [value for _, value in entries])
            reference[row] = entries
    rows = np.asarray(rows, dtype=np.int64)
    ids, values = pool.take(rows)
    full = [len(reference.get(row, [])) for row in rows.tolist()]
    assert (ids.tolist(), values.tolist()) == _expected(reference, rows.tolist(), full)
    assert pool.length[rows].tolist() == full
    prefixes = [random.randint(0, length) for length in full]
    ids, values = pool.take(rows, np.asarray(prefixes, dtype=np.int64))
    assert (ids.tolist(), values.tolist()) == _expected(reference, rows.tolist(), prefixes)


def test_one_value_is_given_to_every_id_of_the_row():
    pool = RowEntries(2, capacity=1)
    pool.set(1, [4, 9, 2], -np.inf)
    ids, values = pool.take(np.asarray([1, 0]))
    assert ids.tolist() == [4, 9, 2] and values.tolist() == [-np.inf] * 3
