"""Readiness probes, shared by `pagedserve serve` (waiting for its children) and `pagedserve health` (a
container health check: exit 0 when ready, 1 when not).

Why a subcommand and not curl in the health checks: the image then needs no extra tools, and the gRPC check
asks the standard gRPC health service, which no HTTP tool can.
"""

from __future__ import annotations

import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.channel import channel_credentials


def grpc_serving(target: str, timeout: float = 1.0, root_certificates: str | None = None) -> bool:
    """Whether the gRPC health service at `target` says SERVING (the scheduler's workers are loaded);
    over TLS trusting the PEM file `root_certificates` when given. Health needs no API key."""
    credentials = channel_credentials(root_certificates)
    channel = grpc.insecure_channel(target) if credentials is None else grpc.secure_channel(target, credentials)
    try:
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """Whether GET `url` answers 200 (the gateway's /health: its scheduler is SERVING)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False
