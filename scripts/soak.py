"""Soak run: many mixed requests with cancellations against a real server on loopback, then proof that
nothing was lost: every request completed or was cancelled by us, none failed, every KV and swap block free.

    .venv/bin/python scripts/soak.py                       # 2,000 requests on a tiny random model
    .venv/bin/python scripts/soak.py --requests 200 --preemption-mode swap
    .venv/bin/python scripts/soak.py --target 127.0.0.1:50051   # a server already running (loopback only)

Without --target it starts its own `pagedserve serve` on a free loopback port (no HTTP gateway), on
--model or else a tiny random Llama written to a temporary directory, with a small KV pool so that
preemption happens. The mix: greedy and seeded sampling, n = 2, beam search; a quarter of the streams are
cancelled after 0-5 chunks, some run into a short deadline and some are ended by an Abort call. Bounded in
count (--requests) and time (--time-limit: no new request starts after it). Prints one JSON object;
exits 1 if any request failed, a block was not freed, or the time ran out before every request started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client import AsyncClient, Client, DeadlineExceededError, PagedServeError  # noqa: E402

KINDS = (
    ("greedy", dict(temperature=0.0)),
    ("sampled", dict(temperature=0.8, top_p=0.9)),
    ("n2", dict(n=2, temperature=1.0)),
    ("beams", dict(beam_width=2, temperature=0.0)),
)


@dataclass
class Tally:
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.failed += 1
        if len(self.failures) < 20:
            self.failures.append(what)


DEADLINE_S = 0.15  # the gRPC deadline of the requests meant to run past theirs


async def one_request(clients: dict[str, AsyncClient], index: int, rng: random.Random, vocab_size: int,
                      tally: Tally) -> None:
    kind, sampling = rng.choice(KINDS)
    prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 48))]
    request_id = f"soak-{index}"
    request = dict(request_id=request_id, max_tokens=rng.randint(1, 48), ignore_eos=True, seed=index, **sampling)
    fate = rng.choices(["complete", "cancel", "deadline", "abort"], weights=[65, 25, 5, 5])[0]
    num_sequences = request.get("n", 1)
    chunks = []
    client = clients["deadline" if fate == "deadline" else "plain"]
    stream = client.generate_stream(prompt, **request)
    try:
        if fate == "cancel":
            stop_after = rng.randint(0, 5)
            async for chunk in stream:
                if len(chunks) == stop_after:
                    break
                chunks.append(chunk)
        else:
            async for chunk in stream:
                chunks.append(chunk)
                if fate == "abort" and len(chunks) == 1:
                    await client.abort(request_id)
    except DeadlineExceededError:
        tally.cancelled += 1
        return
    except PagedServeError as error:
        tally.fail(f"{request_id} ({kind}, {fate}): {error.code.name}: {error.details[:200]}")
        return
    except Exception as error:  # anything else is a failure too, reported rather than fatal
        tally.fail(f"{request_id} ({kind}, {fate}): {type(error).__name__}: {str(error)[:200]}")
        return
    finally:
        await stream.aclose()
    finals = sorted(chunk.index for chunk in chunks if chunk.finish_reason is not None)
    if fate == "cancel" and len(finals) < num_sequences:
        tally.cancelled += 1
    elif finals != list(range(num_sequences)):
        tally.fail(f"{request_id} ({kind}, {fate}): sequences ended {finals}, expected each of {num_sequences} once")
    elif any(chunk.finish_reason == "abort" for chunk in chunks):
        tally.cancelled += 1
    else:
        tally.completed += 1


async def soak(target: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    request_rngs = [random.Random(rng.getrandbits(64)) for _ in range(args.requests)]  # same mix, any timing
    tally = Tally()
    started_at = time.monotonic()
    deadline = started_at + args.time_limit
    gate = asyncio.Semaphore(args.concurrency)
    num_started = 0
    async with AsyncClient(target) as client, AsyncClient(target, timeout=DEADLINE_S) as deadline_client:
        await client.wait_ready(timeout=120)
        vocab_size = (await client.model_info()).vocab_size
        clients = dict(plain=client, deadline=deadline_client)

        async def gated(index: int) -> None:
            nonlocal num_started
            async with gate:
                if time.monotonic() > deadline:
                    return
                num_started += 1
                await one_request(clients, index, request_rngs[index], vocab_size, tally)

        await asyncio.gather(*(gated(index) for index in range(args.requests)))
    return dict(requests=args.requests, started=num_started, completed=tally.completed, cancelled=tally.cancelled,
                failed=tally.failed, failures=tally.failures, duration_s=round(time.monotonic() - started_at, 1))


def wait_all_free(target: str, timeout: float = 30.0) -> dict:
    with Client(target) as client:
        end = time.monotonic() + timeout
        while True:
            stats = client.stats()
            idle = stats.num_running + stats.num_waiting + stats.num_swapped == 0
            free = (stats.num_free_kv_blocks == stats.num_kv_blocks
                    and stats.num_free_swap_blocks == stats.num_swap_blocks)
            if (idle and free) or time.monotonic() > end:
                return dict(num_kv_blocks=stats.num_kv_blocks, num_free_kv_blocks=stats.num_free_kv_blocks,
                            num_swap_blocks=stats.num_swap_blocks, num_free_swap_blocks=stats.num_free_swap_blocks,
                            num_preemptions=stats.num_preemptions, num_swapped_out_blocks=stats.num_swapped_out_blocks,
                            in_flight=stats.num_running + stats.num_waiting + stats.num_swapped)
            time.sleep(0.1)


@contextlib.contextmanager
def own_server(args: argparse.Namespace):
    """`pagedserve serve` on a free loopback port; yields its target, stops it with SIGTERM after."""
    with tempfile.TemporaryDirectory(prefix="pagedserve-soak-") as scratch:
        model = args.model
        if model is None:
            from pagedserve.testing.tiny_models import make_tiny_model

            model = str(make_tiny_model(Path(scratch), "llama", seed=1))
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        log = open(Path(scratch) / "server.log", "wb")
        server = subprocess.Popen(
            [sys.executable, "-m", "pagedserve", "serve", "--model", model, "--grpc-host", "127.0.0.1", "--grpc-port", str(port),
             "--no-http", "--max-model-len", "256", "--num-kv-blocks", str(args.num_kv_blocks), "--swap-space", "0.01",
             "--preemption-mode", args.preemption_mode],
            stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parent.parent,
            start_new_session=True)  # a Ctrl-C meant for the soak reaches the server through `finally` only
        try:
            yield f"127.0.0.1:{port}"
        finally:
            exited_early = server.poll() is not None
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
            log.close()
            if exited_early or server.returncode not in (0, None):
                sys.stderr.write(f"the server exited {'during the soak ' if exited_early else ''}with code "
                                 f"{server.returncode}; its log ends:\n")
                sys.stderr.write((Path(scratch) / "server.log").read_text(errors="replace")[-4000:])


def _require_loopback(target: str) -> None:
    host = target.rsplit(":", 1)[0].strip("[]")
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise SystemExit(f"--target must be a loopback address, got {host}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    parser.add_argument("--time-limit", type=float, default=1800.0, help="seconds; no request starts after")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", default=None, help="a running server on loopback (default: start one)")
    parser.add_argument("--model", default=None, help="model for the server started here (default: tiny random)")
    parser.add_argument("--num-kv-blocks", type=int, default=96, help="KV pool of the server started here")
    parser.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    args = parser.parse_args()
    if args.target:
        _require_loopback(args.target)
    with contextlib.nullcontext(args.target) if args.target else own_server(args) as target:
        report = asyncio.run(soak(target, args))
        report.update(wait_all_free(target))
    leaked = report["num_free_kv_blocks"] != report["num_kv_blocks"] or (
        report["num_free_swap_blocks"] != report["num_swap_blocks"]) or report["in_flight"]
    report["ok"] = not report["failed"] and not leaked and report["started"] == report["requests"]
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
