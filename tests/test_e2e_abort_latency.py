"""A cancelled long prompt stops at the next step boundary (issue 22 item 4), through the real processes.

The scheduler plans up to 3 steps ahead, so when a client cancels a long prompt its next chunks are already
queued at the worker. Here the worker's prefill is made slow on purpose (the hidden test flag
--prefill-seconds-per-token: 2.56 s per 256-token chunk, a slow CPU's rate at a tiny model's cost): before
the fix the two queued chunks still ran, and a short request sent right after the cancel finished 10.4 and
12.0 s after it (2 runs on 2 loaded shared cores); with the queued chunks dropped, 2.5 s (the rest of the
chunk running when the cancel came, plus its own steps). The 5 s bound leaves room for a loaded machine either
way."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from client import AsyncClient
from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model

CHUNK_TOKENS = 256
SECONDS_PER_TOKEN = 0.01  # 2.56 s per chunk
BOUND_S = 5.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=3, max_position_embeddings=2048)
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model), "--max-model-len", "2048",
                        "--max-num-batched-tokens", str(CHUNK_TOKENS),
                        "--prefill-seconds-per-token", str(SECONDS_PER_TOKEN)) as running:
        yield running


def test_a_short_request_sent_after_a_cancelled_long_prompt_waits_for_one_chunk_at_most(server):
    rng = random.Random(0)
    long_prompt = [rng.randrange(2, 512) for _ in range(4 * CHUNK_TOKENS)]  # 4 chunks, 3 planned at once

    async def run() -> float:
        async with AsyncClient(server.target) as client:
            long_request = asyncio.ensure_future(client.generate(long_prompt, max_tokens=4))
            while (await client.stats()).num_running == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # inside the first chunk's step
            long_request.cancel()
            cancelled = time.monotonic()
            short = await client.generate([5, 6, 7, 8], max_tokens=4, temperature=0.0)
            assert len(short.token_ids) == 4
            return time.monotonic() - cancelled

    waited = asyncio.run(run())
    print(f"short request done {waited:.2f} s after the cancel")
    assert waited < BOUND_S, f"the short request waited {waited:.1f} s behind a cancelled prompt's planned chunks"
    stats = server.wait_all_blocks_free()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
