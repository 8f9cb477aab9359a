"""The engines of `pagedserve serve --data-parallel-size N` (`-dp N`) and the front before them: where each
engine's scheduler listens, where its workers connect, which GPUs its ranks take, what each child is called,
and the front's command line.

Design (issue 39, first slice): N engines, each a scheduler with its own worker ranks exactly as one engine
runs alone (tensor parallel inside it, its own crash recovery), and one front (scheduler_svc/data_parallel/)
on the public --grpc-host/--grpc-port serving the same gRPC API and routing each request to one engine; the
gateway talks to the front as it talks to a lone scheduler. Why a front process rather than routing inside
the gateway or the SDK: gRPC clients (the SDK, other services) get data parallelism too, and the gateway stays
one client of one address. Why separate engines rather than one scheduler over several worker groups: each
engine's prefix cache, queue and recovery stay exactly what they are alone; the front only picks one.

Layout: engine i's scheduler on 127.0.0.1 at a free port of its own (internal: only the front reaches it),
its workers on their own ipc socket (with Ray: a TCP port of its own, and a placement group of its own), its
M = --tensor-parallel-size ranks on GPUs i*M .. i*M+M-1 counted from --device's (or all on the CPU). With
N = 1 nothing changes: the one scheduler binds the public address, the children keep their names, and no
front starts.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from pagedserve.free_port import free_port
from scheduler_svc.data_parallel.config import FrontConfig
from service_runtime.config_flags import config_argv, flag_values
from worker_svc.tensor_parallel_fit import first_gpu_index, rank_device

FRONT = "front"


@dataclass(frozen=True)
class EngineReplica:
    """One engine: the address its scheduler binds, the one its workers connect to, its first rank's device and
    the prefix of its children's names ("" when it is the only engine, so names stay "scheduler" and "worker rank
    r"; "engine i " with several)."""

    index: int
    host: str
    port: int
    worker_address: str
    device: str
    name_prefix: str

    @property
    def scheduler(self) -> str:
        return f"{self.name_prefix}scheduler"

    def worker(self, rank: int) -> str:
        return f"{self.name_prefix}worker rank {rank}"

    def owns(self, child_name: str) -> bool:
        role = child_name.removeprefix(self.name_prefix)
        return child_name.startswith(self.name_prefix) and (role == "scheduler" or role.startswith("worker rank "))

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"


def engine_replicas(args: argparse.Namespace, private_dir: str, worker_address: str,
                    ray_host: str | None = None) -> list[EngineReplica]:
    """The engines to start. `worker_address`: the one engine's (serve's --worker-address, a Ray head's, or the
    private socket); several engines each get a private socket of their own, or with Ray (`ray_host`: this
    host as the cluster reaches it) a TCP port of their own on every interface."""
    size = args.data_parallel_size
    if size == 1:
        return [EngineReplica(0, args.grpc_host, args.grpc_port, worker_address, args.device, "")]
    per_engine = args.tensor_parallel_size
    ports: list[int] = []
    while len(ports) < size:  # distinct, and never the front's public port (which binds after them)
        port = free_port()
        if port != args.grpc_port and port not in ports:
            ports.append(port)
    def engine_worker_address(index: int) -> str:
        if ray_host is None:
            return f"ipc://{private_dir}{os.sep}workers-{index}.sock"
        return f"tcp://{ray_host}:{free_port('')}"

    return [EngineReplica(index, "127.0.0.1", ports[index], engine_worker_address(index),
                          rank_device(args.device, index * per_engine), f"engine {index} ")
            for index in range(size)]


def is_worker(child_name: str) -> bool:
    return "worker rank " in child_name


def is_scheduler(child_name: str) -> bool:
    return child_name.endswith("scheduler")


def data_parallel_refusal(args: argparse.Namespace, visible_gpus: int | None) -> str | None:
    """Why `-dp N` cannot start as asked, or None. `visible_gpus`: this host's (None off CUDA)."""
    size = args.data_parallel_size
    if size < 1:
        return "--data-parallel-size must be >= 1"
    if args.api_server_count < 1:
        return f"--api-server-count must be >= 1, not {args.api_server_count}"
    if size == 1:
        if args.api_server_count > 1:
            return ("--api-server-count > 1 needs --data-parallel-size > 1: with one engine there is no front, the "
                    "scheduler serves the public port itself")
        return None
    if args.worker_address is not None:
        return "--worker-address cannot go with --data-parallel-size > 1 (each engine has a private socket)"
    if args.allow_runtime_lora_updating:
        return ("--allow-runtime-lora-updating cannot go with --data-parallel-size > 1 yet (the front does not "
                "forward adapter loads to every engine): serve the adapters with --lora-modules")
    if args.tls_cert_file:
        return ("TLS (--tls-cert-file) cannot go with --data-parallel-size > 1 yet (the front reaches its engines "
                "on loopback by IP address, which the certificate does not name)")
    needed = first_gpu_index(args.device) + size * args.tensor_parallel_size
    if visible_gpus is not None and needed > visible_gpus:
        return (f"--data-parallel-size {size} x --tensor-parallel-size {args.tensor_parallel_size} needs {needed} "
                f"GPUs from cuda:0 (one per rank), but {visible_gpus} {'is' if visible_gpus == 1 else 'are'} visible")
    return None


def front_argv(args: argparse.Namespace, model_argv: list[str], replicas: list[EngineReplica]) -> list[str]:
    """The front's flags: the router's (serve's, forwarded from their declaration), the public address, the
    engines' addresses and the text options the scheduler has, set here. The API key goes in its environment."""
    values = flag_values(FrontConfig, args, shared_only=True)
    values.update(engine_targets=tuple(replica.target for replica in replicas), host=args.grpc_host,
                  port=args.grpc_port, tokenizer=args.tokenizer, chat_template=args.chat_template,
                  tls_cert_file=args.tls_cert_file, tls_key_file=args.tls_key_file,
                  max_message_bytes=args.max_message_bytes, shutdown_timeout=args.shutdown_timeout)
    return [*model_argv, *config_argv(FrontConfig, values)]
