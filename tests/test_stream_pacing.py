"""Stream pacing: with more streams than --stream-messages-per-step, tokens reach each stream a few per message
every few steps, and every stream still gets exactly its tokens; a stream's first and last deltas are never
held back."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model
from scheduler_svc.core.request import FinishReason
from scheduler_svc.groups.stream_pacing import PacedQueue, streams_to_flush
from scheduler_svc.text.output_stream import OutputDelta


def test_ordinary_deltas_wait_for_a_flush_but_first_and_last_do_not():
    queue = PacedQueue()
    queue.put_nowait(OutputDelta("a", (1,)))  # first: at once (time to first token)
    queue.put_nowait(OutputDelta("b", (2,)))
    queue.put_nowait(OutputDelta("c", (3,)))
    assert queue.qsize() == 1
    queue.flush()
    assert queue.qsize() == 3
    queue.put_nowait(OutputDelta("d", (4,)))
    queue.put_nowait(OutputDelta("", (5,), FinishReason.STOP))  # the end takes what was held with it
    assert [queue.get_nowait().text for _ in range(5)] == ["a", "b", "c", "d", ""]


@pytest.mark.parametrize(("streams", "per_step", "k"), [(10, 64, 1), (64, 64, 1), (65, 64, 2), (256, 64, 4)])
def test_every_stream_is_flushed_once_in_k_steps(streams, per_step, k):
    turns = [streams_to_flush(streams, step, per_step) for step in range(k)]
    assert {t[0] for t in turns} == {k}
    flushed = sorted(i for step_k, turn in turns for i in range(streams) if i % step_k == turn)
    assert flushed == list(range(streams))


def test_paced_streams_get_their_tokens_in_fewer_messages(tmp_path):
    model = make_tiny_model(tmp_path, "llama", seed=4)
    prompts = [[7 + i, 9, 11 + i, 3] for i in range(8)]

    def run(server):
        def one(prompt):
            with server.client() as client:
                chunks = list(client.generate_stream(prompt, max_tokens=24, temperature=0.0, ignore_eos=True))
                return [t for chunk in chunks for t in chunk.token_ids], len(chunks)

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(one, prompts))

    with running_server(tmp_path, "--model", str(model)) as server:
        unpaced = run(server)
    with running_server(tmp_path, "--model", str(model), "--stream-messages-per-step", "2") as server:
        paced = run(server)
    assert [tokens for tokens, _ in paced] == [tokens for tokens, _ in unpaced]
    assert all(len(tokens) == 24 for tokens, _ in paced)
    assert sum(n for _, n in paced) < sum(n for _, n in unpaced)
