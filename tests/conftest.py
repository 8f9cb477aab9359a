"""Process-wide test setup that must come before any test module is imported.

Triton kernels run in Triton's CPU interpreter (CI has no GPU). Why the flag is set here, in the root
conftest that pytest loads before collecting any test module, and not in tests/triton_kernels/: Triton
decides interpreter-or-compiler when a function is decorated with `triton.jit`, i.e. when a module is
first imported; that covers our kernels and Triton's own library functions (`tl.zeros`, `tl.sum`, ...)
decorated when `triton` itself is imported, and transformers' model code imports `triton` as a side
effect. A flag set after any earlier-collected test module pulled `triton` in would come too late.

`TRITON_INTERPRET=0 pytest` on a GPU machine opts out: tests/triton_kernels/ is then skipped, and
benchmarks/kernel_bench.py checks the compiled kernels against the references instead.

One OpenMP thread per process (torch's CPU ops here, and in every server process a test starts, which inherit
the variable): `make test` runs 3 pytest processes on 2 cores, each with servers of its own, and torch's
default of one thread per core made their OpenMP threads spin against each other. Measured on the CI machine
with the other processes busy: a SmolLM2 decode step took 842 ms with 2 threads and 59 ms with 1.
For the same reason the servers' CPU workers are not pinned (VLLM_CPU_OMP_THREADS_BIND=nobind; the default, auto,
would pin every test server's worker to the same core and leave the other to schedulers):
worker_svc/cpu_placement.py's tests cover the pinning itself.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


import pytest  # noqa: E402

from tests.fake_generation_server import FakeServer  # noqa: E402


@pytest.fixture
def no_block_leaks(server):
    """For modules sharing one `server` fixture (pytestmark = usefixtures("no_block_leaks")): after each test,
    every KV block must be free again."""
    yield
    stats = server.wait_all_blocks_free()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "a test leaked KV blocks"


@pytest.fixture(scope="module")
def fake_server():
    """The in-process stand-in for the scheduler (fake_generation_server.py), one per test module: the gateway
    tests start their gateways against its `target`."""
    server = FakeServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def engines():
    """Two stand-ins for data-parallel engines' schedulers, one pair per test module (the front's tests route
    between them)."""
    pair = [FakeServer(), FakeServer()]
    yield pair
    for engine in pair:
        engine.stop()


@pytest.fixture
def fake(fake_server):
    """The stand-in with its recorded requests and scripts reset for this test."""
    return fake_server.reset()
