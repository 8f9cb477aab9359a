"""tests/triton_kernels/: each Triton kernel against its torch reference, in Triton's CPU interpreter.

The interpreter flag is set in tests/conftest.py (why there: see it); launches read it again
(kernels/triton_numerics.py) to upcast 16-bit arithmetic, which the interpreter gets wrong. Without
Triton installed (its wheel is Linux only) this folder is not collected; with the interpreter turned
off (TRITON_INTERPRET=0) its tests are skipped, since they run on CPU tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    import triton
except ImportError:
    collect_ignore_glob = ["test_*.py"]
    triton = None

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    if triton is None or triton.knobs.runtime.interpret:
        return
    skip = pytest.mark.skip(reason="TRITON_INTERPRET is off: these tests run kernels on CPU tensors")
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(skip)
