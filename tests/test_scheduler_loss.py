"""A worker whose scheduler is gone exits by itself within 15 s, as separate processes with no launcher to
clean up (docker compose runs them so): killed, the scheduler's connection closes; stopped, only its
heartbeats stop. Either way the worker exits non-zero, for its restart policy. And a `pagedserve serve`
killed with SIGKILL leaves no child behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from pagedserve.testing.server_harness import REPO_ROOT, assert_all_gone, free_port, launched_server
from pagedserve.testing.tiny_models import make_tiny_model

SCHEDULER_LOSS_BOUND_S = 15.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=5)


@contextlib.contextmanager
def separate_processes(model, tmp_path):
    """`pagedserve scheduler` and `pagedserve worker` started on their own; yields both once SERVING."""
    port, worker_address = free_port(), f"tcp://127.0.0.1:{free_port()}"
    log = open(tmp_path / "stack.log", "wb")
    started = []
    try:
        for argv in (["scheduler", "--port", str(port), "--worker-address", worker_address],
                     ["worker", "--scheduler-address", worker_address, "--num-kv-blocks", "64"]):
            started.append(subprocess.Popen([sys.executable, "-m", "pagedserve", *argv, "--model", str(model)],
                                            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT))
        from client import Client

        with Client(f"127.0.0.1:{port}") as client:
            client.wait_ready(timeout=180)
        yield started
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
        log.close()


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_the_worker_exits_nonzero_within_15_s_of_losing_its_scheduler(model, tmp_path, signum):
    with separate_processes(model, tmp_path) as (scheduler, worker):
        os.kill(scheduler.pid, signum)
        lost_at = time.monotonic()
        code = worker.wait(timeout=SCHEDULER_LOSS_BOUND_S + 10)
        took = time.monotonic() - lost_at
        assert code != 0
        assert took <= SCHEDULER_LOSS_BOUND_S, f"the worker took {took:.1f} s to exit"
        assert "the scheduler sent nothing" in (tmp_path / "stack.log").read_text(errors="replace")


def test_a_killed_launcher_leaves_no_process_behind(model, tmp_path):
    with launched_server(tmp_path, "--model", str(model), "--num-kv-blocks", "64") as server:
        server.process.kill()
        server.process.wait()
        assert_all_gone(server.children, timeout=SCHEDULER_LOSS_BOUND_S)
