"""`--distributed-executor-backend ray`: the worker ranks run on a Ray cluster, placed by a placement group.

Why Ray and not a launcher of our own: placing N ranks on the GPUs of several hosts, reserving them all or
none, and noticing a host that goes away is what Ray's placement groups do. The ranks stay ordinary worker
processes (`python -m worker_svc`, the same as with `mp`): each rank is a small Ray actor that reserves one
bundle (one GPU and one CPU, or one CPU with `--device cpu`) and runs the worker as its child, which inherits
the GPU Ray assigned (CUDA_VISIBLE_DEVICES, so the worker's device is `cuda`, index 0 of what it sees). The
worker connects back to the scheduler over TCP ZeroMQ and to the other ranks through torch.distributed, whose
rendezvous listens on rank 0's host.

The cluster: `ray.init()` joins the cluster named by RAY_ADDRESS, or one started on this host with `ray start
--head`, or else starts a private local one (stopped with the launcher). The launcher runs where the scheduler
runs; its host must be reachable from every worker host on the scheduler's ZeroMQ port, and rank 0's host
from every other rank on the rendezvous port (docs/tensor_parallel.md).

Ownership: the launcher owns one `RayWorkerGroup` per engine (`-dp N`: N placement groups, each engine's
ranks in one); each `RayRankProcess` is the launcher's handle on one rank, with the subset of
`subprocess.Popen` the launcher's supervision uses (poll, send_signal, wait, kill, returncode).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

_READY_TIMEOUT_S = 120.0


class RankHost:
    """The Ray actor that holds one rank's bundle and runs that rank's worker process."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        from pagedserve.free_port import free_port

        return free_port("")  # on every interface: the other ranks' hosts reach it

    def start(self, argv: list[str], environment: dict[str, str] | None = None) -> int:
        # --exit-with-parent: the worker dies with this actor (Ray kills it with the placement group).
        # `environment`: added to the actor's own (the worker link's secret: never on a command line).
        self._process = subprocess.Popen([sys.executable, "-m", "worker_svc", "--exit-with-parent", *argv],
                                         start_new_session=True, env={**os.environ, **(environment or {})})
        return self._process.pid

    def poll(self) -> int | None:
        return self._process.poll()

    def send_signal(self, signum: int) -> None:
        if self._process.poll() is None:
            self._process.send_signal(signum)


class RayRankProcess:
    """The launcher's handle on one rank's worker on the cluster, shaped like the `Popen` it supervises."""

    def __init__(self, actor) -> None:
        self._actor = actor
        self.returncode: int | None = None

    def poll(self) -> int | None:
        import ray

        if self.returncode is None:
            try:
                self.returncode = ray.get(self._actor.poll.remote(), timeout=10)
            except (ray.exceptions.RayError, TimeoutError):
                self.returncode = 1  # the actor or its host is gone: the rank is dead
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self._call("send_signal", signum)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("worker rank on Ray", timeout)
            time.sleep(0.1)
        return self.returncode

    def kill(self) -> None:
        self._call("send_signal", signal.SIGKILL)

    def _call(self, method: str, *args) -> None:
        import ray

        try:
            ray.get(getattr(self._actor, method).remote(*args), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # already gone


class RayWorkerGroup:
    """One placement group of `world_size` bundles and a `RankHost` in each, rank r in bundle r."""

    def __init__(self, world_size: int, use_gpus: bool) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise SystemExit("--distributed-executor-backend ray needs Ray: pip install 'pagedserve[ray]'") from None
        self._ray = ray
        self._released = False
        # log_to_driver: the ranks' log lines reach the launcher's stderr, prefixed by their actor, as with mp.
        ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=True)
        bundle = {"GPU": 1, "CPU": 1} if use_gpus else {"CPU": 1}
        self._placement = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        try:
            ray.get(self._placement.ready(), timeout=_READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise SystemExit(
                f"--distributed-executor-backend ray: the cluster cannot place {world_size} bundles of {bundle} "
                f"(--tensor-parallel-size {world_size}); it has {ray.cluster_resources()}") from None
        actor_class = ray.remote(num_cpus=1, num_gpus=1 if use_gpus else 0)(RankHost)
        self._actors = [
            actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._placement, placement_group_bundle_index=rank)).remote()
            for rank in range(world_size)
        ]

    def head_address(self) -> str:
        """An address of this host that the worker hosts reach (Ray's own view of this node)."""
        return self._ray.util.get_node_ip_address()

    def rendezvous_address(self) -> str:
        """tcp://HOST:PORT on rank 0's host for torch.distributed's rendezvous."""
        ip, port = self._ray.get([self._actors[0].node_ip.remote(), self._actors[0].free_port.remote()])
        return f"tcp://{ip}:{port}"

    def start(self, rank: int, argv: list[str], environment: dict[str, str] | None = None) -> RayRankProcess:
        self._ray.get(self._actors[rank].start.remote(argv, environment))
        return RayRankProcess(self._actors[rank])

    def release(self) -> None:
        """Its actors (and so its workers) and its placement group, given back; the Ray connection stays. Once:
        an engine gone for good is released when it goes, and again (a no-op) at shutdown."""
        from ray.util.placement_group import remove_placement_group

        if self._released:
            return
        self._released = True
        for actor in self._actors:
            self._ray.kill(actor)
        remove_placement_group(self._placement)


def ray_worker_groups(num_engines: int, world_size: int, use_gpus: bool) -> list[RayWorkerGroup]:
    """One placement group per engine (data parallel), each of `world_size` bundles: an engine's ranks are
    placed together (PACK: one host when it has room), and engines are placed independently, so a cluster
    with one engine's worth of GPUs per node gets one engine per node."""
    return [RayWorkerGroup(world_size, use_gpus) for _ in range(num_engines)]


def shut_down_ray(groups: list[RayWorkerGroup]) -> None:
    """Every group given back, then the Ray connection closed (a local instance this process started stops)."""
    import ray

    for group in groups:
        group.release()
    ray.shutdown()
