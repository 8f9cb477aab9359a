"""The CPU worker's core placement (worker_svc/cpu_placement.py): which cores each rank's torch threads are
pinned to, how many threads, and which cores the scheduler and gateway keep, from the allowed cores and
vLLM's two knobs; and the knobs' flags (environment defaults, forwarding by `serve`)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service_runtime.config_flags import config_argv, flag_values
from worker_svc.config import WorkerConfig, add_worker_arguments, worker_config_from_args
from worker_svc.cpu_placement import CpuPlacement, parse_cpu_list, plan_cpu_placement


def test_two_cores_one_rank_computes_on_one_and_leaves_the_other_to_the_services():
    assert plan_cpu_placement([0, 1], "auto", None, 1) == CpuPlacement(((1,),), (1,), (0,))


def test_one_core_is_shared_without_reservation():
    assert plan_cpu_placement([3], "auto", None, 1) == CpuPlacement(((3,),), (1,), None)


def test_auto_splits_the_unreserved_cores_between_ranks_and_never_oversubscribes():
    placement = plan_cpu_placement(range(8), "auto", None, 2)
    assert placement.rank_cpus == ((1, 2, 3), (4, 5, 6))
    assert placement.service_cpus == (0, 7)  # the reserved core and the one the split left over
    for allowed in (range(1, 2), range(2), range(3), range(5), range(16)):
        for world_size in (1, 2, 3):
            if len(allowed) < world_size:
                continue
            plan = plan_cpu_placement(allowed, "auto", None, world_size)
            used = [cpu for cpus in plan.rank_cpus for cpu in cpus]
            assert sum(plan.rank_threads) == len(used) <= len(allowed)
            assert len(set(used)) == len(used) and set(used) <= set(allowed)
            assert not set(used) & set(plan.service_cpus or ())


def test_reserved_count_is_honoured_and_refused_when_it_leaves_a_rank_no_core():
    assert plan_cpu_placement([4, 5, 6, 7], "auto", 2, 1).rank_cpus == ((6, 7),)
    assert plan_cpu_placement([0, 1], "auto", 0, 1) == CpuPlacement(((0, 1),), (2,), None)
    with pytest.raises(ValueError, match="fewer than one per rank"):
        plan_cpu_placement([0, 1], "auto", 2, 1)


def test_nobind_pins_nothing_but_sizes_threads_to_the_unreserved_cores():
    assert plan_cpu_placement(range(4), "nobind", None, 1) == CpuPlacement(None, (3,), None)
    assert plan_cpu_placement(range(4), "nobind", 0, 2) == CpuPlacement(None, (2, 2), None)
    # More ranks than cores: nothing is pinned, so they share the cores, one thread each (auto refuses this).
    assert plan_cpu_placement(range(2), "nobind", None, 3) == CpuPlacement(None, (1, 1, 1), None)
    with pytest.raises(ValueError, match="fewer than one per rank"):
        plan_cpu_placement(range(2), "auto", None, 3)


def test_listed_cores_per_rank_and_the_rest_for_the_services():
    assert plan_cpu_placement(range(8), "0-2|4,5", None, 2) == CpuPlacement(((0, 1, 2), (4, 5)), (3, 2), (3, 6, 7))
    with pytest.raises(ValueError, match="not among"):
        plan_cpu_placement([0, 1], "1-2", None, 1)
    with pytest.raises(ValueError, match="2 ranks"):
        plan_cpu_placement(range(4), "0-1", None, 2)
    with pytest.raises(ValueError, match="two ranks"):
        plan_cpu_placement(range(4), "0-1|1-2", None, 2)


def test_cpu_list_syntax():
    assert parse_cpu_list("0-3,6") == (0, 1, 2, 3, 6)
    for bad in ("", "a", "3-1", "0,0", "1-", "0,,1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def _parse(argv, monkeypatch, environ):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, shared_only=False)
    return parser.parse_args(argv)


def test_flags_default_to_vllms_environment_variables_and_serve_forwards_them(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    config = worker_config_from_args(_parse([], monkeypatch, {}))
    assert (config.cpu_omp_threads_bind, config.cpu_num_reserved_cpu) == ("auto", None)
    args = _parse([], monkeypatch, {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3", "VLLM_CPU_NUM_OF_RESERVED_CPU": "2"})
    config = worker_config_from_args(args)
    assert (config.cpu_omp_threads_bind, config.cpu_num_reserved_cpu) == ("0-1|2-3", 2)
    argv = config_argv(WorkerConfig, flag_values(WorkerConfig, args, shared_only=True))
    assert argv[argv.index("--cpu-omp-threads-bind") + 1] == "0-1|2-3"
    assert argv[argv.index("--cpu-num-reserved-cpu") + 1] == "2"
    with pytest.raises(SystemExit):
        _parse(["--cpu-omp-threads-bind", "0-x"], monkeypatch, {})


def test_a_worker_process_pins_itself_to_its_rank_and_sizes_torch_to_it():
    """In a fresh process (pinning is process-wide): affinity and torch's threads are the plan's for rank 0."""
    code = ("import os, json, torch\n"
            "from worker_svc.cpu_placement import current_placement, place_worker\n"
            "plan = current_placement('auto', None, 1)\n"
            "place_worker('auto', None, 0, 1)\n"
            "torch.ones(64, 64) @ torch.ones(64, 64)\n"
            "print(json.dumps([sorted(os.sched_getaffinity(0)), torch.get_num_threads(),"
            " list(plan.rank_cpus[0]), plan.rank_threads[0]]))\n")
    environ = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=environ,
                         cwd=Path(__file__).resolve().parent.parent).stdout
    affinity, threads, planned_cpus, planned_threads = json.loads(out.splitlines()[-1])
    assert affinity == planned_cpus and threads == planned_threads == len(planned_cpus)
    assert len(affinity) < len(os.sched_getaffinity(0)) or len(affinity) == 1  # a core left over when there is one


def test_serve_pins_its_services_only_for_cpu_workers_and_refuses_unmeetable_flags():
    from pagedserve.launcher import service_cpus_on_cpu

    def serve_args(**changes):
        values = dict(device="cpu", distributed_executor_backend="mp", cpu_omp_threads_bind="auto",
                      cpu_num_reserved_cpu=None, tensor_parallel_size=1, data_parallel_size=1)
        return argparse.Namespace(**{**values, **changes})

    allowed = sorted(os.sched_getaffinity(0))
    expected = plan_cpu_placement(allowed, "auto", None, 1).service_cpus
    assert service_cpus_on_cpu(serve_args()) == expected
    assert service_cpus_on_cpu(serve_args(device="cuda")) is None
    assert service_cpus_on_cpu(serve_args(cpu_omp_threads_bind="nobind")) is None
    assert service_cpus_on_cpu(serve_args(data_parallel_size=2)) is None  # engines' ranks would share the plan
    with pytest.raises(SystemExit, match="allowed"):
        service_cpus_on_cpu(serve_args(cpu_num_reserved_cpu=len(allowed)))
