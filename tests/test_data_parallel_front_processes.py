"""Several data-parallel front processes on one port (`--api-server-count`, front_processes.py) before two
stand-in schedulers (fake_generation_server.py): connections spread over the processes and requests reach both
engines; a prompt prefix reaches one engine whichever process takes it; a process that dies stops the rest and
the supervisor says so with its exit code; SIGTERM stops them all cleanly; the flags refuse what cannot work.
And `bench serve --num-client-processes` (client_processes.py): the processes together send every request and
hand back every outcome in order. The lone front: tests/test_data_parallel_router.py."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from pagedserve.bench.client_processes import concurrency_shares, send_from_processes
from pagedserve.bench.request_outcome import RequestInput
from pagedserve.bench.serve import ServeTarget, add_arguments
from pagedserve.engine_replicas import data_parallel_refusal
from pagedserve.free_port import free_port
from pagedserve.health_probe import grpc_serving
from pagedserve.testing.server_harness import REPO_ROOT
from protos.pagedserve.v1 import generate_pb2

NUM_CONNECTIONS = 16  # the kernel hashes each to a process: all 16 on one of 2 has odds 2**-15
GENERATE = "/pagedserve.v1.Generation/Generate"




def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.fixture
def fronts(engines, tmp_path):
    """Starts `--api-server-count 2` with the policy given; returns (target, supervisor, log path) once both
    processes listen. Stops what is still running with SIGTERM."""
    started = []

    def start(policy: str, *flags: str) -> tuple[str, subprocess.Popen, Path]:
        for engine in engines:
            engine.reset()
        port = free_port()
        log_path = tmp_path / f"fronts-{port}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen([sys.executable, "-m", "scheduler_svc.data_parallel", "--grpc-port", str(port),
                                        "--api-server-count", "2", "--router-policy", policy, *flags,
                                        "--engine-targets", *(engine.target for engine in engines)],
                                       cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        started.append(process)
        target = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while not (grpc_serving(target) and log_path.read_text().count("gRPC listening") == 2):
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        return target, process, log_path

    yield start
    for process in started:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=30)


def _connections(target: str) -> list[grpc.Channel]:
    """Channels of their own connection each (a local subchannel pool: else one target shares one connection)."""
    return [grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(NUM_CONNECTIONS)]


def _generate(channel: grpc.Channel, request: generate_pb2.GenerateRequest) -> list[generate_pb2.GenerateResponse]:
    call = channel.unary_stream(GENERATE, response_deserializer=generate_pb2.GenerateResponse.FromString)
    return list(call(request.SerializeToString(), timeout=10))


def _routed_by_the_answering_process(channel: grpc.Channel) -> int:
    stats = generate_pb2.GetStatsResponse.FromString(
        channel.unary_unary("/pagedserve.v1.Generation/GetStats")(b"", timeout=10))
    return sum(engine.routed_requests for engine in stats.engines)


def test_connections_spread_over_the_front_processes_and_requests_reach_both_engines(engines, fronts):
    target, _, _ = fronts("round-robin")
    channels = _connections(target)
    for channel in channels:
        for _ in range(2):
            responses = _generate(channel, generate_pb2.GenerateRequest(text="hello"))
            assert "".join(response.text for response in responses) == "Hello world"
    total = 2 * NUM_CONNECTIONS
    assert [len(engine.generation.requests) for engine in engines] == [total // 2, total // 2]  # each alternates
    # GetStats answers from the process that owns the connection: its own router's counts, short of the total
    # when the other process took some connections.
    routed = [_routed_by_the_answering_process(channel) for channel in channels]
    assert max(routed) < total and set(routed) <= {2 * share for share in range(1, NUM_CONNECTIONS)}, routed
    for channel in channels:
        channel.close()


def test_a_prompt_prefix_reaches_one_engine_whichever_front_process_takes_it(engines, fronts):
    target, _, _ = fronts("prefix")
    channels = _connections(target)
    shared_head = list(range(100, 116))  # one KV block: the prefix key (prefix_key.py)
    for index, channel in enumerate(channels):
        _generate(channel, generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[*shared_head, index])))
    counts = [len(engine.generation.requests) for engine in engines]
    assert sorted(counts) == [0, NUM_CONNECTIONS], counts  # rendezvous hashing: the same engine in every process
    for index, channel in enumerate(channels):  # different heads spread over both engines
        _generate(channel, generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[index] * 17)))
    assert all(len(engine.generation.requests) > count for engine, count in zip(engines, counts))
    for channel in channels:
        channel.close()


def test_a_front_process_that_dies_stops_the_others_and_the_supervisor_fails(fronts):
    target, supervisor, log_path = fronts("round-robin")
    first, second = _children(supervisor.pid)
    os.kill(first, signal.SIGKILL)
    assert supervisor.wait(timeout=30) != 0
    assert not Path(f"/proc/{second}").exists() or "zombie" in Path(f"/proc/{second}/status").read_text()
    assert "exited with code -9: stopping the others" in log_path.read_text()


def test_sigterm_stops_every_front_process_cleanly(fronts):
    target, supervisor, _ = fronts("least-load")
    children = _children(supervisor.pid)
    supervisor.terminate()
    assert supervisor.wait(timeout=30) == 0
    assert all(not Path(f"/proc/{child}").exists() for child in children)


def _front(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scheduler_svc.data_parallel", *flags], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


def test_the_front_refuses_a_bad_count_port_0_and_a_port_another_server_holds():
    refused = _front("--api-server-count", "0", "--engine-targets", "127.0.0.1:1")
    assert refused.returncode != 0 and "--api-server-count must be >= 1, not 0" in refused.stderr
    refused = _front("--api-server-count", "2", "--grpc-port", "0", "--engine-targets", "127.0.0.1:1")
    assert refused.returncode != 0 and "--api-server-count > 1 needs a fixed --grpc-port" in refused.stderr
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        refused = _front("--api-server-count", "2", "--grpc-port", str(port), "--engine-targets", "127.0.0.1:1")
    assert refused.returncode != 0 and f"--grpc-port {port}: already in use" in refused.stderr


def test_serve_refuses_an_api_server_count_without_a_front():
    def refusal(size: int, count: int) -> str | None:
        return data_parallel_refusal(argparse.Namespace(
            data_parallel_size=size, tensor_parallel_size=1, device="cpu", distributed_executor_backend="mp",
            worker_address=None, allow_runtime_lora_updating=False, tls_cert_file=None, api_server_count=count), None)

    assert "--api-server-count > 1 needs --data-parallel-size > 1" in refusal(1, 2)
    assert "--api-server-count must be >= 1" in refusal(2, 0)
    assert refusal(2, 4) is None and refusal(1, 1) is None


# ---- bench serve --num-client-processes ----------------------------------------------------------------------

def _bench_flags(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--backend", "grpc", *flags])


def test_bench_serve_refuses_client_processes_it_cannot_use():
    for flags, message in ((["--num-client-processes", "0"], "--num-client-processes must be at least 1"),
                           (["--num-client-processes", "2", "--dataset-name", "multi-turn"], "multi-turn"),
                           (["--num-client-processes", "4", "--max-concurrency", "3"],
                            "--max-concurrency 3 is below --num-client-processes 4")):
        with pytest.raises(ValueError, match=message):
            ServeTarget.from_args(_bench_flags(*flags))
    assert ServeTarget.from_args(_bench_flags("--num-client-processes", "4", "--max-concurrency", "4"))


def test_concurrency_is_split_between_the_client_processes():
    assert concurrency_shares(10, 4) == [3, 3, 2, 2]
    assert concurrency_shares(None, 3) == [None] * 3


def test_client_processes_send_every_request_and_return_every_outcome_in_order(engines):
    engine = engines[0]
    engine.reset()
    texts = ["hello", "invalid", "hello", "hello", "overloaded"]  # the stand-in fails "invalid" and "overloaded"
    inputs = [RequestInput("fake-model", text, 1, 5, False, {}) for text in texts]
    spec = {"backend": "grpc", "base_url": engine.target, "endpoint": "", "api_key": None}
    outcomes, duration, cpu = send_from_processes(spec, inputs, [0.0, 0.0, 0.05, 0.05, 0.1], None, 2)
    assert [outcome.success for outcome in outcomes] == [True, False, True, True, False]
    assert [outcome.generated_text for outcome in outcomes if outcome.success] == ["Hello world"] * 3
    assert sorted(request.text for request in engine.generation.requests) == sorted(texts)
    assert len(cpu) == 2 and all(seconds > 0 for seconds in cpu) and duration >= 0.1


def _established_to(port: int) -> int:
    """TCP connections of this machine in ESTABLISHED state whose remote end is port `port` (client sides), over
    IPv4 or IPv6 (gRPC may connect to 127.0.0.1 from an IPv6 socket)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and fields[2].endswith(f":{port:04X}"):
                count += 1
    return count


def test_clients_with_their_own_connection_open_one_each_and_others_share_one(engines):
    import asyncio

    from client import AsyncClient

    engine = engines[1]
    engine.reset()

    async def connections(own_connection: bool) -> int:
        clients = [AsyncClient(engine.target, max_retries=0, own_connection=own_connection) for _ in range(3)]
        for client in clients:
            assert (await client.generate("hello")).text == "Hello world"
        opened = _established_to(engine.port)
        for client in clients:
            await client.close()
        return opened

    assert asyncio.run(connections(True)) == 3
    assert asyncio.run(connections(False)) == 1


def test_a_front_process_killed_by_a_signal_exits_the_supervisor_as_a_shell_reports_it():
    from scheduler_svc.data_parallel.front_processes import _exit_status

    assert (_exit_status(-9), _exit_status(-15), _exit_status(3), _exit_status(0)) == (137, 143, 3, 1)
