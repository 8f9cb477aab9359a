"""The batch-invariant Triton kernels keep a row's bits on a GPU, compiled: the bit-equality checks of
tests/triton_kernels/ (a row alone or among others, a token served whole, in chunks or decoded, a request's
logits alone or batched) on CUDA tensors, and at served shapes (gpu_batch_invariance_check.py's checks).

Why here, and only on a GPU: under the interpreter (CPU CI) `tl.dot` is a product that tests/triton_kernels/
conftest.py sums in K order, so those tests prove what the kernels feed each tile, not what the GPU's MMA does
with it; that, the point of --batch-invariant, can only be seen on the GPU. Skipped without CUDA, and under the
interpreter, which tests/conftest.py turns on by default (tests/gpu/conftest.py); `make test-gpu` runs them.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.triton_batch_invariant_attention import BatchInvariantTritonBackend  # noqa: E402
from kernels.triton_batch_invariant_matmul import TILE, linear, tile_by_rows, tiles_agree  # noqa: E402
from kernels.triton_batch_invariant_norm import log_softmax, rms_norm  # noqa: E402
from tests.triton_kernels import gpu_batch_invariance_check as served  # noqa: E402
from tests.triton_kernels.batch_invariance_cases import (  # noqa: E402
    PagedPool,
    assert_rows_batch_invariant,
    others_of_random_lengths,
    random_tensor,
    ways_of_serving_one_sequence,
)
from tests.triton_kernels.test_batch_invariant_kernels import ATTENTION_CASES, POSITIONS, SEQ_LEN  # noqa: E402
from tests.triton_kernels.test_batch_invariant_model import assert_logits_alone_batched_and_chunked_agree  # noqa: E402

DEVICE = "cuda"
BATCH_SIZES = (1, 3, 64, 257, 2048)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("by_rows", [False, True], ids=["TILE", "tile_by_rows"])
def test_linear_rows_are_batch_invariant_on_the_gpu(dtype, with_bias, by_rows):
    """As served: TILE everywhere, or the tile that follows the row count where `tiles_agree` holds."""
    if by_rows and not tiles_agree(DEVICE, dtype):
        pytest.skip("the row tiles do not agree on this device: it serves TILE alone")
    hidden = random_tensor((2048, 1000), dtype, 1, DEVICE)
    weight = random_tensor((1032, 1000), dtype, 2, DEVICE) * 0.03
    bias = random_tensor((1032,), dtype, 3, DEVICE) if with_bias else None
    tile = tile_by_rows if by_rows else TILE
    assert_rows_batch_invariant(lambda batch: linear(batch, weight, bias, tile=tile), hidden, BATCH_SIZES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_log_softmax_rows_are_batch_invariant_on_the_gpu(dtype):
    weight = random_tensor((4096,), dtype, 4, DEVICE)
    rows = random_tensor((2048, 2, 4096), dtype, 5, DEVICE)
    assert_rows_batch_invariant(lambda x: torch.stack(rms_norm(x[:, 0], weight, 1e-6, x[:, 1]), dim=1), rows,
                                BATCH_SIZES)
    assert_rows_batch_invariant(log_softmax, random_tensor((257, 151936), torch.float32, 6, DEVICE) * 4)


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_of_a_token_is_the_same_however_it_is_served_on_the_gpu(case):
    dtype, group_size, options, backend_options = ATTENTION_CASES[case]
    pool = PagedPool({"ours": SEQ_LEN, **others_of_random_lengths(7)}, group_size, dtype, seed=3, device=DEVICE)
    ways = ways_of_serving_one_sequence(pool, BatchInvariantTritonBackend(**backend_options), options, POSITIONS)
    for way, output in ways.items():
        assert torch.equal(output, ways["whole prefill"]), f"{way} differs from the whole prefill"


def test_every_batch_invariant_op_keeps_a_rows_bits_at_served_shapes():
    """gpu_batch_invariance_check.py's required checks: a 4096-wide linear, a 151,936-token vocabulary, the MoE,
    a 700-token sequence served every way, both decode ways, the start-up check."""
    results = {name: check() for name, (required, check) in served.checks(served.GPU_SHAPES,
                                                                          served.GPU_SEGMENT).items() if required}
    assert all(result == "invariant" for result in results.values()), results


@pytest.mark.parametrize("arch,num_layers,dtype", [
    ("llama", 2, torch.float32), ("qwen3_moe", 2, torch.float32), ("gemma2", 3, torch.float32),
    ("llama", 2, torch.bfloat16),
])
def test_a_requests_logits_do_not_depend_on_its_batch_or_chunking_on_the_gpu(arch, num_layers, dtype, tmp_path):
    assert_logits_alone_batched_and_chunked_agree(arch, num_layers, dtype, tmp_path, DEVICE)
