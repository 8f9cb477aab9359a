"""The batched multi-LoRA reference (kernels/lora_ref.py): against an explicit per-token loop over mixed slots, and
bit for bit against PEFT's LoRA Linear for one adapter (plain and rsLoRA scaling), whose numerics it mirrors."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from kernels.lora_ref import lora_add

K, N = 24, 20
# The loop sums in float64 where the reference sums in fp32 (or float64), so rounding to x's dtype may land an ulp
# apart in h and d: tolerances a few ulps of each dtype.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2**-6}


def per_token_update(x_row, lora_a, lora_b, scaling):
    """One token's update with the reference's rounding points, as plain vector products summed in float64."""
    shrunk = (lora_a.double() @ x_row.double()).to(x_row.dtype)
    expanded = (lora_b.double() @ shrunk.double()).to(x_row.dtype)
    return (expanded.double() * scaling.double()).to(x_row.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_each_token_gets_its_own_slots_update_and_unslotted_rows_are_untouched(dtype, slot_dtype):
    generator = torch.Generator().manual_seed(0)
    num_slots, rank = 3, 4
    slots = torch.tensor([2, -1, 0, 0, -1, 2, 1, 2, 0], dtype=slot_dtype)
    x = torch.randn(len(slots), K, generator=generator, dtype=dtype)
    x[slots == -1] = float("nan")  # a padding row's input must not be read
    lora_a = torch.randn(num_slots, rank, K, generator=generator, dtype=dtype)
    lora_b = torch.randn(num_slots, N, rank, generator=generator, dtype=dtype)
    scalings = torch.tensor([0.5, 2.0, 0.25])
    wide = torch.randn(len(slots), N + 7, generator=generator, dtype=dtype)
    before = wide.clone()
    lora_add(wide[:, 3:3 + N], x, lora_a, lora_b, slots, scalings)  # a column slice: row stride N + 7
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            assert torch.equal(wide[t], before[t])
            continue
        expected = before[t, 3:3 + N] + per_token_update(x[t], lora_a[slot], lora_b[slot], scalings[slot])
        torch.testing.assert_close(wide[t, 3:3 + N], expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, 3 + N:], before[:, 3 + N:])


def test_a_slot_padded_beyond_its_rank_with_zeros_adds_the_unpadded_update():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, K, generator=generator, dtype=torch.float64)
    lora_a = torch.randn(1, 3, K, generator=generator, dtype=torch.float64)
    lora_b = torch.randn(1, N, 3, generator=generator, dtype=torch.float64)
    padded_a = torch.cat([lora_a, torch.zeros(1, 5, K, dtype=torch.float64)], dim=1)
    padded_b = torch.cat([lora_b, torch.zeros(1, N, 5, dtype=torch.float64)], dim=2)
    slots, scalings = torch.zeros(5, dtype=torch.int64), torch.tensor([1.5])
    y, y_padded = torch.zeros(5, N, dtype=torch.float64), torch.zeros(5, N, dtype=torch.float64)
    lora_add(y, x, lora_a, lora_b, slots, scalings)
    lora_add(y_padded, x, padded_a, padded_b, slots, scalings)
    torch.testing.assert_close(y_padded, y, rtol=1e-12, atol=1e-12)
    assert y.abs().max() > 1


class OneProjection(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N)

    def forward(self, x):
        return self.proj(x)


@pytest.mark.parametrize("rank,alpha,use_rslora", [(4, 8, False), (8, 16, True), (16, 7, False)])
def test_one_adapter_equals_peft_lora_linear_bit_for_bit_in_float32(rank, alpha, use_rslora):
    torch.manual_seed(rank)
    model = get_peft_model(OneProjection(), LoraConfig(r=rank, lora_alpha=alpha, use_rslora=use_rslora,
                                                       target_modules=["proj"], lora_dropout=0.0))
    layer = model.base_model.model.proj
    with torch.no_grad():  # PEFT starts B at zero (a no-op adapter); give it weights
        layer.lora_B["default"].weight.normal_()
    x = torch.randn(6, K)
    with torch.no_grad():
        expected = model(x)
        y = layer.base_layer(x)
    lora_a = layer.lora_A["default"].weight.detach()[None]
    lora_b = layer.lora_B["default"].weight.detach()[None]
    scalings = torch.tensor([layer.scaling["default"]], dtype=torch.float32)
    assert layer.scaling["default"] == (alpha / rank ** 0.5 if use_rslora else alpha / rank)
    lora_add(y, x, lora_a, lora_b, torch.zeros(6, dtype=torch.int32), scalings)
    assert torch.equal(y, expected)
    assert not torch.equal(y, layer.base_layer(x).detach())


def test_refuses_operands_that_do_not_fit():
    x, y = torch.randn(2, K), torch.zeros(2, N)
    lora_a, lora_b = torch.randn(1, 4, K), torch.randn(1, N, 4)
    slots, scalings = torch.zeros(2, dtype=torch.int32), torch.ones(1)
    with pytest.raises(ValueError, match="lora_b"):
        lora_add(y, x, lora_a, lora_b.transpose(1, 2), slots, scalings)
    with pytest.raises(ValueError, match="token_slots"):
        lora_add(y, x, lora_a, lora_b, slots.float(), scalings)
    with pytest.raises(ValueError, match="scalings"):
        lora_add(y, x, lora_a, lora_b, slots, scalings.double())
    with pytest.raises(ValueError, match="dtype"):
        lora_add(y, x, lora_a.double(), lora_b, slots, scalings)


def test_adapters_are_padded_to_a_power_of_two_rank_of_at_least_16():
    """The Triton kernel needs R a power of two in [16, 128]: the worker pads every adapter with zeros to it."""
    from worker_svc.lora_adapters import stack_rank

    assert [stack_rank(r) for r in (1, 8, 16, 17, 64, 100, 128, 256)] == [16, 16, 16, 32, 64, 128, 128, 256]
