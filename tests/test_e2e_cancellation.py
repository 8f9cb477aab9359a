"""Cancellation through the real processes: a cancelled stream, a vanished client, an Abort racing the
final step and a passed gRPC deadline each end their request exactly once (the server's finished count
grows by one per request) and free every block, GPU and swap, for n > 1 and beam search too. An explicit
Abort of each kind mid-stream is covered in test_e2e_scheduling.py; one cancelled stream in test_e2e_api.py."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from client import AsyncClient, DeadlineExceededError
from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model

KINDS = {"single": dict(), "n3": dict(n=3, temperature=1.0), "beams": dict(beam_width=3, temperature=0.0)}
ENDLESS = dict(max_tokens=10_000, ignore_eos=True)  # runs until max_model_len unless ended early


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=7)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model), "--max-model-len", "512") as running:
        yield running


def _finished_count(server) -> int:
    with server.client() as client:
        return client.stats().num_finished_requests


def _assert_all_free_and_ended(server, finished_before: int, num_admitted: int, num_sent: int | None = None) -> None:
    """Every block free, nothing in flight, and the server ended each admitted request once: at least
    `num_admitted` (those known to have reached the engine), at most `num_sent` (a call cancelled before
    its handler ran never reaches the engine)."""
    stats = server.wait_all_blocks_free(timeout=30)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "KV blocks leaked"
    assert stats.num_free_swap_blocks == stats.num_swap_blocks, "swap blocks leaked"
    assert stats.num_running + stats.num_waiting + stats.num_swapped == 0
    num_ended = stats.num_finished_requests - finished_before
    assert num_admitted <= num_ended <= (num_sent or num_admitted), "every admitted request ends exactly once"


async def _cancel_after(client: AsyncClient, prompt, num_chunks: int, once_running: bool = False, **kwargs) -> int:
    """Streams until `num_chunks` chunks arrived, then cancels. 0: cancels while waiting for the first chunk,
    after a random pause of up to 20 ms, or with `once_running` as soon as the server runs a request."""
    stream = client.generate_stream(prompt, **kwargs)
    received = 0
    if num_chunks == 0:
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(random.uniform(0, 0.02))
        while once_running and (await client.stats()).num_running == 0:
            await asyncio.sleep(0.005)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
    else:
        async for _ in stream:
            received += 1
            if received == num_chunks:
                break
    await stream.aclose()
    return received


def test_200_randomly_cancelled_streams_free_everything_and_a_fresh_request_completes_promptly(server):
    finished_before = _finished_count(server)
    rng = random.Random(200)
    cancel_points = [rng.randint(0, 5) for _ in range(200)]

    async def run():
        async with AsyncClient(server.target) as client:
            received = await asyncio.gather(*(
                _cancel_after(client, [rng.randrange(512) for _ in range(rng.randint(1, 40))], point, **ENDLESS)
                for point in cancel_points))
            started = time.monotonic()
            fresh = await client.generate([1, 2, 3], max_tokens=8, temperature=0.0, ignore_eos=True)
            return received, fresh, time.monotonic() - started

    received, fresh, fresh_seconds = asyncio.run(run())
    assert received == cancel_points, "each stream got exactly the chunks it waited for before cancelling"
    assert len(fresh.token_ids) == 8 and fresh.finish_reason == "length"
    assert fresh_seconds < 30, f"the fresh request took {fresh_seconds:.1f} s"
    num_admitted = sum(1 for point in cancel_points if point > 0) + 1
    _assert_all_free_and_ended(server, finished_before, num_admitted, num_sent=201)


@pytest.mark.parametrize("kind", KINDS)
def test_a_cancelled_stream_of_each_kind_ends_once_and_frees_its_blocks(server, kind):
    finished_before = _finished_count(server)

    async def run():
        async with AsyncClient(server.target) as client:
            # beams stream nothing before the end: cancel those once running, while waiting for the first chunk
            return await _cancel_after(client, [5] * 30, 0 if kind == "beams" else 2, once_running=True, **ENDLESS,
                                       **KINDS[kind])

    asyncio.run(run())
    _assert_all_free_and_ended(server, finished_before, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_a_passed_deadline_ends_the_request_once_and_frees_its_blocks(server, kind):
    finished_before = _finished_count(server)
    with server.client(timeout=1.0) as client:
        with pytest.raises(DeadlineExceededError):
            client.generate([6] * 30, **ENDLESS, **KINDS[kind])
    _assert_all_free_and_ended(server, finished_before, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_an_abort_racing_the_final_step_ends_every_sequence_exactly_once(server, kind):
    """Each request is aborted around its last step: when sequence 0's next-to-last chunk arrives (beams,
    which stream only at the end: after a random part of an undisturbed run's time)."""
    max_tokens, num_requests = 4, 12
    sampling = dict(max_tokens=max_tokens, ignore_eos=True, **KINDS[kind])
    with server.client() as client:
        started = time.monotonic()
        client.generate([9, 9, 9], **sampling)
        run_seconds = time.monotonic() - started
    finished_before = _finished_count(server)
    rng = random.Random(kind)
    streams: list[list] = []

    def one(index: int) -> None:
        request_id = f"race-{kind}-{index}"
        chunks: list = []
        streams.append(chunks)
        with server.client() as client:
            aborter = None
            if kind == "beams":
                aborter = threading.Timer(rng.uniform(0.5, 1.0) * run_seconds, client.abort, args=(request_id,))
                aborter.start()
            for chunk in client.generate_stream([9, 9, index], request_id=request_id, **sampling):
                chunks.append(chunk)
                tokens_of_first = sum(len(c.token_ids) for c in chunks if c.index == 0)
                if aborter is None and chunk.index == 0 and tokens_of_first == max_tokens - 1:
                    client.abort(request_id)
            if aborter is not None:
                aborter.join()

    threads = [threading.Thread(target=one, args=(index,)) for index in range(num_requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a stream did not end"
    num_sequences = KINDS[kind].get("n", 1)
    for chunks in streams:
        finals = [chunk for chunk in chunks if chunk.finish_reason is not None]
        assert sorted(chunk.index for chunk in finals) == list(range(num_sequences)), "one end per sequence"
        assert all(chunk.finish_reason in ("length", "abort") for chunk in finals)
        for final in finals:
            assert not [c for c in chunks[chunks.index(final) + 1:] if c.index == final.index], "nothing after its end"
    _assert_all_free_and_ended(server, finished_before, num_requests)


def test_cancelling_swapped_requests_frees_the_swap_pool(model, tmp_path):
    """Eight long requests on a pool that holds one at a time swap each other out; cancelling them all while
    some sit in the swap pool frees every GPU and swap block. One of them samples n = 3."""
    with running_server(tmp_path, "--model", str(model), "--max-model-len", "224", "--num-kv-blocks", "14",
                        "--preemption-mode", "swap", "--swap-space", "0.01") as server:
        finished_before = _finished_count(server)

        async def run():
            async with AsyncClient(server.target) as client:
                tasks = [asyncio.ensure_future(_cancel_after(client, [i + 1] * 20, 10_000, max_tokens=180,
                                                             ignore_eos=True, temperature=1.0, n=3 if i == 0 else 1))
                         for i in range(8)]
                deadline = time.monotonic() + 60
                while (await client.stats()).num_swapped == 0:
                    assert time.monotonic() < deadline, "nothing was swapped out"
                    await asyncio.sleep(0.01)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return await client.stats()

        stats_while_swapped = asyncio.run(run())
        assert stats_while_swapped.num_swapped_out_blocks > 0
        _assert_all_free_and_ended(server, finished_before, 8)
