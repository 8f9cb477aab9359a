"""Worker crash recovery through real `pagedserve serve` processes: a killed worker is restarted by the launcher,
the scheduler waits for it (health NOT_SERVING meanwhile) and every stream in flight resumes by recompute,
token-exact against transformers; a request that crashes its worker again and again is failed with INTERNAL
while the others finish: at its second loss when it crashes at admission, at its third when it crashes
mid-decode among others (the second loss catches them all in the same steps: they are then recomputed one at
a time, and the third singles it out)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pagedserve.testing.hf_reference import hf_greedy
from pagedserve.testing.server_harness import launched_server
from pagedserve.testing.tiny_models import make_tiny_model
from tests.stream_watch import HealthWatch, StreamWatch, process_with_role, rank_pid

MAX_TOKENS = 80
POISON_TOKEN = 499
POISON_CRASH_AT = 20  # --crash-at-output-token: the mid-decode poison dies sampling its 20th token


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=41)


def _prompt(i: int) -> list[int]:
    return [1, 2, 3, 10 + i, 20 + 2 * i]


def _streams(target: str, count: int) -> list[StreamWatch]:
    streams = [StreamWatch(target, _prompt(i), max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
               for i in range(count)]
    for stream in streams:
        assert stream.first_chunk.wait(120), "a stream got no first chunk"
    return streams


def _tokens(stream: StreamWatch) -> list[int]:
    return [token for chunk in stream.chunks for token in chunk.token_ids]


def test_a_killed_worker_is_replaced_and_every_stream_finishes_token_exact(model, tmp_path):
    with launched_server(tmp_path, "--model", str(model), "--num-kv-blocks", "256") as server:
        health = HealthWatch(server.target)
        streams = _streams(server.target, 4)
        first_worker = process_with_role(server.children, "worker")
        os.kill(first_worker, signal.SIGKILL)
        for stream in streams:
            stream.join(timeout=180)
        assert [stream.error for stream in streams] == [None] * 4
        assert [stream.finish_reason for stream in streams] == ["length"] * 4
        for i, stream in enumerate(streams):
            assert _tokens(stream) == hf_greedy(model, _prompt(i), MAX_TOKENS), f"stream {i}"
        # The stack stayed up, served again after NOT_SERVING, and serves new requests.
        assert server.process.poll() is None
        assert health.statuses[-2:] == ["NOT_SERVING", "SERVING"], health.statuses
        with server.client() as client:
            assert len(client.generate([5, 6, 7], max_tokens=8, temperature=0.0).token_ids) == 8
        log = server.log()
        health.close()
    assert "restarting the workers" in log and "requests in flight resume by recompute" in log


def test_a_killed_tensor_parallel_rank_brings_a_new_rank_set_and_the_streams_finish_token_exact(model, tmp_path):
    with launched_server(tmp_path, "--model", str(model), "-tp", "2", "--num-kv-blocks", "256") as server:
        streams = _streams(server.target, 3)
        os.kill(rank_pid(server.children, 1), signal.SIGKILL)
        for stream in streams:
            stream.join(timeout=240)
        assert [stream.error for stream in streams] == [None] * 3
        for i, stream in enumerate(streams):
            assert _tokens(stream) == hf_greedy(model, _prompt(i), MAX_TOKENS), f"stream {i}"
        assert server.process.poll() is None


def test_a_request_that_keeps_crashing_its_worker_is_failed_and_the_others_finish(model, tmp_path):
    # One step resumes every request after a loss (the CPU's default budget of 128 tokens would spread the three
    # 85-token recomputes over steps that a loss can catch with the poison's, making them suspects too).
    with launched_server(tmp_path, "--model", str(model), "--num-kv-blocks", "256", "--max-num-batched-tokens", "2048",
                         "--crash-on-token-id", str(POISON_TOKEN)) as server:
        streams = _streams(server.target, 3)
        poison = StreamWatch(server.target, [1, POISON_TOKEN, 2], max_tokens=8, temperature=0.0)
        poison.join(timeout=180)
        for stream in streams:
            stream.join(timeout=180)
        assert poison.error is not None and poison.error.code.name == "INTERNAL", poison.error
        assert "the worker failed 2 times while running this request" in str(poison.error)
        assert [stream.error for stream in streams] == [None] * 3
        for i, stream in enumerate(streams):
            assert _tokens(stream) == hf_greedy(model, _prompt(i), MAX_TOKENS), f"stream {i}"
        assert server.process.poll() is None


def test_a_request_that_crashes_its_worker_mid_decode_is_singled_out_and_failed_and_the_others_finish(model, tmp_path):
    # One step resumes every request after a loss (as above), so the outcome does not depend on timing: the
    # poison's recompute replays it to its crash point among all the others (a tie), the others are then recomputed
    # one at a time before it, and its third loss is its own. Three losses: the default --max-worker-restarts.
    with launched_server(tmp_path, "--model", str(model), "--num-kv-blocks", "256", "--max-num-batched-tokens", "2048",
                         "--crash-on-token-id", str(POISON_TOKEN),
                         "--crash-at-output-token", str(POISON_CRASH_AT)) as server:
        streams = _streams(server.target, 6)
        poison_prompt = [1, POISON_TOKEN, 2]
        poison = StreamWatch(server.target, poison_prompt, max_tokens=2 * POISON_CRASH_AT, temperature=0.0,
                             ignore_eos=True)
        poison.join(timeout=300)
        for stream in streams:
            stream.join(timeout=300)
        assert poison.error is not None and poison.error.code.name == "INTERNAL", poison.error
        assert "the worker failed 3 times while running this request" in str(poison.error)
        streamed = _tokens(poison)  # what it streamed before its crash point, never a token twice
        assert len(streamed) < POISON_CRASH_AT
        assert streamed == hf_greedy(model, poison_prompt, POISON_CRASH_AT - 1)[:len(streamed)]
        assert [stream.error for stream in streams] == [None] * 6
        assert [stream.finish_reason for stream in streams] == ["length"] * 6
        for i, stream in enumerate(streams):
            assert _tokens(stream) == hf_greedy(model, _prompt(i), MAX_TOKENS), f"stream {i}"
        assert server.process.poll() is None
        with server.client() as client:
            assert len(client.generate([5, 6, 7], max_tokens=8, temperature=0.0).token_ids) == 8
        log = server.log()
    assert log.count("requests in flight resume by recompute") == 3
    assert "1 failed after repeated losses" in log
