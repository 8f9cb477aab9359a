"""Tiny Mixtral and Qwen3-MoE served from weight-only integer checkpoints, experts included (AWQ, GPTQ 4- and
8-bit, compressed-tensors W4A16 asymmetric), written by pagedserve/testing/int_checkpoints.py with every expert's
gate / up / down projection quantized under its hub name and the router left as it is. The engine's greedy tokens
equal transformers' running the dequantized weights in float32; two tensor-parallel ranks equal one; dummy weights
have a sane scale; act-order experts and a shard that splits a group are refused naming why."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.testing.int_checkpoint_reader import dequantized_int_state_dict
from pagedserve.testing.int_checkpoints import (
    write_awq_checkpoint,
    write_compressed_tensors_int_checkpoint,
    write_gptq_checkpoint,
)
from pagedserve.testing.paged_runner import greedy_generate_paged, prefill_logits_paged
from pagedserve.testing.tiny_models import make_tiny_model
from service_runtime.load_refusal import LoadRefused
from tests.test_models import hf_greedy, make_prompts
from tests.test_parallel_layers import check_sharded_model, run_ranks
from worker_svc.layers.fused_moe import FusedMoE
from worker_svc.models.model_loader import load_model
from worker_svc.tensor_parallel import TensorParallel

FORMATS = {
    "awq": lambda source, target: write_awq_checkpoint(source, target, group_size=32),
    "gptq4_sym": lambda source, target: write_gptq_checkpoint(source, target, 4, group_size=32),
    "gptq8_asym": lambda source, target: write_gptq_checkpoint(source, target, 8, group_size=32, sym=False),
    "w4a16_group32_asym": lambda source, target: write_compressed_tensors_int_checkpoint(
        source, target, 4, 32, symmetric=False),
}
NEW_TOKENS = 6


def _checkpoint(tmp_path, arch: str, fmt: str):
    source = make_tiny_model(tmp_path, arch, seed=3)
    return source, FORMATS[fmt](source, tmp_path / f"{arch}-{fmt}")


def _transformers_on_dequantized_weights(source, served, directory):
    """transformers' model of the dequantized checkpoint, saved under the hub's per-expert names so that
    from_pretrained stacks the experts as it does for a real checkpoint."""
    from transformers import AutoModelForCausalLM

    directory.mkdir()
    (directory / "config.json").write_text((source / "config.json").read_text())
    state = {name: tensor.float().contiguous() for name, tensor in dequantized_int_state_dict(served).items()}
    save_file(state, directory / "model.safetensors")
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch, fmt", [("mixtral", "awq"), ("qwen3_moe", "gptq4_sym"), ("mixtral", "gptq8_asym"),
                                       ("qwen3_moe", "w4a16_group32_asym")])
def test_greedy_tokens_equal_transformers_on_the_dequantized_experts(tmp_path, arch, fmt):
    source, served = _checkpoint(tmp_path, arch, fmt)
    stored = load_file(served / "model.safetensors")
    assert any(".experts.0." in name and name.endswith((".qweight", ".weight_packed")) for name in stored)
    assert stored["model.layers.0." + ("block_sparse_moe" if arch == "mixtral" else "mlp") + ".gate.weight"].dtype \
        == torch.float32  # the router: as transformers wrote it
    model, config = load_model(served, torch.float32, "cpu")
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, FusedMoE)]
    assert blocks and all(block.w13_qweight.dtype == block.w2_qweight.dtype == torch.int32 for block in blocks)
    assert all(block.gate.weight.dtype == torch.float32 for block in blocks)  # the router: unquantized
    assert all(not hasattr(block, "w13_weight") for block in blocks)
    reference = _transformers_on_dequantized_weights(source, served, tmp_path / "dequantized")
    prompts = make_prompts(config.vocab_size, [11, 5])
    ours = greedy_generate_paged(model, config, prompts, NEW_TOKENS, prefill_chunk=4)
    assert ours == [hf_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]
    # Quantized for real, experts included: the logits are neither the float model's nor those of the float
    # experts in the otherwise quantized model.
    unquantized, _ = load_model(source, torch.float32, "cpu")
    got, plain = (prefill_logits_paged(m, config, prompts[:1])[0] for m in (model, unquantized))
    assert ((got - plain).norm() / plain.norm()).item() > 1e-3


@pytest.mark.parametrize("fmt", ["awq", "w4a16_group32_asym"])
def test_two_tensor_parallel_ranks_give_the_single_rank_logits_and_tokens(tmp_path, fmt):
    """Mixtral's intermediate size 128: 64 per rank, two groups of 32 of w2's input rows each; w13's packed output
    columns (AWQ's qweight [H, I / 8]) or rows (compressed-tensors' weight_packed [I, H / 8]) split per rank."""
    _, served = _checkpoint(tmp_path, "mixtral", fmt)
    prompts = [[1, 17, 300, 42, 9, 255, 7], [1, 5, 5, 480, 2, 61, 99, 100, 3]]
    run_ranks(check_sharded_model, str(served), prompts, 1e-4)


def test_a_shard_of_the_experts_that_splits_a_group_is_refused_naming_the_block(tmp_path):
    """Qwen3-MoE's moe_intermediate_size 32 over two ranks is 16 input rows of w2 each: groups of 32 would span
    both ranks."""
    _, served = _checkpoint(tmp_path, "qwen3_moe", "gptq4_sym")
    with pytest.raises(LoadRefused, match=r"gptq W4A16 .* cannot serve the experts of model\.layers\.0\.mlp over 2 "
                                          r"tensor-parallel rank\(s\): w2_scales: the experts' intermediate size 32 "
                                          r"split over tensor-parallel ranks gives this rank columns 0\.\.15, .*"
                                          r"one scale per group of 32"):
        load_model(served, torch.float32, "meta", tensor_parallel=TensorParallel(rank=0, world_size=2))


def test_act_order_experts_are_refused(tmp_path):
    _, served = _checkpoint(tmp_path, "mixtral", "gptq4_sym")
    config = json.loads((served / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (served / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadRefused, match=r"experts of model\.layers\.0\.mlp .*act-order \(g_idx\) on MoE experts "
                                          r"is not served"):
        load_model(served, torch.float32, "meta")


def test_dummy_weights_of_integer_experts_give_finite_logits_of_a_sane_scale(tmp_path):
    _, served = _checkpoint(tmp_path, "qwen3_moe", "w4a16_group32_asym")
    model, config = load_model(served, torch.float32, "cpu", load_format="dummy")
    block = model.model.layers[0].mlp
    w13, _ = block.integer.packed(block)
    dequantized_std = w13.dequantize(0).std().item()
    assert 0.005 < dequantized_std < 0.05  # about N(0, 0.02), as the unquantized dummy weights
    logits = prefill_logits_paged(model, config, [[1, 2, 3, 4]])[0]
    assert torch.isfinite(logits).all()
