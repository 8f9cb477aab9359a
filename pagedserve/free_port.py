"""A TCP port that is free now, for the servers and rendezvous the launcher, the offline LLM, the demo and
the test harness start (the process that binds it does so moments later, as vLLM picks its ports)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` ("" for every interface: a rendezvous other hosts reach)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
