"""tests/triton_kernels/: each Triton kernel against its torch reference, in Triton's CPU interpreter.

The interpreter flag is set in tests/conftest.py (why there: see it); launches read it again
(kernels/triton_numerics.py) to upcast 16-bit arithmetic, which the interpreter gets wrong. Without
Triton installed (its wheel is Linux only) this folder is not collected; with the interpreter turned
off (TRITON_INTERPRET=0) its tests are skipped, since they run on CPU tensors.

The interpreter also truncates fp32 -> bf16 casts where a GPU rounds to nearest even; the session fixture
below makes it round, so bf16 kernels can be held to their torch references (and to transformers) bit
for bit here, as they are on a GPU.
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


@pytest.fixture(scope="session", autouse=True)
def bfloat16_casts_round_to_nearest_even():
    """Patch the interpreter's float conversion so fp32 -> bf16 rounds to nearest even (NaN stays NaN)."""
    if triton is None or not triton.knobs.runtime.interpret:
        yield
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = interpreter._convert_float

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if (input_dtype, output_dtype) != (tl.float32, tl.bfloat16):
            return truncating(values, input_dtype, output_dtype, rounding_mode)
        bits = np.ascontiguousarray(values).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        quiet_nan = (bits >> 16) | 0x40
        return np.where(np.isnan(values), quiet_nan, rounded).astype(np.uint16).reshape(values.shape)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter, "_convert_float", convert)
        yield


def pytest_collection_modifyitems(config, items):
    if triton is None or triton.knobs.runtime.interpret:
        return
    skip = pytest.mark.skip(reason="TRITON_INTERPRET is off: these tests run kernels on CPU tensors")
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(skip)
