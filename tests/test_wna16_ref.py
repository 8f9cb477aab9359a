"""The canonical weight-only integer layout (kernels/wna16_ref.py): packing round-trips, and the dequantized
weight is (q - zero) * scale per group, written out element by element."""

import pytest
import torch

from kernels.wna16_ref import dequantize_wna16, pack_rows, unpack_rows, wna16_linear_ref


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_rows_round_trips_and_puts_the_first_row_in_the_lowest_bits(bits):
    values = torch.randint(0, 2**bits, (64, 5))
    packed = pack_rows(values, bits)
    assert packed.dtype == torch.int32 and packed.shape == (64 * bits // 32, 5)
    assert torch.equal(unpack_rows(packed, bits), values.int())
    assert int(packed[0, 0]) & (2**bits - 1) == int(values[0, 0])


@pytest.mark.parametrize("bits,asymmetric", [(4, False), (4, True), (8, False), (8, True)])
def test_dequantize_is_q_minus_zero_times_scale_of_each_group(bits, asymmetric):
    group = 8
    values = torch.randint(0, 2**bits, (32, 3))
    scales = torch.rand(32 // group, 3) + 0.1
    zeros = torch.randint(0, 2**bits, (32 // group, 3)).float() if asymmetric else None
    weight = dequantize_wna16(pack_rows(values, bits), scales, zeros, bits, group)
    for n in range(3):
        for k in range(32):
            zero = zeros[k // group, n] if asymmetric else 2 ** (bits - 1)
            assert weight[n, k] == pytest.approx(float((values[k, n] - zero) * scales[k // group, n]), rel=1e-6)
    x = torch.randn(4, 32)
    assert torch.equal(wna16_linear_ref(x, pack_rows(values, bits), scales, zeros, bits, group), x @ weight.t())
