"""`pagedserve serve`: runs the scheduler, one worker per tensor-parallel rank and the HTTP gateway (unless
--no-http) as separate processes and supervises them.

Tensor parallel (`--tensor-parallel-size N`, `-tp N`): N worker processes, rank r started with `--rank r
--world-size N`, on `cuda:r` (counted from --device's GPU) or all on the CPU, all given one
`--distributed-init-method tcp://127.0.0.1:PORT` (a free port, where rank 0 hosts the torch.distributed
rendezvous); the scheduler is told to wait for N workers (`--num-workers N`). A size the model's attention
heads or the visible GPUs do not allow is refused here, before any process starts or any weight loads. Every
rank is supervised like the others: any rank that exits stops the stack.

Data parallel (`--data-parallel-size N`, `-dp N`): N engines, each a scheduler with its own ranks as above, on
internal ports, behind one front process on the public gRPC address that routes each request to one engine
(engine_replicas.py says the layout and why; docs/scale_out.md). Each engine is supervised as the one engine
is alone: its worker and scheduler crashes are recovered within it, with restart budgets of its own; an
engine that gives up is stopped while another serves (the front re-routes its requests); the last engine
giving up, or the front exiting, stops the stack. With Ray, each engine's ranks are one placement group of
their own (ray_executor.py).

The model is resolved once here (a hub download happens once) and both children get the local path. The
launcher waits for the scheduler's health to turn SERVING, forwards SIGTERM/SIGINT to the scheduler (which
drains, then tells the worker to exit), and if any child dies on its own (the scheduler exits 1 when it
loses a worker), stops the others and exits 1 so a restart policy can bring the stack back. Children die
with the launcher (see service_runtime/service_process.py); a child still running 10 s after its SIGTERM is killed.

The API key (--api-key, else $PAGEDSERVE_API_KEY, else $VLLM_API_KEY) reaches the scheduler and the gateway
in their environment, never on their command lines, which every user of the host can read (`ps`).

The gateway is a gRPC client of the scheduler like any other; it is ready when its /health says the
scheduler is SERVING. On SIGTERM it is signalled together with the scheduler, so HTTP streams in flight
keep flowing while the scheduler drains them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from gateway.config import GatewayConfig
from pagedserve.engine_replicas import FRONT, EngineReplica, engine_replicas, front_argv, is_scheduler, is_worker
from pagedserve.free_port import free_port
from pagedserve.health_probe import grpc_serving, http_ok
from pagedserve.serve_checks import (keep_prefix_cache_exact, refuse_bad_text_options, refuse_unfit_data_parallel,
                                     refuse_unfit_tensor_parallel, refuse_unservable_adapters, resolve_draft_model,
                                     resolve_servable_model)
from scheduler_svc.config import CPU_MAX_NUM_BATCHED_TOKENS, GPU_MAX_NUM_BATCHED_TOKENS, SchedulerConfig
from scheduler_svc.main import CRASH_EXIT_CODE as SCHEDULER_CRASH_EXIT_CODE
from service_runtime.api_key_source import API_KEY_ENV, GRPC_API_KEY_ENV, api_key_from, child_environment
from service_runtime.api_key_source import open_bind_warning
from service_runtime.config_flags import config_argv, flag_values
from service_runtime.load_refusal import LOAD_REFUSED_EXIT_CODE
from service_runtime.worker_link_auth import WORKER_SECRET_ENV
from worker_svc.config import WorkerConfig
from worker_svc.cpu_placement import current_placement
from worker_svc.tensor_parallel_fit import rank_device

_POLL_SECONDS = 0.2
# Each role's package, whose `__main__` is that service's entry point.
SERVICE_MODULES = {"scheduler": "scheduler_svc", "worker": "worker_svc", "gateway": "gateway",
                   "front": "scheduler_svc.data_parallel"}


def warn_open_binds(args: argparse.Namespace, api_key: str | None) -> None:
    """Says so at start when --host (with HTTP) or --grpc-host binds past loopback with no API key
    (open_bind_warning). Here, not in each service's config: the launcher knows serve's flag names and
    warns once, before any child starts."""
    binds = {"--grpc-host": args.grpc_host, **({"--host": args.host} if args.enable_http else {})}
    warning = open_bind_warning(binds, api_key)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)


def serve(args: argparse.Namespace) -> int:
    api_key = api_key_from(args.api_key, os.environ)
    warn_open_binds(args, api_key)  # first: a hub download may take minutes
    if args.speculative_config is not None and args.batch_invariant:
        raise SystemExit("pagedserve: --speculative-config cannot go with --batch-invariant (docs/"
                         "speculative_decoding.md: a verification step is not covered by the batch-invariant kernels)")
    refuse_unservable_adapters(args)
    model = resolve_servable_model(args)  # downloads a hub model once, before either child looks for it
    refuse_unfit_tensor_parallel(args, model.path)
    refuse_unfit_data_parallel(args)
    resolve_draft_model(args, model.path)
    keep_prefix_cache_exact(args, model.path)
    refuse_bad_text_options(args, model.path)
    if args.max_scheduler_restarts < 0:
        raise SystemExit("pagedserve: --max-scheduler-restarts must be >= 0")
    model_argv = [] if args.model is None else ["--model", args.model]
    service_cpus = service_cpus_on_cpu(args)
    ray_groups = None
    if args.distributed_executor_backend == "ray":
        from pagedserve.ray_executor import ray_worker_groups

        ray_groups = ray_worker_groups(args.data_parallel_size, args.tensor_parallel_size,
                                       use_gpus=args.device.startswith("cuda"))
    with tempfile.TemporaryDirectory(prefix="pagedserve-") as private_dir, _shut_down_after(ray_groups):
        # With Ray, ranks on other hosts reach their scheduler over TCP, and rank 0's host for the rendezvous.
        ray_host = None if ray_groups is None else ray_groups[0].head_address()
        if ray_groups is None:
            address = args.worker_address or f"ipc://{os.path.join(private_dir, 'workers.sock')}"
        else:
            address = args.worker_address or f"tcp://{ray_host}:{free_port('')}"
        replicas = engine_replicas(args, private_dir, address, ray_host)
        # The worker link's shared secret: the one given, else a fresh one per start, in the children's
        # environment only. Set but empty: the link stays open (as under compose without one).
        given = os.environ.get(WORKER_SECRET_ENV)
        link_secret = {WORKER_SECRET_ENV: secrets.token_urlsafe(32) if given is None else given}
        children: dict[str, subprocess.Popen] = {}

        def start_engine(replica: EngineReplica, init_method: str | None) -> None:
            """One engine's scheduler and its rank set (`init_method`: their rendezvous, None for one rank)."""
            children[replica.scheduler] = _start("scheduler", _scheduler_argv(args, model_argv, replica.worker_address,
                                                                              replica),
                                                 child_environment({API_KEY_ENV: api_key, **link_secret}),
                                                 service_cpus)
            start_workers(replica, init_method)

        def start_workers(replica: EngineReplica, init_method: str | None) -> None:
            argvs = worker_rank_argvs(args, model_argv, replica.worker_address, init_method, replica.device,
                                      injects_fault=replica.index == 0)
            for rank, argv in enumerate(argvs):
                children[replica.worker(rank)] = (
                    _start("worker", argv, child_environment(link_secret)) if ray_groups is None
                    else ray_groups[replica.index].start(rank, argv, link_secret))

        def fresh_rendezvous() -> str | None:
            return f"tcp://127.0.0.1:{free_port()}" if args.tensor_parallel_size > 1 else None

        for replica in replicas:  # with Ray, each engine's rank 0 host holds its tensor-parallel rendezvous
            ray_rendezvous = ray_groups is not None and args.tensor_parallel_size > 1
            start_engine(replica, ray_groups[replica.index].rendezvous_address() if ray_rendezvous
                         else fresh_rendezvous())

        def restart_workers(replica: EngineReplica) -> None:
            """Worker crash recovery: the engine's whole rank set again (a new rendezvous for tensor parallel)."""
            start_workers(replica, fresh_rendezvous())

        def restart_engine(replica: EngineReplica) -> None:
            """Scheduler crash recovery: a new scheduler and a fresh rank set (the workers' KV cache belonged
            to the dead scheduler's block tables). The gateway and the front stay: streams resume on the new one."""
            _stop_all({name: child for name, child in children.items() if is_worker(name) and replica.owns(name)},
                      10.0)
            start_engine(replica, fresh_rendezvous())

        if len(replicas) > 1:
            children[FRONT] = _start("front", front_argv(args, model_argv, replicas),
                                     child_environment({API_KEY_ENV: api_key}), service_cpus)
        if args.enable_http:
            children["gateway"] = _start("gateway", _gateway_argv(args),
                                         child_environment({API_KEY_ENV: api_key, GRPC_API_KEY_ENV: api_key}),
                                         service_cpus)
        stop_requested = []
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda s, f: stop_requested.append(s))
        try:
            return _supervise(args, model.name, children, stop_requested, replicas,
                              restart_workers if ray_groups is None else None,
                              restart_engine if ray_groups is None else None,
                              None if ray_groups is None else lambda index: ray_groups[index].release())
        finally:
            _stop_all(children, args.shutdown_timeout)


def _supervise(args, model_name: str, children: dict[str, subprocess.Popen], stop_requested: list,
               replicas: list[EngineReplica], restart_workers=None, restart_engine=None,
               release_engine=None) -> int:
    """Until a stop is asked or a child dies; a worker that dies is restarted with the rest of its engine's rank
    set, up to --max-worker-restarts times per engine (the scheduler waits for them and resumes its requests),
    where `restart_workers` can (the mp backend). A worker that refused the model while loading it (exit code
    LOAD_REFUSED_EXIT_CODE, its reason in its one line above) is not: it would refuse again. A scheduler that
    crashed is restarted with fresh workers, up to --max-scheduler-restarts times per engine, where
    `restart_engine` can; the gateway, the front and SDK clients resume their streams on it
    (client/stream_resume.py). With several engines, an engine gone for good (its scheduler exited and is not
    restarted, or its workers' restarts are used up) is stopped and the others serve on; the front re-routes
    its requests (`release_engine(index)`, under Ray, gives its placement group's GPUs back). Anything else that
    exits (the last engine, the front, the gateway) stops the whole stack."""
    restarts_left = {replica.index: args.max_worker_restarts if restart_workers is not None else 0
                     for replica in replicas}
    scheduler_restarts_left = {replica.index: args.max_scheduler_restarts if restart_engine is not None else 0
                               for replica in replicas}
    target = _local_address(args.grpc_host, args.grpc_port)
    http_health = f"http://{_local_address(args.host, args.port)}/health" if args.enable_http else None
    ready_deadline = time.monotonic() + args.ready_timeout
    ready = False
    while True:
        if stop_requested:
            print("pagedserve: shutting down", file=sys.stderr, flush=True)
            for name, child in children.items():
                if is_scheduler(name) or name in (FRONT, "gateway"):
                    child.send_signal(signal.SIGTERM)
            codes = [_wait(children[replica.scheduler], args.shutdown_timeout + 10) for replica in replicas]
            for name in children:
                if is_worker(name):
                    _wait(children[name], 15)
            for name in (FRONT, "gateway"):
                if name in children:
                    _wait(children[name], args.shutdown_timeout + 10)
            return 0 if all(code == 0 for code in codes) else 1
        exited = [name for name, child in children.items() if child.poll() is not None]
        refused = [name for name in exited if is_worker(name) and children[name].returncode == LOAD_REFUSED_EXIT_CODE]
        if refused:
            print(f"pagedserve: cannot serve {model_name}: the {refused[0]} refused it while loading (the reason is "
                  "its line above); not restarting", file=sys.stderr, flush=True)
            return 1
        # Only a scheduler that had served: one that fails before (a port in use, a bad TLS file) fails again.
        crashed = [replica for replica in replicas if replica.scheduler in exited and ready
                   and scheduler_restarts_left[replica.index] > 0 and _crashed(children[replica.scheduler].returncode)]
        if crashed:
            replica = crashed[0]
            scheduler_restarts_left[replica.index] -= 1
            print(f"pagedserve: the {replica.scheduler} exited with code {children[replica.scheduler].returncode}; "
                  f"restarting it and the workers ({scheduler_restarts_left[replica.index]} restarts left)",
                  file=sys.stderr, flush=True)
            restart_engine(replica)
            ready, ready_deadline = False, time.monotonic() + args.ready_timeout
            continue
        broken = [replica for replica in replicas if any(replica.owns(name) for name in exited)]
        gone = [replica for replica in broken if replica.scheduler in exited
                or restarts_left[replica.index] == 0 or restart_workers is None]
        if exited and ready and gone and len(gone) < len(replicas) and all(
                any(replica.owns(name) for replica in broken) for name in exited):
            for replica in gone:
                _retire_engine(replica, children, exited)
                if release_engine is not None:
                    release_engine(replica.index)
            replicas = [replica for replica in replicas if replica not in gone]
            continue
        if (exited and all(is_worker(name) for name in exited)
                and all(restarts_left[replica.index] > 0 for replica in broken)):
            for replica in broken:
                restarts_left[replica.index] -= 1
                first = next(name for name in exited if replica.owns(name))
                print(f"pagedserve: the {first} exited with code {children[first].returncode}; restarting the "
                      f"workers ({restarts_left[replica.index]} restarts left)", file=sys.stderr, flush=True)
                _stop_all({name: child for name, child in children.items() if is_worker(name) and replica.owns(name)},
                          10.0)
                restart_workers(replica)
            continue
        for name in exited:
            print(f"pagedserve: the {name} exited with code {children[name].returncode}", file=sys.stderr, flush=True)
            return 1
        if not ready:
            ready = (grpc_serving(target, root_certificates=args.tls_cert_file)
                     and (http_health is None or http_ok(http_health)))
            if ready:
                http = f"; OpenAI API on {http_health.removesuffix('/health')}/v1" if http_health else ""
                engines = f" ({len(replicas)} engines)" if len(replicas) > 1 else ""
                print(f"pagedserve: serving {model_name} on {target}{engines}{http}", file=sys.stderr, flush=True)
            elif time.monotonic() > ready_deadline:
                print("pagedserve: not ready in time", file=sys.stderr, flush=True)
                return 1
        time.sleep(_POLL_SECONDS)


def _retire_engine(replica: EngineReplica, children: dict[str, subprocess.Popen], exited: list[str]) -> None:
    """An engine gone for good while others serve (-dp > 1): its processes stopped and forgotten; the front
    finds it lost and sends its requests that had no output yet to the others (engine_link.py)."""
    first = next(name for name in exited if replica.owns(name))
    print(f"pagedserve: the {first} exited with code {children[first].returncode}; engine {replica.index} is gone, "
          "the other engines serve on", file=sys.stderr, flush=True)
    own = {name: child for name, child in children.items() if replica.owns(name)}
    _stop_all(own, 10.0)
    for name in own:
        del children[name]


def _crashed(returncode: int) -> bool:
    """Whether a scheduler's exit was a crash (a signal, an unhandled exception), which a restart undoes, not
    its own decision to stop after losing its workers for good (exit 1)."""
    return returncode < 0 or returncode == SCHEDULER_CRASH_EXIT_CODE


@contextlib.contextmanager
def _shut_down_after(ray_groups):
    """Gives the Ray placement groups (and a local Ray instance this launcher started) back on the way out."""
    try:
        yield
    finally:
        if ray_groups is not None:
            from pagedserve.ray_executor import shut_down_ray

            shut_down_ray(ray_groups)


def _local_address(host: str, port: int) -> str:
    """Where this machine reaches a server bound to host:port (a wildcard bind is reached on loopback)."""
    return f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"


def _start(role: str, argv: list[str], env: dict[str, str], cpus: tuple[int, ...] | None = None) -> subprocess.Popen:
    """Runs the service through its own entry point (`python -m scheduler_svc ...`), which imports that
    service alone; pinned to `cpus` when given (right after its start, before its interpreter makes threads)."""
    child = subprocess.Popen([sys.executable, "-m", SERVICE_MODULES[role], "--exit-with-parent", *argv],
                             start_new_session=True, env=env)
    if cpus is not None:
        with contextlib.suppress(ProcessLookupError):  # exited already: the supervisor sees it
            os.sched_setaffinity(child.pid, cpus)
    return child


def service_cpus_on_cpu(args) -> tuple[int, ...] | None:
    """The cores the scheduler, gateway and front are pinned to when the workers compute on the CPU: those the
    workers' placement leaves free (worker_svc/cpu_placement.py, the same plan each rank finds), or None (a
    GPU, Ray, several engines, or no core to spare). Flags the allowed cores cannot meet are refused here,
    before any child starts."""
    if args.device.startswith("cuda") or args.distributed_executor_backend == "ray":
        return None
    try:
        placement = current_placement(args.cpu_omp_threads_bind, args.cpu_num_reserved_cpu, args.tensor_parallel_size)
    except ValueError as unmet:
        raise SystemExit(f"pagedserve: {unmet}") from None
    return placement.service_cpus if args.data_parallel_size == 1 else None


def _wait(child: subprocess.Popen, timeout: float) -> int | None:
    try:
        return child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _stop_all(children: dict[str, subprocess.Popen], timeout: float) -> None:
    for child in children.values():
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            child.send_signal(signal.SIGCONT)  # a stopped child (SIGSTOP) handles SIGTERM only once resumed
    for name, child in children.items():
        if _wait(child, timeout=min(timeout, 10.0)) is None:
            child.kill()
            child.wait()
        print(f"pagedserve: {name} exit code {child.returncode}", file=sys.stderr, flush=True)


def max_num_batched_tokens(args) -> int:
    """--max-num-batched-tokens, else the device's default (scheduler_svc/config.py says why they differ)."""
    if args.max_num_batched_tokens is not None:
        return args.max_num_batched_tokens
    return GPU_MAX_NUM_BATCHED_TOKENS if args.device.startswith("cuda") else CPU_MAX_NUM_BATCHED_TOKENS


def _scheduler_argv(args, model_argv: list[str], address: str, replica: EngineReplica | None = None) -> list[str]:
    """The scheduler's flags: every scheduler flag `serve` shares, forwarded from its declaration
    (scheduler_svc/config.py), and where it listens, binds and how many ranks it waits for, set here. The
    API key goes through the environment (child_environment); the flag is never forwarded. `replica`: one
    engine of several binds its own internal address (engine_replicas.py), not serve's public one."""
    values = flag_values(SchedulerConfig, args, shared_only=True)
    del values["model"]  # in model_argv: the path resolved once, as the workers get it
    host, port = (args.grpc_host, args.grpc_port) if replica is None else (replica.host, replica.port)
    values.update(host=host, port=port, worker_address=address,
                  num_workers=args.tensor_parallel_size, max_num_batched_tokens=max_num_batched_tokens(args))
    return [*model_argv, *config_argv(SchedulerConfig, values)]


def rank_devices(args, first_device: str | None = None) -> list[str]:
    """Each rank's --device. mp: rank r on the r-th GPU from `first_device` (--device's by default: cuda:r), or
    the CPU. ray: each rank on the one GPU Ray gave its actor (its `cuda`), or the CPU."""
    size = args.tensor_parallel_size
    if args.distributed_executor_backend == "ray":
        return ["cuda" if args.device.startswith("cuda") else "cpu"] * size
    return [rank_device(first_device or args.device, rank) for rank in range(size)]


def worker_rank_argvs(args, model_argv: list[str], address: str, init_method: str | None,
                      first_device: str | None = None, injects_fault: bool = True) -> list[list[str]]:
    """Each rank's worker command line: the same flags, its own --rank and device, one rendezvous. With several
    engines, `first_device` is the engine's first GPU and only engine 0 gets the fault-injection flags
    (`injects_fault`)."""
    size = args.tensor_parallel_size
    devices = rank_devices(args, first_device)
    if size == 1:
        return [_worker_argv(args, model_argv, address, devices[0], injects_fault)]
    return [_worker_argv(args, model_argv, address, devices[rank], injects_fault and rank == size - 1,
                         rank=rank, world_size=size, distributed_init_method=init_method)
            for rank in range(size)]


def _worker_argv(args, model_argv: list[str], address: str, device: str, injects_fault: bool = True,
                 **place: Any) -> list[str]:
    """One worker's flags: every worker flag `serve` shares (hidden fault injection included), forwarded
    from its declaration (worker_svc/config.py), with its address, device and place in the rank set (`place`:
    rank, world size and rendezvous, written even at rank 0) set here. `injects_fault`: whether this rank
    gets the fault-injection flags (tests): the last rank, so that with several ranks the fault is a non-zero
    rank's."""
    values = flag_values(WorkerConfig, args, shared_only=True)
    # --quantization is serve's vLLM flag (vllm_flags.py: other values refused with the reason), not a shared one.
    values.update(scheduler_address=address, device=device, quantization=args.quantization, **place)
    if not injects_fault:
        values.update(fail_at_step=None, crash_on_token_id=None, crash_at_output_token=None)
    return [*model_argv, *config_argv(WorkerConfig, values, keep_defaults=place.keys())]


def _gateway_argv(args) -> list[str]:
    """The gateway's flags: every gateway flag `serve` shares, forwarded from its declaration
    (gateway/config.py), and the scheduler to reach, where to listen and how long to drain, set here from
    serve's own flags. The API keys go through the environment."""
    values = flag_values(GatewayConfig, args, shared_only=True)
    values.update(grpc_target=_local_address(args.grpc_host, args.grpc_port), host=args.host, port=args.port,
                  shutdown_timeout=args.shutdown_timeout, grpc_root_cert=args.tls_cert_file)
    return config_argv(GatewayConfig, values)
