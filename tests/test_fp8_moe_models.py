"""Tiny Mixtral and Qwen3-MoE served FP8, experts included: compressed-tensors checkpoints (per-channel or
per-tensor weight scales, per-token activations) and online `--quantization fp8`. The experts hold float8
weights and run weight-only; the attention projections (and Qwen3-MoE's dense MLP) are the FP8 W8A8 linear
layers. The engine's logits equal transformers' running the dequantized weights with each dense linear layer's
input quantized per token, sharded over two ranks too; what stays refused is refused by ModelConfig."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import fused_moe_ref
from kernels.fp8_linear_ref import quantize_per_token, quantize_weight_per_channel
from pagedserve.testing.fp8_checkpoints import (
    EXPERT_WEIGHT, LINEAR_WEIGHT, dequantized_state_dict, write_fp8_checkpoint,
)
from pagedserve.testing.paged_runner import greedy_generate_paged, prefill_logits_paged
from pagedserve.testing.tiny_models import make_tiny_model
from tests.test_models import make_prompts
from tests.test_parallel_layers import check_sharded_model, run_ranks
from worker_svc.layers.fused_moe import FusedMoE
from worker_svc.model_config import ModelConfig
from worker_svc.models.model_loader import load_model

# (weight strategy, dynamic activations) of the compressed-tensors checkpoints; None: online --quantization fp8.
SCHEMES = {"fp8_dynamic": ("channel", True), "per_tensor_weights": ("tensor", True), "online": None}
NEW_TOKENS = 12


def _checkpoints(tmp_path, arch: str, scheme: str):
    """(unquantized dir, dir the engine loads, its --quantization flag)."""
    source = make_tiny_model(tmp_path, arch, seed=3)
    if SCHEMES[scheme] is None:
        return source, source, "fp8"
    strategy, dynamic = SCHEMES[scheme]
    return source, write_fp8_checkpoint(source, tmp_path / f"{arch}-{scheme}", strategy, dynamic), None


def _dequantized_checkpoint(source, served, online: bool, target):
    """An unquantized checkpoint of the weights the engine serves: the FP8 checkpoint's dequantized, or (online)
    the source's quantized per row and dequantized, per expert as the hub names them (transformers stacks them)."""
    if online:
        tensors = load_file(source / "model.safetensors")
        for name, tensor in tensors.items():
            if LINEAR_WEIGHT.match(name) or EXPERT_WEIGHT.match(name):
                quantized, scales = quantize_weight_per_channel(tensor)
                tensors[name] = quantized.float() * scales.reshape(-1, 1)
    else:
        tensors = dequantized_state_dict(served)
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, target / "model.safetensors")
    return target


def _transformers_reference(dequantized):
    """transformers' model of the dequantized weights, the input of each dense decoder linear layer (attention
    projections, a dense MLP) quantized and dequantized per token as the FP8 layer does; the experts and the
    router run on the activations as they are (weight-only FP8, an unquantized router)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    hooked = 0
    for name, module in model.named_modules():
        if not LINEAR_WEIGHT.match(f"{name}.weight"):
            continue

        def fake_quantize(module, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            quantized, scales = quantize_per_token(x)
            return ((quantized.float() * scales).reshape(args[0].shape),)

        module.register_forward_pre_hook(fake_quantize)
        hooked += 1
    assert hooked >= 4 * model.config.num_hidden_layers  # q, k, v, o of every layer
    return model


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_fp8_moe_logits_equal_transformers_on_the_dequantized_weights(tmp_path, arch, scheme):
    source, served, flag = _checkpoints(tmp_path, arch, scheme)
    model, config = load_model(served, torch.float32, "cpu", quantization=flag)
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, FusedMoE)]
    assert blocks and all(block.w13_weight.dtype == block.w2_weight.dtype == torch.float8_e4m3fn for block in blocks)
    assert all(block.gate.weight.dtype == torch.float32 for block in blocks)  # the router: unquantized
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    reference = _transformers_reference(_dequantized_checkpoint(source, served, flag == "fp8", tmp_path / "deq"))
    unquantized, _ = load_model(source, torch.float32, "cpu")
    prompts = make_prompts(config.vocab_size, [23, 5, 40])
    ours = prefill_logits_paged(model, config, prompts, seed=2)
    plain = prefill_logits_paged(unquantized, config, prompts, seed=2)
    for prompt, logits, plain_logits in zip(prompts, ours, plain):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        assert _relative_error(logits, expected) < 1e-3
        assert _relative_error(logits, plain_logits) > 1e-3  # quantized: not the float model's logits
    fp8_tokens = greedy_generate_paged(model, config, prompts, NEW_TOKENS, prefill_chunk=7, seed=4)
    plain_tokens = greedy_generate_paged(unquantized, config, prompts, NEW_TOKENS, prefill_chunk=7, seed=4)
    agreement = sum(a == b for x, y in zip(fp8_tokens, plain_tokens) for a, b in zip(x, y)) / (3 * NEW_TOKENS)
    print(f"{arch} {scheme}: greedy tokens agreeing with the unquantized model: {agreement:.0%}")


def test_an_fp8_moe_checkpoint_over_two_ranks_gives_the_single_rank_logits_and_tokens(tmp_path):
    """Per-channel scales: each rank holds the scales of its share of every expert's gate and up rows, and the
    whole of w2's (its rows are the hidden size), so the ranks' partial sums add up to the single rank's. The
    attention projections are left unquantized (the checkpoint's ignore list): per-token activation scales of a
    row-parallel layer are each rank's own (tests/test_fp8_models.py checks those layers with static scales)."""
    source = make_tiny_model(tmp_path, "mixtral", seed=3)
    served = write_fp8_checkpoint(source, tmp_path / "mixtral-fp8", ignore=("lm_head", "re:.*\\.self_attn\\..*"))
    model, _ = load_model(served, torch.float32, "cpu")
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.w13_weight.dtype == torch.float8_e4m3fn
    prompts = [[1, 17, 300, 42, 9, 255, 7], [1, 5, 5, 480, 2, 61, 99, 100, 3]]
    run_ranks(check_sharded_model, str(served), prompts, 1e-4)


def test_the_fp8_reference_is_the_unquantized_reference_on_the_dequantized_experts():
    generator = torch.Generator().manual_seed(0)
    hidden, logits = torch.randn(9, 32, generator=generator), torch.randn(9, 4, generator=generator)
    w13, w2 = torch.randn(4, 48, 32, generator=generator), torch.randn(4, 32, 24, generator=generator)
    (q13, s13), (q2, s2) = quantize_weight_per_channel(w13), quantize_weight_per_channel(w2)
    assert s13.shape == (4, 48) and s2.shape == (4, 32)  # one scale per (expert, row)
    got = fused_moe_ref.fused_moe(hidden, logits, q13, q2, 2, True, False, s13, s2)
    dequantized = q13.float() * s13.unsqueeze(-1), q2.float() * s2.unsqueeze(-1)
    assert torch.equal(got, fused_moe_ref.fused_moe(hidden, logits, *dequantized, 2, True, False))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_fp8_on_moe_models_is_served_and_static_input_scales_are_refused_naming_why(tmp_path, arch):
    source = make_tiny_model(tmp_path, arch, seed=3)
    assert ModelConfig.from_path(source, "fp8").quantization is not None
    static = write_fp8_checkpoint(source, tmp_path / "static", "tensor", dynamic=False)
    with pytest.raises(ValueError, match=f"static input scales is not served for {arch} models: their fused MoE "
                                         f"experts are weight-only FP8"):
        ModelConfig.from_path(static)


def test_an_unquantized_expert_in_an_fp8_checkpoint_is_refused(tmp_path):
    """A float tensor is not cast into a float8 expert silently: the checkpoint says its experts are float8."""
    from service_runtime.load_refusal import LoadRefused

    served = write_fp8_checkpoint(make_tiny_model(tmp_path, "qwen3_moe", seed=3), tmp_path / "fp8")
    tensors = load_file(served / "model.safetensors")
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    tensors[name] = tensors[name].float()
    save_file(tensors, served / "model.safetensors")
    with pytest.raises(LoadRefused, match=f"{name}: the experts of an FP8 checkpoint are torch.float8_e4m3fn"):
        load_model(served, torch.float32, "cpu")


def test_an_fp8_moe_checkpoint_without_an_experts_scale_is_refused(tmp_path):
    from service_runtime.load_refusal import LoadRefused

    served = write_fp8_checkpoint(make_tiny_model(tmp_path, "mixtral", seed=3), tmp_path / "fp8")
    tensors = load_file(served / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w2.weight_scale"]
    save_file(tensors, served / "model.safetensors")
    with pytest.raises(LoadRefused, match=r"lacks 1 parameters.*layers\.1\.block_sparse_moe\.experts\.2\.w2\."
                                          r"weight_scale"):
        load_model(served, torch.float32, "cpu")
