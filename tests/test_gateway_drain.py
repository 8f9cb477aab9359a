"""SIGTERM drains the gateway: a stream in flight runs to its end, a request sent meanwhile gets a 503 with
Retry-After (not "connection refused"), /health says 503, and the process exits 0 once nothing is in flight."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time

from pagedserve.testing.server_harness import REPO_ROOT, free_port, http_json
from tests.fake_generation_server import FakeServer


def test_sigterm_lets_the_stream_in_flight_finish_and_refuses_new_requests_with_503(tmp_path):
    fake = FakeServer()
    port = free_port()
    log = open(tmp_path / "gateway.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedserve", "gateway", "--grpc-target", fake.target, "--port", str(port),
         "--retry-after", "4", "--shutdown-timeout", "20"], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until(lambda: _answers(url), "the gateway answers")
        events: list[str] = []
        reader = threading.Thread(target=lambda: events.extend(_stream_events(port, "gated")))
        reader.start()
        _wait_until(lambda: any(r.text == "gated" for r in fake.generation.requests), "the stream is in flight")

        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        status, headers, body = http_json(f"{url}/v1/completions", {"prompt": "hi"})
        assert status == 503 and headers["Retry-After"] == "4", body
        assert body["error"]["type"] == "service_unavailable_error"
        assert http_json(f"{url}/health")[0] == 503
        assert process.poll() is None  # still draining: the stream is in flight

        fake.generation.gate.set()
        reader.join(15)
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]) \
            == "first second"
        assert events[-1] == "[DONE]"
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
        fake.stop()


def _stream_events(port: int, prompt: str) -> list[str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "stream": True}),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    lines = response.read().decode().splitlines()
    connection.close()
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def _answers(url: str) -> bool:
    try:
        http_json(f"{url}/version")
        return True
    except OSError:
        return False


def _wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)
