"""Access control through the real processes: `pagedserve serve --api-key K --tls-cert-file C --tls-key-file K`
with a self-signed certificate made here. Calls without the key or with another one get UNAUTHENTICATED
(health stays open), plaintext gets nowhere, the SDK with key and certificate generates, the HTTP gateway
forwards the key over TLS to the scheduler, and a default start listens on loopback only."""

from __future__ import annotations

import ipaddress
import struct
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import Client, PagedServeError
from client.channel import channel_credentials
from pagedserve.testing.server_harness import REPO_ROOT, http_json, running_server
from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import generate_pb2, generate_pb2_grpc

API_KEY = "s3cret-key"


def _self_signed_certificate(directory) -> tuple[str, str]:
    cert, key = str(directory / "cert.pem"), str(directory / "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )
    return cert, key


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    return _self_signed_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=5)


@pytest.fixture(scope="module")
def server(tmp_path_factory, certificate, model):
    cert, key = certificate
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model), "--max-model-len", "128",
                        "--api-key", API_KEY, "--tls-cert-file", cert, "--tls-key-file", key, http=True,
                        client_options=dict(api_key=API_KEY, root_certificates=cert)) as running:
        yield running


@pytest.mark.parametrize("api_key", [None, "wrong-key", API_KEY[:-1]], ids=["missing", "wrong", "prefix"])
def test_calls_without_the_right_key_are_unauthenticated(server, api_key):
    with server.client(api_key=api_key) as client:
        for call in (lambda: client.generate([1, 2, 3], max_tokens=2), client.model_info, client.stats,
                     lambda: client.abort("nobody")):
            with pytest.raises(PagedServeError) as refused:
                call()
            assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert API_KEY not in refused.value.details


def test_the_key_may_come_as_x_api_key_metadata(server, certificate):
    with grpc.secure_channel(server.target, channel_credentials(certificate[0])) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        info = stub.ModelInfo(generate_pb2.ModelInfoRequest(), metadata=(("x-api-key", API_KEY),), timeout=10)
    assert info.max_model_len == 128


def test_health_needs_no_key(server, certificate):
    with grpc.secure_channel(server.target, channel_credentials(certificate[0])) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_right_key_over_tls_generates(server):
    with server.client() as client:
        result = client.generate([1, 2, 3], max_tokens=5, temperature=0.0, ignore_eos=True)
    assert len(result.token_ids) == 5


def test_plaintext_gets_nowhere(server):
    with Client(server.target, api_key=API_KEY, timeout=5) as client:
        with pytest.raises(PagedServeError) as refused:
            client.model_info()
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE


def test_the_gateway_forwards_the_key_to_the_scheduler_over_tls(server):
    body = {"model": None, "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
    status, _, refused = http_json(f"{server.http_url}/v1/completions", body)
    assert status == 401, refused
    status, _, answer = http_json(f"{server.http_url}/v1/completions", body, {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 4


def _listening_addresses(port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The local addresses of the LISTEN sockets on `port`, read from /proc/net/tcp and tcp6 (which print
    each 32-bit word of the address as the host reads it: packing them back in native order restores it)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                address_hex, port_hex = fields[1].rsplit(":", 1)
                if fields[3] != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                    continue
                words = [int(address_hex[i:i + 8], 16) for i in range(0, len(address_hex), 8)]
                packed = b"".join(struct.pack("=I", word) for word in words)
                found.append(ipaddress.ip_address(packed))
    return found


def _is_loopback(address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)  # gRPC listens on ::ffff:127.0.0.1 for 127.0.0.1
    return (mapped or address).is_loopback


def test_a_default_start_listens_on_loopback_only(server):
    for port in (server.port, server.http_port):
        addresses = _listening_addresses(port)
        assert addresses and all(_is_loopback(address) for address in addresses), (port, addresses)


def test_a_second_scheduler_on_a_port_in_use_fails_instead_of_sharing_it(server, model, tmp_path):
    second = subprocess.run(
        [sys.executable, "-m", "pagedserve", "scheduler", "--model", str(model), "--port", str(server.port),
         "--worker-address", f"ipc://{tmp_path}/workers.sock"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert second.returncode != 0
    assert "bind" in (second.stdout + second.stderr).lower()
