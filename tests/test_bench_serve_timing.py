"""`bench serve`'s clock against a fake OpenAI server on loopback whose chunk delays are known: TTFT is measured
from the send to the first chunk carrying output (a chat's role-only chunk is not output), ITL between output
chunks, E2EL to the last chunk, TPOT = (E2EL - TTFT) / (output tokens - 1) with the tokens from the usage
chunk; a request answered with HTTP 500, or whose stream stops before [DONE], counts as failed and stays out
of the latency figures; the JSON record carries vLLM's keys."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from pagedserve.bench.request_funcs import OpenAIStreamingBackend
from pagedserve.bench.request_outcome import RequestInput
from pagedserve.cli import main

# (seconds to wait, then the event to send) for one streamed completion: output after 0.3, 0.4 and 0.7 s.
COMPLETION_EVENTS = [
    (0.3, {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}),
    (0.1, {"choices": [{"index": 0, "text": "b", "finish_reason": None}]}),
    (0.3, {"choices": [{"index": 0, "text": "c", "finish_reason": "length"}]}),
    (0.0, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}}),
]
# A model without tokenizer: chunks carry token ids but no text; only the last has a finish_reason.
TOKENLESS_EVENTS = [
    (0.2, {"choices": [{"index": 0, "text": "", "finish_reason": None}]}),
    (0.2, {"choices": [{"index": 0, "text": "", "finish_reason": None}]}),
    (0.1, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}),
    (0.0, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}),
]
CHAT_EVENTS = [
    (0.05, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}),
    (0.25, {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}),
    (0.2, {"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop"}]}),
]
TOLERANCE = 0.08  # seconds: the fake's sleeps are exact to the event loop's resolution, plus a loaded CPU


class FakeOpenAIServer:
    """A one-request-per-connection HTTP/1.1 server on a thread's event loop. POST /v1/completions streams
    COMPLETION_EVENTS, except that requests number 2, 4, ... (counting from 1) fail: even ones below
    `cut_from` with HTTP 500, the others by closing the stream after its first event. /v1/chat/completions
    streams CHAT_EVENTS."""

    def __init__(self, fail_every_second: bool = False, cut_from: int = 10**9,
                 completion_events: list = COMPLETION_EVENTS) -> None:
        self.completion_events = completion_events
        self.fail_every_second = fail_every_second
        self.cut_from = cut_from
        self.num_completions = 0
        self.bodies: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        self._started.wait(10)
        return self

    def __exit__(self, *exc_info) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        method, path, _ = head.split(" ", 2)
        length = next((int(line.split(":")[1]) for line in head.split("\r\n")
                       if line.lower().startswith("content-length:")), 0)
        body = json.loads(await reader.readexactly(length)) if length else {}
        try:
            if path == "/v1/models":
                await self._json(writer, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
            elif path == "/v1/chat/completions":
                await self._stream(writer, CHAT_EVENTS)
            else:
                self.bodies.append(body)
                self.num_completions += 1
                if self.fail_every_second and self.num_completions % 2 == 0:
                    if self.num_completions < self.cut_from:
                        await self._json(writer, {"error": {"message": "boom", "type": "server_error"}}, 500)
                    else:
                        await self._stream(writer, self.completion_events[:1], done=False)
                else:
                    await self._stream(writer, self.completion_events)
        finally:
            writer.close()

    async def _json(self, writer, payload: dict, status: int = 200) -> None:
        data = json.dumps(payload).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + data)
        await writer.drain()

    async def _stream(self, writer, events, done: bool = True) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        await writer.drain()
        for delay, event in events:
            await asyncio.sleep(delay)
            writer.write(f"data: {json.dumps(event)}\n\n".encode())
            await writer.drain()
        if done:
            writer.write(b"data: [DONE]\n\n")
            await writer.drain()


def _one_request(url: str, chat: bool):
    async def send():
        backend = OpenAIStreamingBackend(url, chat, {}, None)
        try:
            return await backend(RequestInput("fake-model", "hello", 5, 4, True, {"temperature": 0.0}))
        finally:
            await backend.close()

    return asyncio.run(send())


def test_completion_ttft_itl_and_latency_follow_the_chunk_arrivals():
    with FakeOpenAIServer() as server:
        outcome = _one_request(f"{server.url}/v1/completions", chat=False)
        (body,) = server.bodies
    assert outcome.success, outcome.error
    assert outcome.ttft == pytest.approx(0.3, abs=TOLERANCE)
    assert outcome.itl == [pytest.approx(0.1, abs=TOLERANCE), pytest.approx(0.3, abs=TOLERANCE)]
    assert outcome.latency == pytest.approx(0.7, abs=TOLERANCE)
    assert (outcome.generated_text, outcome.output_tokens, outcome.prompt_len) == ("abc", 4, 7)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["ignore_eos"], body["prompt"]) == (4, True, "hello")


def test_completion_chunks_without_text_still_carry_output():
    """As a model without tokenizer streams: the empty-text chunks are its tokens; the finishing one is not
    output (it carries no token of its own) but ends the request."""
    with FakeOpenAIServer(completion_events=TOKENLESS_EVENTS) as server:
        outcome = _one_request(f"{server.url}/v1/completions", chat=False)
    assert outcome.success, outcome.error
    assert outcome.ttft == pytest.approx(0.2, abs=TOLERANCE)
    assert outcome.itl == [pytest.approx(0.2, abs=TOLERANCE)]
    assert outcome.latency == pytest.approx(0.5, abs=TOLERANCE)
    assert outcome.output_tokens == 3


def test_chat_ttft_waits_for_content_not_the_role_chunk():
    with FakeOpenAIServer() as server:
        outcome = _one_request(f"{server.url}/v1/chat/completions", chat=True)
    assert outcome.success, outcome.error
    assert outcome.ttft == pytest.approx(0.3, abs=TOLERANCE)  # not the role chunk's 0.05
    assert outcome.itl == [pytest.approx(0.2, abs=TOLERANCE)]
    assert outcome.generated_text == "Hi!"


def test_failed_requests_count_as_failed_and_stay_out_of_the_latencies(tmp_path):
    """Test request (1) and requests 3, 5 succeed; 2 gets HTTP 500 and 4 a stream cut before [DONE]."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": 100}))
    with FakeOpenAIServer(fail_every_second=True, cut_from=4) as server:
        code = main(["bench", "serve", "--base-url", server.url, "--tokenizer", str(model_dir),
                     "--num-prompts", "4", "--random-input-len", "6", "--random-output-len", "4",
                     "--max-concurrency", "1", "--percentile-metrics", "ttft,tpot,itl,e2el",
                     "--metric-percentiles", "50,90,99", "--goodput", "ttft:500", "--disable-tqdm",
                     "--result-dir", str(tmp_path / "out"), "--result-filename", "r.json"])
        prompts = [body["prompt"] for body in server.bodies]
    assert code == 0
    record = json.loads((tmp_path / "out" / "r.json").read_text())
    assert (record["completed"], record["failed"], record["num_prompts"]) == (2, 2, 4)
    assert record["errors"][0].startswith("HTTP 500") and "[DONE]" in record["errors"][2]
    assert record["errors"][1] == record["errors"][3] == ""
    # With the failures' zeros averaged in, the mean TTFT would be about 0.15 s.
    for key in ("mean_ttft_ms", "median_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"):
        assert record[key] == pytest.approx(300, abs=1000 * TOLERANCE), key
    assert record["mean_tpot_ms"] == pytest.approx((700 - 300) / 3, abs=1000 * TOLERANCE)
    assert record["p99_itl_ms"] == pytest.approx(300, abs=1000 * TOLERANCE)
    assert record["mean_e2el_ms"] == pytest.approx(700, abs=1000 * TOLERANCE)
    assert record["total_output_tokens"] == 8 and record["output_lens"] == [0, 4, 0, 4]
    assert record["request_goodput"] == pytest.approx(2 / record["duration"])
    assert record["model_id"] == "fake-model" and record["backend"] == "openai"
    # No tokenizer, only config.json's vocab_size: the prompts are 6 token ids below it.
    assert all(len(p) == 6 and all(0 <= i < 100 for i in p) for p in prompts)
