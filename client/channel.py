"""How both clients connect: channel options and the readiness poll behind `wait_ready`.

Shared by Client (sync grpc) and AsyncClient (grpc.aio), which differ only in how they sleep and call.
"""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2

from protos.pagedserve.v1 import generate_pb2

# gRPC's default reconnect backoff grows from 1 s to 120 s, so a client that first tried while the server
# was still starting could sit out minutes after the server came up. Capping it at 0.5 s costs two cheap
# connect attempts a second against a server that is down, and `wait_ready` notices a new server within
# about 0.6 s (the backoff with its jitter) plus one poll pause.
#
# Keepalive: a server that dies with its connection open (a frozen process, a host gone, a dropped network
# path) sends no FIN, so a stream without a deadline would wait forever. A ping every 20 s that is not
# answered within 10 s ends the call with UNAVAILABLE instead, also while the server sends nothing (no limit
# on pings without data); the scheduler accepts pings that often (scheduler_svc/service.py).
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),  # what gRPC 1.85 waits for the ping's answer (default 60 s)
    ("grpc.http2.max_pings_without_data", 0),
)


def channel_credentials(root_certificates: bytes | str | None) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting `root_certificates` (PEM bytes, or a path to a PEM file); None: plaintext."""
    if root_certificates is None:
        return None
    if isinstance(root_certificates, str):
        with open(root_certificates, "rb") as pem:
            root_certificates = pem.read()
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata every call but health carries: the server's API key as a bearer token."""
    return None if api_key is None else (("authorization", f"Bearer {api_key}"),)


# The server turns this name SERVING once its workers are loaded and it can generate ("" tells only that the
# process answers).
HEALTH_CHECK_REQUEST = health_pb2.HealthCheckRequest(
    service=generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
)
SERVING = health_pb2.HealthCheckResponse.SERVING

_FIRST_POLL_INTERVAL_S = 0.05
_MAX_POLL_INTERVAL_S = 0.25
_MAX_CHECK_TIMEOUT_S = 2.0


class ReadinessPoll:
    """The clock of one `wait_ready` call: its deadline, the growing pause between health checks, and the
    last answer seen, which the TimeoutError reports."""

    def __init__(self, target: str, timeout: float) -> None:
        self._target = target
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._interval = _FIRST_POLL_INTERVAL_S
        self._last_answer = "no answer"

    def check_timeout(self) -> float:
        """Deadline for the next health check: what is left of the wait, at most a couple of seconds."""
        return min(max(self._deadline - time.monotonic(), 0.01), _MAX_CHECK_TIMEOUT_S)

    def next_pause(self, answer: str) -> float:
        """Records a not-SERVING answer and says how long to pause before the next check; raises TimeoutError
        naming the target once the deadline has passed."""
        self._last_answer = answer
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"server at {self._target} was not SERVING after {self._timeout:g} s (last answer: {self._last_answer})"
            )
        pause = min(self._interval, remaining)
        self._interval = min(self._interval * 2, _MAX_POLL_INTERVAL_S)
        return pause


def describe_status(status: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def describe_rpc_failure(error) -> str:
    """A short one-line account of a failed health check (gRPC's details can run to several lines)."""
    details = (error.details() or "").splitlines()
    return f"{error.code().name}: {details[0][:200]}" if details else error.code().name
