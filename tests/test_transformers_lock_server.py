"""The tutorial's baseline (benchmarks/transformers_lock_server.py) is a fair OpenAI-compatible peer: it streams one
SSE chunk per token and the chunks add up to the whole answer, a seed repeats a sampled answer, a bad or unknown
field is a 400 naming it, /tokenize and /detokenize answer as vLLM's, and the lock makes two requests take turns. One server on a tiny random model."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time

import pytest

from benchmarks.id_word_tokenizer import write_id_word_tokenizer
from pagedserve.free_port import free_port
from pagedserve.health_probe import http_ok
from pagedserve.testing.server_harness import REPO_ROOT
from pagedserve.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("model"), "llama")
    tokenizer = write_id_word_tokenizer(tmp_path_factory.mktemp("tokenizer"), vocab_size=512)
    port = free_port()
    process = subprocess.Popen([sys.executable, "benchmarks/transformers_lock_server.py", "--model", str(model),
                                "--tokenizer", str(tokenizer),
                                "--port", str(port), "--served-model-name", "tiny"], cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 120
        while not http_ok(f"http://127.0.0.1:{port}/health"):
            assert process.poll() is None and time.monotonic() < deadline, "the lock server did not start"
            time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)


def post(port: int, path: str, body: dict) -> tuple[int, dict | list[tuple[float, dict | str]]]:
    """(status, JSON body), or for a stream (200, [(arrival time, chunk or "[DONE]"), ...])."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200 or not body.get("stream"):
            return response.status, json.loads(response.read())
        events = []
        for line in response:
            if line.startswith(b"data: "):
                data = line[6:].strip().decode()
                events.append((time.perf_counter(), data if data == "[DONE]" else json.loads(data)))
        return 200, events
    finally:
        connection.close()


def test_a_stream_is_one_chunk_per_token_and_adds_up_to_the_whole_answer(port):
    request = {"prompt": "w5 w6 w7", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    status, events = post(port, "/v1/completions", {**request, "stream": True,
                                                    "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1][1] == "[DONE]"
    chunks = [chunk for _, chunk in events[:-1]]
    texts = [chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"]]
    assert len(texts) == 7 and all(texts[:6]) and texts[6] == ""  # six tokens, then the finish chunk
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    status, whole = post(port, "/v1/completions", request)
    assert status == 200 and whole["choices"][0]["text"] == "".join(texts)
    assert whole["usage"]["completion_tokens"] == 6 and whole["model"] == "tiny"


def test_a_seed_repeats_a_sampled_answer(port):
    request = {"messages": [{"role": "user", "content": "w9 w10"}], "max_tokens": 12, "temperature": 1.0,
               "ignore_eos": True}
    answers = [post(port, "/v1/chat/completions", {**request, "seed": seed})[1]["choices"][0]["message"]["content"]
               for seed in (7, 7, 8)]
    assert answers[0] == answers[1] != answers[2]


def test_tokenize_and_detokenize_are_vllms_routes(port):
    status, body = post(port, "/tokenize", {"prompt": "w5 w6 nonsense", "add_special_tokens": False})
    assert status == 200 and body["tokens"] == [5, 6, 0] and body["count"] == 3 and body["max_model_len"] == 512
    assert post(port, "/detokenize", {"tokens": [5, 6]}) == (200, {"prompt": "w5 w6"})


@pytest.mark.parametrize("field, value", [("top_p", 2.0), ("max_tokens", 0), ("frequency_penalty", 0.5)])
def test_a_bad_or_unknown_field_is_a_400_naming_it(port, field, value):
    status, body = post(port, "/v1/completions", {"prompt": "w5", field: value})
    assert status == 400 and body["error"]["param"] == field
    assert post(port, "/v1/completions", {"prompt": "w5", "max_tokens": 2})[0] == 200  # still serving


def test_the_lock_makes_two_requests_take_turns(port):
    num_tokens = 32
    request = {"prompt": "w5 w6", "max_tokens": num_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    arrivals: list[list[float]] = [[], []]

    def stream(index: int) -> None:
        arrivals[index] = [t for t, chunk in post(port, "/v1/completions", request)[1][:-1]
                           if chunk["choices"] and chunk["choices"][0]["text"]]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [len(a) for a in arrivals] == [num_tokens, num_tokens]
    first, second = sorted(arrivals, key=lambda a: a[0])
    # Without the lock both would stream from the start; with it, the second waits for (nearly) all of the first.
    assert sum(t < second[0] for t in first) >= num_tokens - 2
