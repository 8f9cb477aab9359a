"""Authentication of the scheduler <-> worker ZeroMQ link: CURVE keys derived from one shared secret.

Why: over TCP (separate hosts, docker compose, Ray) anyone who reaches the scheduler's worker port could say
hello and be taken for a worker, be sent every prompt and answer with tokens of its own. With a secret in both
services' environment (`PAGEDSERVE_WORKER_SECRET`; never a flag, which `ps` shows every user of the host), the
link is CURVE-encrypted and the scheduler accepts only peers that prove they hold the secret: both key pairs
derive from it, so there is nothing else to distribute. `pagedserve serve` draws a fresh secret for its
children on every start. Without a secret the link is open, as before (the scheduler warns when it listens on
TCP beyond this host).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import zmq
from zmq.utils import z85

WORKER_SECRET_ENV = "PAGEDSERVE_WORKER_SECRET"


@dataclass(frozen=True)
class LinkKeys:
    """The scheduler's (server) and the workers' (client) CURVE key pairs, Z85-encoded."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def link_keys(secret: str) -> LinkKeys:
    def pair(role: str) -> tuple[bytes, bytes]:
        secret_key = z85.encode(hashlib.sha256(f"pagedserve-worker-link-{role}:{secret}".encode()).digest())
        return zmq.curve_public(secret_key), secret_key

    server_public, server_secret = pair("scheduler")
    client_public, client_secret = pair("worker")
    return LinkKeys(server_public, server_secret, client_public, client_secret)


def link_keys_from(environ: Mapping[str, str]) -> LinkKeys | None:
    secret = environ.get(WORKER_SECRET_ENV)
    return link_keys(secret) if secret else None


def secure_worker_socket(socket: zmq.Socket, keys: LinkKeys) -> None:
    """A worker's DEALER: it must know the scheduler's key, and proves it holds the workers' (before connect)."""
    socket.curve_serverkey = keys.server_public
    socket.curve_publickey = keys.client_public
    socket.curve_secretkey = keys.client_secret


class OnlyWorkers:
    """ZAP credentials check of the scheduler's authenticator: the workers' public key and no other."""

    def __init__(self, keys: LinkKeys):
        self._allowed = keys.client_public

    def callback(self, domain: str, client_key: bytes) -> bool:
        return client_key == self._allowed
