"""Real `pagedserve serve` processes for end-to-end tests and benchmarks: start on a free loopback port, wait
until SERVING, and on exit stop with SIGTERM and prove a clean shutdown (exit code 0, no child process left).

For your own tests too:

    from pagedserve.testing.server_harness import running_server

    with running_server(tmp_path, "--model", "path/to/model", "--max-model-len", "512") as server:
        with server.client() as client:
            print(client.generate("Hello", max_tokens=8, temperature=0).text)

The HTTP gateway is off (`--no-http`) unless a test asks for it with `http=True`, which gives it a free
port of its own: the default port 8000 would collide between servers, and most tests speak gRPC only."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import Client
from client.channel import channel_credentials
from pagedserve.free_port import free_port  # noqa: F401 (tests import it from here)
from pagedserve.health_probe import http_ok

# The directory that holds the packages (a checkout, or site-packages): servers start there, so `python -m
# pagedserve` finds this copy of the code.
REPO_ROOT = Path(__file__).resolve().parents[2]
# The step budget servers get unless a test gives one: the GPU default, under which every test was written
# (the CPU default, sized for the embedded model's step time, would chunk tiny models' prompts for nothing).
TEST_MAX_NUM_BATCHED_TOKENS = 2048


class ServerProcess:
    def __init__(self, process: subprocess.Popen, port: int, log_path: Path, http_port: int | None = None,
                 client_options: dict | None = None):
        self.process = process
        # Client keywords the server's access flags need (api_key, root_certificates).
        self.client_options = client_options or {}
        self.port = port
        self.target = f"127.0.0.1:{port}"
        self.log_path = log_path
        self.http_port = http_port
        # The gateway's root URL (OpenAI clients take base_url = this + "/v1"); None without a gateway.
        self.http_url = None if http_port is None else f"http://127.0.0.1:{http_port}"
        self.children: list[int] = []  # pids of every process it started, once SERVING

    def client(self, **options) -> Client:
        return Client(self.target, **{**self.client_options, **options})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_all_blocks_free(self, timeout: float = 10.0):
        """Returns the stats once every KV and swap block is free again (aborts are processed async)."""
        with self.client() as client:
            deadline = time.monotonic() + timeout
            while True:
                stats = client.stats()
                free = (stats.num_free_kv_blocks == stats.num_kv_blocks
                        and stats.num_free_swap_blocks == stats.num_swap_blocks
                        and stats.num_running + stats.num_waiting + stats.num_swapped == 0)
                if free or time.monotonic() > deadline:
                    return stats
                time.sleep(0.05)


def _wait_serving(server: ServerProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    credentials = channel_credentials(server.client_options.get("root_certificates"))
    if credentials is None:
        channel = grpc.insecure_channel(server.target)
    else:
        channel = grpc.secure_channel(server.target, credentials)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()[-4000:]}")
            try:
                if (stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING
                        and _http_ready(server)):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"server not SERVING within {timeout}s:\n{server.log()[-4000:]}")


def _http_ready(server: ServerProcess) -> bool:
    return server.http_url is None or http_ok(f"{server.http_url}/health")


def descendants(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(entry))
    return children + [d for child in children for d in descendants(child)]


@contextlib.contextmanager
def running_server(tmp_dir: Path, *args: str, http: bool = False, ready_timeout: float = 180.0,
                   client_options: dict | None = None, env: dict[str, str] | None = None):
    """Runs `pagedserve serve ARGS` and yields a ServerProcess; asserts a clean SIGTERM shutdown after.
    `http=True` starts the gateway on a free port (ServerProcess.http_url) and waits for its /health too.
    `client_options`: what a Client needs to get in (api_key, root_certificates) when ARGS guard the server.
    `env`: variables added to the server's environment (PAGEDSERVE_API_KEY, ...)."""
    with launched_server(tmp_dir, *args, http=http, ready_timeout=ready_timeout,
                         client_options=client_options, env=env) as server:
        yield server
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=60)
        assert code == 0, f"serve exited with {code}:\n{server.log()[-4000:]}"
        assert_all_gone(server.children)


@contextlib.contextmanager
def launched_server(tmp_dir: Path, *args: str, http: bool = False, ready_timeout: float = 180.0,
                    client_options: dict | None = None, env: dict[str, str] | None = None):
    """Runs `pagedserve serve ARGS` and yields a SERVING ServerProcess (whose `children` are its child pids),
    asserting nothing about how it ends; kills it if it still runs after."""
    port = free_port()
    http_port = free_port() if http else None
    http_args = ["--port", str(http_port)] if http else ["--no-http"]
    if "--max-num-batched-tokens" not in args:  # the tests' budget: tiny models, whatever the CPU default
        http_args += ["--max-num-batched-tokens", str(TEST_MAX_NUM_BATCHED_TOKENS)]
    log_path = Path(tmp_dir) / f"server-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "pagedserve", "serve", "--grpc-port", str(port), *http_args, *args],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=None if env is None else {**os.environ, **env},
        )
    server = ServerProcess(process, port, log_path, http_port, client_options)
    try:
        _wait_serving(server, ready_timeout)
        server.children = descendants(process.pid)
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def assert_all_gone(pids: list[int], timeout: float = 1.0) -> None:
    """Every process of `pids` has exited (zombies count as gone), within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (left := [pid for pid in pids if is_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left running: {left}"


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def running_gateway(tmp_dir: Path, grpc_target: str, *args: str, ready_timeout: float = 60.0):
    """Runs `pagedserve gateway --grpc-target TARGET ARGS` on a free port and yields its root URL once it
    answers HTTP (whatever its /health says); asserts a clean SIGTERM shutdown after."""
    port = free_port()
    log_path = Path(tmp_dir) / f"gateway-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "pagedserve", "gateway", "--grpc-target", grpc_target, "--port", str(port), *args],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while not _answers_http(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway not up (exit {process.poll()}):\n{log_path.read_text(errors='replace')[-4000:]}")
            time.sleep(0.1)
        yield url
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
        assert code == 0, f"gateway exited with {code}:\n{log_path.read_text(errors='replace')[-4000:]}"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _answers_http(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # an HTTP answer, even 503, means the gateway is up
    except (urllib.error.URLError, OSError):
        return False


def http_json(url: str, body: dict | bytes | None = None, headers: dict | None = None):
    """GET (body None) or POST `url`; returns (status, headers (case-insensitive), decoded JSON body)
    whatever the status."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, error.headers, json.loads(error.read())
