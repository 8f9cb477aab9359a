"""Tiny Llama, Qwen2 and Qwen3 served from weight-only integer checkpoints (AWQ, with modules_to_not_convert; GPTQ
4- and 8-bit, symmetric or not, act-order, per channel, v1 and gptq_v2; compressed-tensors W4A16 per group and per
channel, asymmetric, actorder "group", W8A16), written in each tool's layout by
pagedserve/testing/int_checkpoints.py. The engine's greedy tokens equal transformers' running the dequantized
weights in float32 (pagedserve/testing/int_checkpoint_reader.py reads each format from its own definition); two
tensor-parallel ranks equal one; what cannot be served is refused naming why."""

from __future__ import annotations

import json

import pytest
import torch

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
from worker_svc.model_config import ModelConfig
from worker_svc.models.model_loader import load_model
from worker_svc.tensor_parallel import TensorParallel

FORMATS = {
    "awq": lambda source, target: write_awq_checkpoint(source, target, group_size=32),
    "awq_no_zero_point": lambda source, target: write_awq_checkpoint(source, target, group_size=32, zero_point=False),
    "gptq4_sym": lambda source, target: write_gptq_checkpoint(source, target, 4, group_size=32),
    "gptq4_asym_desc_act": lambda source, target: write_gptq_checkpoint(source, target, 4, 32, sym=False,
                                                                        desc_act=True),
    "gptq8_asym": lambda source, target: write_gptq_checkpoint(source, target, 8, group_size=32, sym=False),
    "gptq4_asym_v2": lambda source, target: write_gptq_checkpoint(source, target, 4, 32, sym=False,
                                                                  checkpoint_format="gptq_v2"),
    "gptq4_channel": lambda source, target: write_gptq_checkpoint(source, target, 4, group_size=-1),
    "w4a16_group32": lambda source, target: write_compressed_tensors_int_checkpoint(source, target, 4, 32),
    "w4a16_channel_asym": lambda source, target: write_compressed_tensors_int_checkpoint(
        source, target, 4, None, symmetric=False),
    "w8a16_group32_asym": lambda source, target: write_compressed_tensors_int_checkpoint(
        source, target, 8, 32, symmetric=False),
    "w4a16_group32_asym_actorder": lambda source, target: write_compressed_tensors_int_checkpoint(
        source, target, 4, 32, symmetric=False, actorder=True),
}
CASES = [("llama", name) for name in FORMATS] + [
    (arch, name) for arch in ("qwen2", "qwen3", "phi3")  # Phi-3: q|k|v and gate|up fused in the checkpoint
    for name in ("awq", "gptq4_asym_desc_act", "w4a16_channel_asym")
]
NEW_TOKENS = 6
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _checkpoint(tmp_path, arch: str, fmt: str):
    source = make_tiny_model(tmp_path, arch, seed=3)
    return source, FORMATS[fmt](source, tmp_path / f"{arch}-{fmt}")


def _transformers_on_dequantized_weights(source, served):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    state = {name: tensor.float() for name, tensor in dequantized_int_state_dict(served).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in name or "lm_head" in name for name in missing), (missing, unexpected)
    return model


@pytest.mark.parametrize("arch, fmt", CASES)
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(tmp_path, arch, fmt):
    source, served = _checkpoint(tmp_path, arch, fmt)
    model, config = load_model(served, torch.float32, "cpu")
    method = {"a": "awq", "g": "gptq", "w": "compressed-tensors"}[fmt[0]]
    assert config.quantization is not None and config.quantization.method == method
    layers = [module for name, module in model.named_modules() if name.endswith(PROJECTIONS)]
    assert layers and all(layer.qweight.dtype == torch.int32 for layer in layers)
    reference = _transformers_on_dequantized_weights(source, served)
    prompts = make_prompts(config.vocab_size, [11, 5])
    ours = greedy_generate_paged(model, config, prompts, NEW_TOKENS, prefill_chunk=4)
    assert ours == [hf_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]
    # Quantized for real: the logits are not the float model's.
    unquantized, _ = load_model(source, torch.float32, "cpu")
    got, plain = (prefill_logits_paged(m, config, prompts[:1])[0] for m in (model, unquantized))
    assert ((got - plain).norm() / plain.norm()).item() > 1e-3


def test_awq_modules_to_not_convert_are_served_unquantized(tmp_path):
    """AutoAWQ's `modules_to_not_convert` (name substrings): those Linears keep float weights in the checkpoint and
    stay unquantized in the engine; the others are integer; greedy tokens equal transformers'."""
    source = make_tiny_model(tmp_path, "llama", seed=3)
    served = write_awq_checkpoint(source, tmp_path / "awq", group_size=32, modules_to_not_convert=("mlp.down_proj",))
    model, config = load_model(served, torch.float32, "cpu")
    assert config.quantization.modules_to_not_convert == ("mlp.down_proj",)
    layers = {name: module for name, module in model.named_modules() if name.endswith(PROJECTIONS)}
    for name, layer in layers.items():
        if name.endswith("down_proj"):
            assert layer.weight.dtype == torch.float32 and not hasattr(layer, "qweight"), name
        else:
            assert layer.qweight.dtype == torch.int32 and not hasattr(layer, "weight"), name
    reference = _transformers_on_dequantized_weights(source, served)
    prompts = make_prompts(config.vocab_size, [11, 5])
    assert greedy_generate_paged(model, config, prompts, NEW_TOKENS, prefill_chunk=4) == \
        [hf_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("arch, fmt", [("qwen2", "awq"), ("qwen2", "gptq4_sym"), ("qwen2", "w4a16_channel_asym"),
                                       ("phi3", "awq")])
def test_two_tensor_parallel_ranks_give_the_single_rank_logits_and_tokens(tmp_path, arch, fmt):
    """Column-parallel layers take their ranks' packed output columns (AWQ's qweight [in, out / 8]; Phi-3's of
    each part of its fused tensors) or rows (compressed-tensors' [out, in / 8]); row-parallel ones their groups
    of input rows; per-channel scales whole."""
    _, served = _checkpoint(tmp_path, arch, fmt)
    prompts = [[1, 17, 300, 42, 9, 255, 7], [1, 5, 5, 480, 2, 61, 99, 100, 3]]
    run_ranks(check_sharded_model, str(served), prompts, 1e-4)


def test_act_order_on_a_row_parallel_layer_over_two_ranks_is_refused(tmp_path):
    _, served = _checkpoint(tmp_path, "llama", "gptq4_asym_desc_act")
    with pytest.raises(LoadRefused, match=r"cannot split model\.layers\.0\.self_attn\.o_proj over 2 tensor-parallel "
                                          r"rank\(s\): .*act-order \(g_idx\) on a row-parallel layer split over"):
        load_model(served, torch.float32, "meta", tensor_parallel=TensorParallel(rank=0, world_size=2))


def test_a_shard_that_splits_a_group_is_refused_naming_the_layer_and_the_group_size(tmp_path):
    """o_proj's 64 input rows over two ranks are 32 each: groups of 64 would span both ranks."""
    source = make_tiny_model(tmp_path, "llama", seed=3)
    served = write_gptq_checkpoint(source, tmp_path / "gptq", 4, group_size=64)
    with pytest.raises(LoadRefused, match=r"cannot split model\.layers\.0\.self_attn\.o_proj over 2 tensor-parallel "
                                          r"rank\(s\): scales: the 64 input columns split over 2 tensor-parallel "
                                          r"ranks give this rank columns 0\.\.31, .*one scale per group of 64"):
        load_model(served, torch.float32, "meta", tensor_parallel=TensorParallel(rank=0, world_size=2))
    load_model(served, torch.float32, "cpu")  # one rank holds every group


def _edit_quantization_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"].update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_the_quantization_flag_must_match_the_checkpoint_and_other_methods_are_refused_by_name(tmp_path):
    source, awq = _checkpoint(tmp_path, "llama", "awq")
    assert ModelConfig.from_path(awq, "awq").quantization == ModelConfig.from_path(awq).quantization
    # vLLM's Marlin names of the same checkpoints: served alike (by our kernel).
    assert ModelConfig.from_path(awq, "awq_marlin").quantization == ModelConfig.from_path(awq).quantization
    with pytest.raises(ValueError, match="--quantization gptq_marlin was given, but the checkpoint's "
                                         "quantization_config says quant_method 'awq'"):
        ModelConfig.from_path(awq, "gptq_marlin")
    with pytest.raises(ValueError, match="--quantization gptq was given, but the checkpoint's quantization_config "
                                         "says quant_method 'awq'"):
        ModelConfig.from_path(awq, "gptq")
    with pytest.raises(ValueError, match="--quantization awq was given, but the checkpoint's config.json declares no "
                                         "quantization_config"):
        ModelConfig.from_path(source, "awq")
    for method in ("bitsandbytes", "hqq", "marlin", "awq_marlin"):
        _edit_quantization_config(awq, quant_method=method)
        with pytest.raises(ValueError, match=f"quant_method '{method}', which this engine does not serve"):
            ModelConfig.from_path(awq)


@pytest.mark.parametrize("writer, change, words", [
    ("awq", {"version": "gemv"}, "AWQ version 'gemv' is not served"),
    ("awq", {"bits": 8}, "AWQ with 8-bit weights is not served"),
    ("gptq4_sym", {"bits": 3}, "GPTQ with 3-bit weights is not served"),
    ("gptq4_sym", {"checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin' is not served"),
    ("gptq4_sym", {"lm_head": True}, "quantized lm_head"),
    ("w4a16_group32", {"format": "int-quantized"}, "int-quantized weights .*'num_bits': 4.* are not served"),
])
def test_integer_configs_we_cannot_serve_are_refused_by_name(tmp_path, writer, change, words):
    _, served = _checkpoint(tmp_path, "llama", writer)
    with pytest.raises(ValueError, match=words):
        ModelConfig.from_path(_edit_quantization_config(served, **change))


def test_compressed_tensors_int_weights_with_activations_are_refused(tmp_path):
    _, served = _checkpoint(tmp_path, "llama", "w4a16_group32")
    config = json.loads((served / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
    (served / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="pack-quantized with input_activations is not served"):
        ModelConfig.from_path(served)


def test_dummy_weights_of_an_integer_checkpoint_give_finite_logits_of_a_sane_scale(tmp_path):
    _, served = _checkpoint(tmp_path, "llama", "gptq4_asym_desc_act")
    model, config = load_model(served, torch.float32, "cpu", load_format="dummy")
    layer = model.model.layers[0].self_attn.qkv_proj
    dequantized_std = layer(torch.eye(config.hidden_size)).std().item()
    assert 0.005 < dequantized_std < 0.05  # about N(0, 0.02), as the unquantized dummy weights
    logits = prefill_logits_paged(model, config, [[1, 2, 3, 4]])[0]
    assert torch.isfinite(logits).all()


def test_fused_parts_with_different_act_orders_are_refused():
    """q|k|v run as one matmul over one permuted input: their g_idx must agree (GPTQ gives them one)."""
    from worker_svc.integer_quantization import IntegerScheme
    from worker_svc.layers.checkpoint_tensor import CheckpointTensor
    from worker_svc.layers.parallel_linear import ColumnParallelLinear
    from worker_svc.layers.wna16_linear import Wna16Linear

    layer = ColumnParallelLinear(64, [(0, 16), (0, 8)], bias=False)
    with torch.device("meta"):
        layer.set_linear_method(Wna16Linear(IntegerScheme("gptq", "gptq", 4, 32, True, act_order=True), False),
                                torch.float32)
    layer = layer.to_empty(device="cpu")
    for part, rows in enumerate((16, 8)):
        g_idx = torch.arange(64, dtype=torch.int32) // 32
        tensors = {"qweight": torch.zeros(8, rows, dtype=torch.int32), "qzeros": torch.zeros(2, rows // 8,
                   dtype=torch.int32), "scales": torch.ones(2, rows), "g_idx": g_idx if part == 0 else g_idx.flip(0)}
        for kind, tensor in tensors.items():
            layer.load(kind, CheckpointTensor(tensor, tuple(tensor.shape)), part)
    with pytest.raises(ValueError, match="fused parts of this layer have different act orders"):
        layer.process_after_loading()
