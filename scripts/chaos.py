"""Chaos run: mixed requests while the worker process is killed with SIGKILL every K seconds and the scheduler
every S seconds; then proof that crash recovery lost nothing: no request failed, greedy and seeded requests
gave the tokens of an undisturbed run, and every KV block is free at the end.

    .venv/bin/python scripts/chaos.py --embedded-model          # 2,000 requests; worker kills every 10 s,
                                                                # scheduler kills every 60 s
    .venv/bin/python scripts/chaos.py --requests 150 --kill-every 20 --kill-scheduler-every 0 --concurrency 16
                                       # worker kills only, a tiny random Llama

It starts its own `pagedserve serve` on a free loopback port (--model, --embedded-model for the embedded
SmolLM2-135M, else a tiny random Llama), with --max-worker-restarts and --max-scheduler-restarts high enough
for every kill. A killed scheduler is restarted with fresh workers by the launcher, and the SDK resumes its
streams on the new one (client/stream_resume.py). The mix: streaming and non-streaming (`generate`), greedy
and seeded sampling, prompts of 1-32 tokens and 1-32 output tokens; 10% are cancelled after 0-3 tokens.
First every request that runs to its end (greedy or seeded) is sent once with no kill, as the reference;
then all of them again, concurrently, while a thread kills the worker (the launcher's child running
worker_svc) after every --kill-every seconds of serving, and another the scheduler after every
--kill-scheduler-every seconds of serving (0: never). Seconds of serving: each clock starts when health is
SERVING again (the embedded model's worker takes about 10 s to load on 2 cores, so a wall-clock 10 s would
kill every replacement before it served a step). Each pass starts no request
after --time-limit seconds. Prints one JSON object; exits 1 if a request failed or never started, a token
differed from the reference, or a block was not freed at the end (GetStats: free KV blocks == KV blocks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client import AsyncClient, PagedServeError  # noqa: E402
from pagedserve.health_probe import grpc_serving  # noqa: E402
from pagedserve.testing.server_harness import descendants, running_server  # noqa: E402


@dataclass(frozen=True)
class Plan:
    index: int
    prompt: list[int]
    sampling: dict
    streaming: bool
    cancel_after: int | None  # chunks; None: runs to its end


@dataclass
class Tally:
    started: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    mismatched: int = 0
    failures: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(what)


def make_plans(count: int, seed: int, vocab_size: int) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for index in range(count):
        greedy = rng.random() < 0.5
        sampling = dict(max_tokens=rng.randint(1, 32), ignore_eos=True,
                        **(dict(temperature=0.0) if greedy else dict(temperature=0.9, top_p=0.95, seed=index)))
        plans.append(Plan(index, [rng.randrange(vocab_size) for _ in range(rng.randint(1, 32))], sampling,
                          streaming=rng.random() < 0.5,
                          cancel_after=rng.randint(0, 3) if rng.random() < 0.1 else None))
    return plans


async def run_one(client: AsyncClient, plan: Plan) -> list[int] | None:
    """The request's tokens, or None when it was cancelled on purpose."""
    if not plan.streaming and plan.cancel_after is None:
        return list((await client.generate(plan.prompt, **plan.sampling)).token_ids)
    tokens: list[int] = []
    stream = client.generate_stream(plan.prompt, **plan.sampling)
    try:
        async for chunk in stream:
            if plan.cancel_after is not None and len(tokens) >= plan.cancel_after:
                return None
            tokens.extend(chunk.token_ids)
    finally:
        await stream.aclose()
    return tokens


async def run_all(target: str, plans: list[Plan], concurrency: int, reference: dict[int, list[int]] | None,
                  tally: Tally, deadline: float) -> dict[int, list[int]]:
    """Runs the plans, `concurrency` at a time; none starts after `deadline` (time.monotonic())."""
    gate = asyncio.Semaphore(concurrency)
    results: dict[int, list[int]] = {}
    async with AsyncClient(target, max_retries=10) as client:

        async def one(plan: Plan) -> None:
            async with gate:
                if time.monotonic() > deadline:
                    return
                tally.started += 1
                try:
                    tokens = await run_one(client, plan)
                except PagedServeError as error:
                    tally.failed += 1
                    tally.note(f"request {plan.index}: {error.code.name}: {error.details[:200]}")
                    return
                if tokens is None:
                    tally.cancelled += 1
                    return
                tally.completed += 1
                results[plan.index] = tokens
                if reference is not None and plan.index in reference and reference[plan.index] != tokens:
                    tally.mismatched += 1
                    tally.note(f"request {plan.index} ({plan.sampling}): tokens differ from the undisturbed run")

        await asyncio.gather(*(one(plan) for plan in plans))
    return results


def kill_every(server, module: bytes, interval: float, stop: threading.Event, kills: list[float]) -> None:
    """SIGKILLs the launcher's children running `module` (worker_svc, scheduler_svc) after each `interval`
    seconds of serving: the clock starts once the server is SERVING again, since a replacement that takes
    longer to load than the interval would otherwise be killed before it served anything."""
    while interval > 0:
        while not grpc_serving(server.target) and not stop.wait(0.2):
            pass
        if stop.wait(interval):
            return
        for pid in [pid for pid in descendants(server.process.pid) if module in _cmdline(pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
                kills.append(time.monotonic())
            except ProcessLookupError:
                pass


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--kill-every", type=float, default=10.0, help="seconds of serving between worker kills")
    parser.add_argument("--kill-scheduler-every", type=float, default=60.0,
                        help="seconds of serving between scheduler kills (0: never)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="default: a tiny random Llama")
    parser.add_argument("--embedded-model", action="store_true", help="serve the embedded SmolLM2-135M")
    parser.add_argument("--time-limit", type=float, default=3600.0,
                        help="seconds per pass (reference, then chaos); no request starts after it")
    args = parser.parse_args()
    model_args = [] if args.embedded_model else _model_args(args.model)
    with running_server(Path(os.environ.get("TMPDIR", "/tmp")), *model_args, "--max-model-len", "256",
                        "--max-worker-restarts", "1000", "--max-scheduler-restarts", "1000") as server:
        with server.client() as client:
            vocab_size = client.model_info().vocab_size
        plans = make_plans(args.requests, args.seed, vocab_size)
        whole = [plan for plan in plans if plan.cancel_after is None]
        started = time.monotonic()
        reference_tally = Tally()
        reference = asyncio.run(run_all(server.target, whole, args.concurrency, None, reference_tally,
                                        started + args.time_limit))
        reference_s = time.monotonic() - started
        stop, kills, scheduler_kills = threading.Event(), [], []
        killers = [threading.Thread(target=kill_every, args=(server, b"worker_svc", args.kill_every, stop, kills),
                                    daemon=True),
                   threading.Thread(target=kill_every, args=(server, b"scheduler_svc", args.kill_scheduler_every,
                                                             stop, scheduler_kills), daemon=True)]
        tally = Tally()
        started = time.monotonic()
        for killer in killers:
            killer.start()
        asyncio.run(run_all(server.target, plans, args.concurrency, reference, tally, started + args.time_limit))
        stop.set()
        for killer in killers:
            killer.join()
        chaos_s = time.monotonic() - started
        with server.client() as client:  # the last kill may have come just before the end: let it come back
            client.wait_ready(timeout=600)
        stats = server.wait_all_blocks_free(timeout=60)
    report = dict(requests=args.requests, started=tally.started, kill_every_s=args.kill_every,
                  worker_kills=len(kills), kill_scheduler_every_s=args.kill_scheduler_every,
                  scheduler_kills=len(scheduler_kills), completed=tally.completed, cancelled=tally.cancelled, failed=tally.failed,
                  token_mismatches=tally.mismatched, compared_with_reference=len(reference),
                  reference_failed=reference_tally.failed, failures=tally.failures + reference_tally.failures,
                  num_kv_blocks=stats.num_kv_blocks, num_free_kv_blocks=stats.num_free_kv_blocks,
                  reference_s=round(reference_s, 1), chaos_s=round(chaos_s, 1))
    report["ok"] = (tally.started == args.requests and not tally.failed and not tally.mismatched and not reference_tally.failed
                    and stats.num_free_kv_blocks == stats.num_kv_blocks)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


def _model_args(model: str | None) -> list[str]:
    if model is None:
        import tempfile

        from pagedserve.testing.tiny_models import make_tiny_model
        model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="pagedserve-chaos-")), "llama", seed=1,
                                    max_position_embeddings=256))
    return ["--model", model]


if __name__ == "__main__":
    sys.exit(main())
