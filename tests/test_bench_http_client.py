"""bench serve's synchronous JSON client (pagedserve/bench/http_client.py): JSON in and out over one
connection, one reconnect when the server has dropped a keep-alive connection, and JsonHttpError with the
status and body for a non-2xx answer or none when no answer came."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from pagedserve.bench.http_client import JsonHttpClient, JsonHttpError
from pagedserve.free_port import free_port


class DroppingJsonServer:
    """Answers every request on loopback as a keep-alive HTTP/1.1 response (no `Connection: close`), then
    closes the connection anyway, as a server whose idle timeout ran out would. POST /echo answers its JSON
    body with the path it was sent to; any other path gets HTTP 404 with a text body."""

    def __init__(self) -> None:
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> DroppingJsonServer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._listener.close()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            with connection:
                reader = connection.makefile("rb")
                request_line = reader.readline().decode()
                length = 0
                while (line := reader.readline().decode()) not in ("\r\n", ""):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":")[1])
                body = reader.read(length) if length else b""
                method, path, _ = request_line.split(" ", 2)
                if method == "POST" and path == "/prefix/echo":
                    status, data = 200, json.dumps({"path": path, "body": json.loads(body)}).encode()
                else:
                    status, data = 404, b"no such route"
                connection.sendall(f"HTTP/1.1 {status} X\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
                reader.close()  # the socket closes only once its file is closed too


def test_reconnects_once_when_the_server_dropped_the_connection():
    with DroppingJsonServer() as server:
        client = JsonHttpClient(f"http://127.0.0.1:{server.port}/prefix", {}, timeout=10.0)
        answers = [client.post("/echo", {"n": n}) for n in range(3)]
        client.close()
    assert answers == [{"path": "/prefix/echo", "body": {"n": n}} for n in range(3)]
    assert server.connections == 3


def test_a_non_2xx_answer_raises_with_its_status_and_body():
    with DroppingJsonServer() as server:
        client = JsonHttpClient(f"http://127.0.0.1:{server.port}/prefix", {}, timeout=10.0)
        with pytest.raises(JsonHttpError) as raised:
            client.get("/missing")
    assert (raised.value.status, raised.value.body) == (404, "no such route")
    assert "HTTP 404" in str(raised.value)


def test_no_answer_at_all_raises_without_a_status():
    client = JsonHttpClient(f"http://127.0.0.1:{free_port()}", {}, timeout=10.0)
    with pytest.raises(JsonHttpError) as raised:
        client.get("/v1/models")
    assert raised.value.status is None
