"""Scheduler crash recovery through real `pagedserve serve` processes: the scheduler is killed with SIGKILL
while 4 gRPC (SDK) and 4 HTTP (gateway) streams run, greedy and seeded; the launcher starts a new scheduler
with fresh workers, health goes NOT_SERVING then SERVING, and every stream resumes where it stopped
(client/stream_resume.py): its whole text and token ids equal an undisturbed run's, no token twice, none
missing. A request sent while the scheduler is down waits for it rather than failing."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading

import pytest

from pagedserve.health_probe import grpc_serving
from pagedserve.testing.server_harness import descendants, launched_server
from pagedserve.testing.tiny_models import make_tiny_model
from pagedserve.testing.tiny_tokenizers import write_opt_tokenizer
from tests.stream_watch import StreamWatch, process_with_role

MAX_TOKENS = 300
PROMPTS = ["Hello, my name is", "The capital of France is", "The future of AI is", "Once upon a time"]


@pytest.fixture(scope="module")
def opt_dir(tmp_path_factory):
    return write_opt_tokenizer(make_tiny_model(tmp_path_factory.mktemp("models"), "opt", seed=11))


def _sampling(i: int) -> dict:
    """Even streams greedy, odd ones seeded sampling (the seed chosen by the client for gRPC, drawn by the
    server for HTTP: the resume must carry the server's)."""
    return {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "top_p": 0.9}


class HttpStream:
    """One streaming /v1/completions request on its own thread: its text deltas, and how it ended."""

    def __init__(self, port: int, body: dict) -> None:
        self.texts: list[str] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.first_chunk = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(port, body), daemon=True)
        self._thread.start()

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"an HTTP stream still runs {timeout} s later"

    def _run(self, port: int, body: dict) -> None:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
            connection.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                self.error = f"HTTP {response.status}: {response.read()[:300]!r}"
                return
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    self.error = json.dumps(event["error"])
                    return
                for choice in event["choices"]:
                    self.texts.append(choice["text"])
                    self.finish_reason = choice.get("finish_reason") or self.finish_reason
                self.first_chunk.set()
        except OSError as error:
            self.error = repr(error)
        finally:
            self.first_chunk.set()


def _http_body(i: int, seed: int | None = None) -> dict:
    body = {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "ignore_eos": True, **_sampling(i)}
    return body if seed is None else {**body, "seed": seed}


def _grpc_stream(target: str, i: int) -> StreamWatch:
    return StreamWatch(target, PROMPTS[i], max_tokens=MAX_TOKENS, ignore_eos=True, seed=100 + i, **_sampling(i))


def _tokens(stream: StreamWatch) -> list[int]:
    return [token for chunk in stream.chunks for token in chunk.token_ids]


def _text(stream: StreamWatch) -> str:
    return "".join(chunk.text for chunk in stream.chunks)


def test_a_killed_scheduler_is_replaced_and_every_grpc_and_http_stream_resumes_exactly(opt_dir, tmp_path):
    with launched_server(tmp_path, "--model", str(opt_dir), "--num-kv-blocks", "512", http=True) as server:
        # The undisturbed run: the same requests, one at a time (seeded HTTP ones with the seed they will get).
        with server.client() as client:
            expected = [client.generate(PROMPTS[i], max_tokens=MAX_TOKENS, ignore_eos=True, seed=100 + i,
                                        **_sampling(i)) for i in range(4)]
        undisturbed_http = [HttpStream(server.http_port, _http_body(i, seed=200 + i)) for i in range(4)]
        for stream in undisturbed_http:
            stream.join(timeout=120)
        assert [stream.error for stream in undisturbed_http] == [None] * 4

        grpc_streams = [_grpc_stream(server.target, i) for i in range(4)]
        # Sampled with no seed: it resumes only with the seed the server drew (GenerateResponse.seed).
        unseeded = StreamWatch(server.target, PROMPTS[1], max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0)
        http_streams = [HttpStream(server.http_port, _http_body(i, seed=200 + i)) for i in range(4)]
        for stream in [*grpc_streams, unseeded, *http_streams]:
            assert stream.first_chunk.wait(120), "a stream got no first chunk"
        late_client = server.client()
        late_client.model_info()  # it reached the scheduler: after the loss it waits for the next one
        first_scheduler = process_with_role(server.children, "scheduler")
        os.kill(first_scheduler, signal.SIGKILL)
        cut = [stream.num_tokens for stream in grpc_streams]
        assert not grpc_serving(server.target)  # health: not SERVING until the new scheduler's workers are up
        # Sent while the scheduler is down: they wait for the new one rather than fail.
        late_http = HttpStream(server.http_port, _http_body(0))
        late = late_client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, ignore_eos=True, **_sampling(0))
        late_client.close()
        late_http.join(timeout=120)
        assert late_http.error is None and late_http.text == expected[0].text
        assert late.token_ids == expected[0].token_ids
        for stream in [*grpc_streams, unseeded, *http_streams]:
            stream.join(timeout=240)
        assert unseeded.error is None and unseeded.num_tokens == MAX_TOKENS

        assert [stream.error for stream in grpc_streams] == [None] * 4
        assert [stream.error for stream in http_streams] == [None] * 4
        assert any(0 < n < MAX_TOKENS for n in cut), f"the kill came after the streams ended: {cut}"
        for i, stream in enumerate(grpc_streams):
            assert _tokens(stream) == list(expected[i].token_ids), f"gRPC stream {i}"
            assert _text(stream) == expected[i].text, f"gRPC stream {i}"
            assert stream.finish_reason == "length"
        for i, stream in enumerate(http_streams):
            assert stream.text == undisturbed_http[i].text, f"HTTP stream {i}"
            assert stream.finish_reason == "length", f"HTTP stream {i}"
        assert server.process.poll() is None
        assert process_with_role(descendants(server.process.pid), "scheduler") != first_scheduler
        assert grpc_serving(server.target)
        log = server.log()
    assert "the scheduler exited with code -9; restarting it and the workers" in log


def test_serve_restarts_a_crashed_scheduler_but_not_one_that_stopped_after_losing_its_workers():
    from pagedserve.launcher import _crashed
    from scheduler_svc.main import CRASH_EXIT_CODE

    assert _crashed(-signal.SIGKILL) and _crashed(-signal.SIGSEGV) and _crashed(CRASH_EXIT_CODE)
    assert not _crashed(1) and not _crashed(0)  # exit 1: its workers are gone for good (test_worker_faults.py)
