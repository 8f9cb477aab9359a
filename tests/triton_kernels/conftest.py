"""tests/triton_kernels/: each Triton kernel against its torch reference, in Triton's CPU interpreter.

The interpreter flag is set in tests/conftest.py (why there: see it); launches read it again
(kernels/triton_numerics.py) to upcast 16-bit arithmetic, which the interpreter gets wrong. Without
Triton installed (its wheel is Linux only) this folder is not collected; with the interpreter turned
off (TRITON_INTERPRET=0) its tests are skipped, since they run on CPU tensors.

The interpreter also truncates fp32 -> bf16 casts where a GPU rounds to nearest even; the session fixture
below makes it round, so bf16 kernels can be held to their torch references (and to transformers) bit
for bit here, as they are on a GPU.

And the interpreter computes `tl.dot` with numpy's matmul, i.e. the host's BLAS, whose kernels are picked by
the CPU at run time: with OpenBLAS's Haswell kernels (numpy 2.4's bundled OpenBLAS 0.3.31 on a 2-core AMD
EPYC) a row's bits depend on its position in the tile, so the batch-invariance tests failed there and passed
with OPENBLAS_CORETYPE=Sandybridge. The second fixture below sums every dot product in K order with numpy's
elementwise ops (IEEE, no BLAS), the same for every row and column: the bits then follow from what the kernel
feeds each tile (which rows, which K range, in which order), which is what these tests can check on any CPU.
Whether the GPU's MMA keeps a row's bits is checked on a GPU (tests/gpu/test_batch_invariance_gpu.py).
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


@pytest.fixture(scope="session", autouse=True)
def dot_products_sum_in_k_order():
    """Patch the interpreter's `tl.dot` (numpy's matmul) to a product summed in K order from zero, then added to
    the accumulator, as the matmul was: each output element's sum is the same operations in the same order
    whatever the host's BLAS, and whatever its row's or column's position in the tile."""
    if triton is None or not triton.knobs.runtime.interpret:
        yield
        return
    import numpy as np
    from triton.runtime import interpreter

    through_matmul = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating() or \
                b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating():
            return through_matmul(self, a, b, d, input_precision, max_num_imprecise_acc)
        accumulator = d.data.dtype
        # Row-major copies: the products' layout, and with it the order numpy reduces them in, is then the same
        # for every dot (a transposed operand, a TMA load's `.T`, gave other bits).
        a_data, b_data = np.ascontiguousarray(a.data, accumulator), np.ascontiguousarray(b.data, accumulator)
        # [..., M, K, N] products, reduced over K: numpy adds the K slices one after another, element by element.
        products = np.add.reduce(a_data[..., :, :, None] * b_data[..., None, :, :], axis=-2)
        return interpreter.TensorHandle(products + d.data, d.dtype.scalar)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
        yield


@pytest.fixture(scope="session", autouse=True)
def language_patched_once_a_launch():
    """Patch the interpreter so that a `triton.jit` function called from inside a kernel does not patch
    `triton.language` again when the kernel's launch already has.

    Why: the interpreter's launch patches the language's builtins (`inspect.getmembers` over `tl`, `tl.math`,
    `tl.tensor`) for the launch, and then every call of a jit'd helper inside the kernel does it again, once per
    program and per call, finding everything already patched. Profiled on the batch-invariant attention test
    (fp32-gqa4-segments32), 154,000 of those re-patchings took 188 of its 466 seconds. A helper whose module
    sees a language module the launch did not patch is still patched as before; a helper called outside any
    launch too."""
    if triton is None or not triton.knobs.runtime.interpret:
        yield
        return
    import functools
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched_by_launch: list[set[int]] = []  # per launch in progress: ids of the language modules it patched

    @functools.cache  # a module's imports do not change once it has run
    def languages_of(fn) -> frozenset[int]:
        return frozenset(id(value) for value in fn.__globals__.values()
                         if inspect.ismodule(value) and value in (tl, tl.core))

    def patch_lang_unless_patched(fn):
        if patched_by_launch and languages_of(fn) <= patched_by_launch[-1]:
            return interpreter._LangPatchScope()  # nothing to patch, so nothing to restore
        scope = patch_lang(fn)
        if patched_by_launch:
            patched_by_launch[-1] |= languages_of(fn)
        return scope

    def launch_tracking_patches(self, *args, **kwargs):
        patched_by_launch.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched_by_launch.pop()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter, "_patch_lang", patch_lang_unless_patched)
        patch.setattr(interpreter.GridExecutor, "__call__", launch_tracking_patches)
        yield


def pytest_collection_modifyitems(config, items):
    if triton is None or triton.knobs.runtime.interpret:
        return
    skip = pytest.mark.skip(reason="TRITON_INTERPRET is off: these tests run kernels on CPU tensors")
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(skip)
