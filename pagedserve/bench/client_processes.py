"""`bench serve --num-client-processes P`: the measured run sent from P client processes, so that the client
is not what limits a fast server.

Why: one Python process reading every stream (gRPC's asyncio stack, the SDK's chunks, the timing) costs a few
ms of CPU per 256-token request (benchmarks/data_parallel_cpu_limits.py): about 200 requests a second per
core, less than two GPU engines serve. vLLM's benchmark has one client process; pagedserve's can have several.

How: request i goes to process i % P with its arrival offset unchanged, so the P processes together send the
one schedule (--request-rate, --burstiness, --seed) a single process would; --max-concurrency is split between
them (each gets its share, at least 1). Each process starts by reading its share (a JSON line on stdin), builds
the same backend the parent uses (over CONNECTIONS_PER_PROCESS gRPC connections of its own: with several front
processes, connections spread over them), says it is ready, and sends its requests from the start time the parent gives once all are ready
(time.perf_counter: CLOCK_MONOTONIC on Linux, one clock for every process), then writes its outcomes back (a
JSON line on stdout). The duration is from that start to the last process's last outcome. Not for multi-turn
conversations (each turn waits on the one before: one process keeps them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pagedserve.bench.request_outcome import RequestInput, RequestOutcome
from pagedserve.bench.request_sender import make_backend, send_all

REPO_ROOT = Path(__file__).resolve().parents[2]
START_MARGIN_S = 0.2  # from the last process saying ready to the common start
# gRPC connections each client process opens (requests take them in turn). Why several: a server whose
# processes share one port (--api-server-count) gets each connection, not each request, on one process,
# and the kernel spreads connections at random: many connections spread the load evenly, a few do not.
CONNECTIONS_PER_PROCESS = 8


def concurrency_shares(max_concurrency: int | None, num_processes: int) -> list[int | None]:
    """Each process's --max-concurrency: the limit split as evenly as possible (None: no limit anywhere)."""
    if max_concurrency is None:
        return [None] * num_processes
    return [max_concurrency // num_processes + (rank < max_concurrency % num_processes)
            for rank in range(num_processes)]


def send_from_processes(backend_spec: dict, inputs: list[RequestInput], offsets: list[float],
                        max_concurrency: int | None, num_processes: int
                        ) -> tuple[list[RequestOutcome], float, list[float]]:
    """The outcomes in input order, the wall time from the common start to the last outcome and the CPU seconds
    each process spent sending and reading (its own count, start-up left out)."""
    shares = concurrency_shares(max_concurrency, num_processes)
    processes = [subprocess.Popen([sys.executable, "-m", "pagedserve.bench.client_processes"], cwd=REPO_ROOT,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                      filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))})
                 for _ in range(num_processes)]
    try:
        for rank, process in enumerate(processes):
            mine = range(rank, len(inputs), num_processes)
            share = {"backend": backend_spec, "max_concurrency": shares[rank],
                     "inputs": [dataclasses.asdict(inputs[i]) for i in mine], "offsets": [offsets[i] for i in mine]}
            process.stdin.write(json.dumps(share) + "\n")
            process.stdin.flush()
        for process in processes:
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a client process did not start (exit code {process.wait()})")
        start = time.perf_counter() + START_MARGIN_S
        for process in processes:
            process.stdin.write(f"{start}\n")
            process.stdin.flush()
        results = [json.loads(process.stdout.readline() or "null") for process in processes]
    finally:
        for process in processes:
            process.stdin.close()
            if process.wait(timeout=60) != 0:
                raise RuntimeError(f"a client process failed with exit code {process.returncode}")
    outcomes: list[RequestOutcome | None] = [None] * len(inputs)
    for rank, result in enumerate(results):
        for index, outcome in zip(range(rank, len(inputs), num_processes), result["outcomes"]):
            outcomes[index] = RequestOutcome(**outcome)
    return (outcomes, max(result["end"] for result in results) - start,
            [result["cpu_s"] for result in results])


async def _client_process() -> None:
    share = json.loads(sys.stdin.readline())
    backend = make_backend(share["backend"], share["max_concurrency"], CONNECTIONS_PER_PROCESS)
    inputs = [RequestInput(**fields) for fields in share["inputs"]]
    try:
        print("ready", flush=True)
        start = float(await asyncio.to_thread(sys.stdin.readline))
        await asyncio.sleep(max(start - time.perf_counter(), 0.0))
        cpu_before = time.process_time()
        outcomes, _ = await send_all(backend, inputs, share["offsets"], share["max_concurrency"], True, start)
        end, cpu_s = time.perf_counter(), time.process_time() - cpu_before
    finally:
        await backend.close()
    print(json.dumps({"outcomes": [dataclasses.asdict(outcome) for outcome in outcomes], "end": end, "cpu_s": cpu_s}), flush=True)


if __name__ == "__main__":
    asyncio.run(_client_process())
