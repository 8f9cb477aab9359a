"""What a user sees in the logs of a healthy run, and of a model we refuse (issue 18 item 7).

Lines that read like faults in a healthy run train users to ignore real ones: a healthy start, a few
requests and a clean stop log no warning about strangers' heartbeats, no "slow step launch" on the CPU (where
every launch is the computation itself) and no extension teardown chatter. A model we cannot serve is refused
by the launcher in one line before any service starts, not by the worker's traceback after the scheduler and
the gateway are up.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time

import zmq

from pagedserve.testing.server_harness import REPO_ROOT, free_port, running_server
from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import worker_pb2
from worker_svc.scheduler_link import SchedulerLink

NOISE = ("peer that is no worker", "slow step launch", "nanobind", "leaked", "Traceback", "WARNING", "ERROR")


def test_a_short_serve_run_logs_no_noise(tmp_path):
    model = make_tiny_model(tmp_path / "model", "llama", seed=5)
    with running_server(tmp_path, "--model", str(model), "--heartbeat-interval", "0.2") as server:
        with server.client() as client:
            for prompt in ([1, 2, 3], [4, 5, 6, 7]):
                client.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
        time.sleep(1.0)  # a few heartbeat rounds after the requests
    log = server.log()
    assert "serving" in log and "worker rank 0 exit code 0" in log, log[-3000:]
    assert [line for line in log.splitlines() if any(noise in line for noise in NOISE)] == []


def test_the_first_frame_a_worker_sends_is_its_hello(tmp_path):
    """The worker's IO thread heartbeats from its start; a heartbeat ahead of the hello came from a peer the
    scheduler did not know yet, and was logged as a stranger's ("no worker") at most starts."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    address = f"ipc://{tmp_path / 'workers.sock'}"
    router.bind(address)
    link = SchedulerLink(address, b"rank-0", heartbeat_interval=0.05)
    try:
        time.sleep(0.5)  # ten heartbeat intervals before the hello (a slow model load ends just before it)
        link.send(worker_pb2.WorkerToScheduler(hello=worker_pb2.WorkerHello(rank=0, world_size=1)))
        kinds = []
        while len(kinds) < 3 and router.poll(2000):
            message = worker_pb2.WorkerToScheduler()
            message.ParseFromString(router.recv_multipart()[1])
            kinds.append(message.WhichOneof("kind"))
        assert kinds == ["hello", "heartbeat", "heartbeat"]
    finally:
        link.close()
        router.close(linger=0)
        context.term()


@contextlib.contextmanager
def _standalone_stack(tmp_path):
    """A scheduler and a worker started as separate services (as compose does), logging to one file; yields
    (scheduler, worker, client, log_path) once serving, and kills whatever still runs afterwards."""
    from client import Client

    model = make_tiny_model(tmp_path / "model", "llama", seed=5)
    port, worker_address = free_port(), f"tcp://127.0.0.1:{free_port()}"
    log_path = tmp_path / "stack.log"
    started = []
    with open(log_path, "wb") as log:
        try:
            # No worker restarts: a lost worker must end this stack (the killed-worker test below).
            for argv in (["scheduler", "--grpc-port", str(port), "--worker-address", worker_address,
                          "--max-worker-restarts", "0"],
                         ["worker", "--scheduler-address", worker_address, "--num-kv-blocks", "64"]):
                started.append(subprocess.Popen([sys.executable, "-m", "pagedserve", *argv, "--model", str(model)],
                                                cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT))
            with Client(f"127.0.0.1:{port}") as client:
                client.wait_ready(timeout=180)
                yield started[0], started[1], client, log_path
        finally:
            for process in started:
                if process.poll() is None:
                    process.kill()
                    process.wait()


def test_a_standalone_worker_signalled_first_leaves_with_its_draining_scheduler(tmp_path):
    """docker compose stop signals the worker before (or with) the scheduler: the worker serves on, the
    scheduler drains and shuts it down, and both exit 0 with no worker failure logged."""
    with _standalone_stack(tmp_path) as (scheduler, worker, client, log_path):
        worker.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert worker.poll() is None, "the worker left before its scheduler"
        assert len(client.generate([1, 2, 3], max_tokens=4, temperature=0.0, ignore_eos=True).token_ids) == 4
        scheduler.send_signal(signal.SIGTERM)
        assert scheduler.wait(timeout=60) == 0 and worker.wait(timeout=30) == 0
    log = log_path.read_text(errors="replace")
    assert "serving until the scheduler shuts this worker down" in log
    assert [line for line in log.splitlines() if any(noise in line for noise in NOISE)] == [], log[-3000:]


def test_a_worker_killed_mid_request_is_reported_without_a_traceback(tmp_path):
    """A worker's death is a fault and is logged as one (ERROR lines naming it), once, with no asyncio
    "Task exception was never retrieved" traceback after it."""
    with _standalone_stack(tmp_path) as (scheduler, worker, client, log_path):
        stream = client.generate_stream([1, 2, 3], max_tokens=400, temperature=0.0, ignore_eos=True)
        next(iter(stream))
        worker.kill()
        with contextlib.suppress(Exception):
            list(stream)
        assert scheduler.wait(timeout=60) == 1
    log = log_path.read_text(errors="replace")
    assert "worker rank 0 disconnected" in log
    assert "Traceback" not in log and "never retrieved" not in log, log[-3000:]


def _serve_refused(model_dir, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve", "serve", "--model", str(model_dir), "--no-http", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def assert_one_line_refusal(result: subprocess.CompletedProcess, *words: str) -> None:
    """`pagedserve serve` refused the model in one line naming `words`, before any service started."""
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedserve: cannot serve"), result.stderr
    assert all(word in lines[0] for word in words), lines[0]
    assert "gRPC listening" not in result.stderr + result.stdout  # no service started


def test_an_unsupported_architecture_is_refused_in_one_line_before_anything_starts(tmp_path):
    config = {"architectures": ["BertForMaskedLM"], "model_type": "bert", "auto_map": {"AutoModel": "custom.Model"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_one_line_refusal(_serve_refused(tmp_path), "unsupported architectures", "BertForMaskedLM")


def test_a_checkpoint_without_weights_is_refused_in_one_line(tmp_path):
    model = make_tiny_model(tmp_path / "model", "llama", seed=5)
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    assert_one_line_refusal(_serve_refused(model), "no .safetensors weights")


def test_exit_after_flush_keeps_the_output_and_skips_the_interpreter_teardown():
    """The worker's way out: what it logged is written, and teardown-time code (where nanobind prints its
    leak report) never runs."""
    script = ("import atexit, logging, sys\n"
              "from service_runtime.quiet_exit import exit_after_flush\n"
              "logging.basicConfig(level=logging.INFO)\n"
              "atexit.register(lambda: print('teardown ran', file=sys.stderr))\n"
              "logging.info('last words')\n"
              "print('buffered', end='')\n"
              "exit_after_flush(3)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    assert "last words" in result.stderr and result.stdout == "buffered"
    assert "teardown ran" not in result.stderr
