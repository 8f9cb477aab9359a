"""An append-only log of every StepPlan the scheduler sent, for replaying a worker bug and for tests.

A worker's state is a pure function of the plans it received (DESIGN.md), so this file is enough to rebuild
it step by step. Format: each record is a 4-byte little-endian length, then one serialized StepPlan.
Written by the engine loop only (`--plan-log PATH`); flushed per record so a crash keeps what was sent.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

from protos.pagedserve.v1 import worker_pb2

_LENGTH = struct.Struct("<I")


class PlanLogWriter:
    def __init__(self, path: str | Path):
        self._file = open(path, "ab")

    def write(self, plan: worker_pb2.StepPlan) -> None:
        payload = plan.SerializeToString()
        self._file.write(_LENGTH.pack(len(payload)) + payload)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_plan_log(path: str | Path) -> Iterator[worker_pb2.StepPlan]:
    data = Path(path).read_bytes()
    offset = 0
    while offset + _LENGTH.size <= len(data):
        (length,) = _LENGTH.unpack_from(data, offset)
        offset += _LENGTH.size
        if offset + length > len(data):
            return  # a record cut short by a crash
        plan = worker_pb2.StepPlan()
        plan.ParseFromString(data[offset : offset + length])
        offset += length
        yield plan
