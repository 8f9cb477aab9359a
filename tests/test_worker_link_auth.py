"""The worker link with a shared secret (service_runtime/worker_link_auth.py): a peer without the secret, or
with another one, never gets a hello through, however it tries; a worker holding it joins as usual."""

from __future__ import annotations

import asyncio

import zmq

from pagedserve.testing.server_harness import free_port
from protos.pagedserve.v1 import worker_pb2
from scheduler_svc.worker_io.worker_link import WorkerLink
from service_runtime.worker_link_auth import link_keys, secure_worker_socket
from worker_svc.scheduler_link import SchedulerLink

HELLO = worker_pb2.WorkerToScheduler(hello=worker_pb2.WorkerHello(rank=0, world_size=1, model_name="m"))


def _rogue(address: str, keys=None) -> tuple[zmq.Context, zmq.Socket]:
    """A DEALER under the worker's identity that sends a hello at once (with `keys`: another secret's)."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"rank-0")
    dealer.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        secure_worker_socket(dealer, keys)
    dealer.connect(address)
    dealer.send(HELLO.SerializeToString())
    return context, dealer


def _worker(address: str, keys) -> int:
    """A worker's link holding the secret: hello, then the setup it is sent, then its pool."""
    link = SchedulerLink(address, b"rank-0", heartbeat_interval=0.2, keys=keys)
    try:
        link.send(HELLO)
        setup = link.receive()
        assert setup.WhichOneof("kind") == "setup"
        link.send(worker_pb2.WorkerToScheduler(ready=worker_pb2.WorkerReady(rank=0, num_kv_blocks=7)))
        return setup.setup.block_size
    finally:
        link.close()


def test_only_a_worker_holding_the_secret_is_taken():
    keys = link_keys("the right secret")
    address = f"tcp://127.0.0.1:{free_port()}"

    async def scenario():
        link = WorkerLink(address, 1, heartbeat_interval=0.2, keys=keys)
        try:
            rogues = [_rogue(address), _rogue(address, link_keys("another secret"))]
            connecting = asyncio.ensure_future(
                link.connect_workers(lambda hello: worker_pb2.WorkerSetup(block_size=16), timeout=30))
            await asyncio.sleep(1.5)
            assert not connecting.done(), "a peer without the secret was taken for a worker"
            assert not any(dealer.poll(0) for _, dealer in rogues), "a peer without the secret was sent a setup"
            block_size = await asyncio.to_thread(_worker, address, keys)
            pool = await connecting
            for context, dealer in rogues:
                dealer.close()
                context.term()
            return block_size, pool
        finally:
            await link.close()

    block_size, pool = asyncio.run(scenario())
    assert (block_size, pool.num_kv_blocks, pool.model_name) == (16, 7, "m")


def test_the_key_pairs_are_the_secrets_alone():
    assert link_keys("s") == link_keys("s")
    assert link_keys("s").server_public != link_keys("t").server_public
    assert link_keys("s").client_public != link_keys("s").server_public
