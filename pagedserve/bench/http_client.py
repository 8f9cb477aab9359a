"""The few synchronous JSON calls `bench serve` makes over HTTP before it starts: GET /v1/models, POST
/tokenize and /detokenize.

Why the standard library: they are a handful of calls, one at a time, so http.client over one keep-alive
connection does the job without another dependency. The streams themselves go through aiohttp
(request_funcs.py), as in vLLM's `bench serve`: hundreds of concurrent streams need a connection pool whose
cost does not grow with the number of open connections (httpx's pool scans all of them for every request).

Who owns what: one JsonHttpClient owns one connection to one server; it reconnects once when the server has
dropped it (an idle keep-alive closed on the other side), and turns every failure, the transport's or a
non-2xx answer, into a JsonHttpError.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

# A connection the server closed between two requests fails on the next one with one of these: reconnect once.
_DROPPED = (http.client.RemoteDisconnected, http.client.CannotSendRequest, ConnectionResetError, BrokenPipeError)


class JsonHttpError(Exception):
    """A request that failed: `status` and `body` of a non-2xx answer, or status None when no answer came."""

    def __init__(self, message: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class JsonHttpClient:
    """JSON requests to `base_url` (http:// or https://, with an optional path prefix) over one connection."""

    def __init__(self, base_url: str, headers: dict[str, str], timeout: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{base_url!r} is no http:// or https:// URL")
        self._base_url = base_url.rstrip("/")
        self._prefix = parts.path.rstrip("/")
        connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._connection = connection_class(parts.hostname, parts.port, timeout=timeout)
        self._headers = {"Accept": "application/json", **headers}

    def get(self, path: str):
        return self._request("GET", path, None)

    def post(self, path: str, payload: dict):
        return self._request("POST", path, json.dumps(payload).encode())

    def close(self) -> None:
        self._connection.close()

    def _request(self, method: str, path: str, body: bytes | None):
        url = f"{self._base_url}{path}"
        headers = dict(self._headers)
        if body is not None:
            headers["Content-Type"] = "application/json"
        try:
            try:
                status, data = self._exchange(method, self._prefix + path, body, headers)
            except _DROPPED:
                self._connection.close()
                status, data = self._exchange(method, self._prefix + path, body, headers)
        except (OSError, http.client.HTTPException) as error:
            self._connection.close()
            raise JsonHttpError(f"{method} {url}: {type(error).__name__}: {error}") from error
        text = data.decode(errors="replace")
        if not 200 <= status < 300:
            raise JsonHttpError(f"{method} {url}: HTTP {status}: {text[:500]}", status, text)
        try:
            return json.loads(data)
        except ValueError as error:
            raise JsonHttpError(f"{method} {url}: the answer is no JSON: {text[:200]}", status, text) from error

    def _exchange(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, bytes]:
        self._connection.request(method, path, body=body, headers=headers)
        response = self._connection.getresponse()
        return response.status, response.read()  # read to the end: the connection serves the next request
