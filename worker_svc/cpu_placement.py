"""Where a CPU worker's compute threads run, and where the scheduler and gateway stay: cores chosen once, from
the cores this process may use, by one pure function that the launcher and each worker rank both call.

Why: on a small machine (a 2-core VM, a laptop) torch's default of one intra-op thread per core puts the
worker's threads on every core, where the scheduler, the gateway and whatever else runs on the host preempt
them; a forward pass then waits for its slowest thread at every op, and steps stretch 10-30x when another
process takes a core. vLLM's CPU backend pins one thread per core it owns and leaves a core to its front end;
we do the same, with its knobs' meanings:

- `--cpu-omp-threads-bind` ($VLLM_CPU_OMP_THREADS_BIND): `auto` (the default): the allowed cores less the
  reserved ones, split evenly between the tensor-parallel ranks, one torch thread pinned per core;
  a core list such as `0-3` (ranks separated by `|`: `0-3|4-7`): exactly those cores per rank; `nobind`:
  no pinning, but still no more threads than the cores left after the reserved ones (one thread per rank when
  there are more ranks than cores: they share the cores, as the tests' -tp 3 on two cores does).
  An $OMP_NUM_THREADS below a rank's core count lowers its thread count further (never raises it).
- `--cpu-num-reserved-cpu` ($VLLM_CPU_NUM_OF_RESERVED_CPU): with `auto`, how many of the allowed cores no
  rank computes on (the scheduler and gateway run there); default 1 when the machine has a core to spare
  beyond one per rank, else 0.

The cores no rank computes on (`service_cpus`) are where `pagedserve serve` pins the scheduler and gateway;
None when every core computes (then they share). Never oversubscribed: the ranks' thread counts sum to at most
the allowed cores. The plan is a function of the allowed set alone, so each rank (a child of the launcher,
with the launcher's allowed set) finds the same plan the launcher pinned the other services by.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

AUTO = "auto"
NOBIND = "nobind"


@dataclass(frozen=True)
class CpuPlacement:
    """Each rank's compute cores (`rank_cpus[r]`, pinned; None with nobind: unpinned) and thread count
    (`rank_threads[r]`), and the cores left for the scheduler and gateway (None: no core is left to them
    alone, so they are not pinned)."""

    rank_cpus: tuple[tuple[int, ...], ...] | None
    rank_threads: tuple[int, ...]
    service_cpus: tuple[int, ...] | None


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """"0-3,6" -> (0, 1, 2, 3, 6): the kernel's cpu-list syntax (taskset, cpuset, vLLM's bind lists)."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty entry in the CPU list {text!r}")
        low, dash, high = part.partition("-")
        if not (low.isdigit() and (not dash or high.isdigit())):
            raise ValueError(f"{part!r} in {text!r} is not a CPU id or a range like 0-3")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"{part!r} in {text!r}: a range runs from low to high")
        cpus.extend(range(first, last + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"the CPU list {text!r} names a CPU twice")
    return tuple(cpus)


def bind_value(text: str) -> str:
    """--cpu-omp-threads-bind's value, checked: auto, nobind, or rank core lists separated by '|'."""
    if text not in (AUTO, NOBIND):
        for rank_list in text.split("|"):
            parse_cpu_list(rank_list)
    return text


def plan_cpu_placement(allowed: Sequence[int], bind: str, num_reserved: int | None, world_size: int) -> CpuPlacement:
    """The placement of `world_size` ranks on the `allowed` cores (module docstring). Raises ValueError when
    the flags cannot be met (a rank without a core, a listed core outside the allowed ones)."""
    allowed = tuple(sorted(set(allowed)))
    if bind not in (AUTO, NOBIND):
        return _listed_placement(allowed, bind, world_size)
    if num_reserved is None:
        num_reserved = 1 if len(allowed) > world_size else 0
    if bind == NOBIND and num_reserved >= 0:  # nothing pinned: more ranks than cores share them, one thread each
        return CpuPlacement(None, (max(1, (len(allowed) - num_reserved) // world_size),) * world_size, None)
    if num_reserved < 0 or len(allowed) - num_reserved < world_size:
        raise ValueError(f"{num_reserved} reserved CPUs of the {len(allowed)} allowed leave fewer than one per rank "
                         f"({world_size} ranks)")
    reserved, compute = allowed[:num_reserved], allowed[num_reserved:]
    per_rank = len(compute) // world_size
    # Left-over cores (compute not divisible by the ranks) stay unused by the ranks: the services get them.
    rank_cpus = tuple(compute[rank * per_rank:(rank + 1) * per_rank] for rank in range(world_size))
    service = reserved + compute[world_size * per_rank:]
    return CpuPlacement(rank_cpus, (per_rank,) * world_size, service or None)


def _listed_placement(allowed: tuple[int, ...], bind: str, world_size: int) -> CpuPlacement:
    rank_cpus = tuple(parse_cpu_list(rank_list) for rank_list in bind.split("|"))
    if len(rank_cpus) != world_size:
        raise ValueError(f"--cpu-omp-threads-bind {bind!r} lists {len(rank_cpus)} ranks' CPUs for {world_size} ranks")
    used = [cpu for cpus in rank_cpus for cpu in cpus]
    if len(set(used)) != len(used):
        raise ValueError(f"--cpu-omp-threads-bind {bind!r} gives a CPU to two ranks")
    outside = sorted(set(used) - set(allowed))
    if outside:
        raise ValueError(f"--cpu-omp-threads-bind {bind!r}: CPUs {outside} are not among this process's allowed "
                         f"CPUs {list(allowed)}")
    service = tuple(cpu for cpu in allowed if cpu not in set(used))
    return CpuPlacement(rank_cpus, tuple(len(cpus) for cpus in rank_cpus), service or None)


def current_placement(bind: str, num_reserved: int | None, world_size: int) -> CpuPlacement:
    """The plan for this process's allowed cores."""
    return plan_cpu_placement(sorted(os.sched_getaffinity(0)), bind, num_reserved, world_size)


def place_worker(bind: str, num_reserved: int | None, rank: int, world_size: int) -> None:
    """Pins this worker process to its rank's cores and sizes torch's thread pools to them. Call it first
    thing in the process, before torch's first parallel op: its OpenMP threads are made then and inherit the
    main thread's affinity."""
    import torch

    try:
        placement = current_placement(bind, num_reserved, world_size)
    except ValueError as unmet:
        raise SystemExit(f"pagedserve worker: {unmet}") from None
    if placement.rank_cpus is not None:
        # Every thread the process has so far (one made at start-up would keep the old mask), then new ones
        # inherit the main thread's.
        for thread_id in _thread_ids():
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(thread_id, placement.rank_cpus[rank])
    # Fewer threads than cores when asked (torch starts with $OMP_NUM_THREADS threads when it is set), never more.
    threads = min(placement.rank_threads[rank], torch.get_num_threads())
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)  # a forward pass is one op stream: no inter-op parallelism to use
    except RuntimeError:  # already set, or inter-op work already ran in this process
        pass
    logger.info("rank %d: %d torch threads on CPUs %s", rank, threads,
                "unpinned" if placement.rank_cpus is None else list(placement.rank_cpus[rank]))


def _thread_ids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread alone
        return [0]
