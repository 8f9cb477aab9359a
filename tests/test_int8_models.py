"""Tiny Llama and Qwen2 served INT8 W8A8 from compressed-tensors "int-quantized" checkpoints (llm-compressor's W8A8:
per-channel int8 weights, per-token int8 activations; and per-tensor weights with static activations). The
engine's logits equal transformers' running the same checkpoint through compressed-tensors 0.20.0 itself (its
decompressor and its quantized forward, which quantizes each Linear's input as the checkpoint says), sharded over
two ranks too; the checkpoint writer is compressed-tensors' own compressor's bytes; what is refused is refused by
ModelConfig, before loading (worker_svc/int8_quantization.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pagedserve.testing.fp8_checkpoints import LINEAR_WEIGHT
from pagedserve.testing.int8_checkpoints import dequantized_int8_state_dict, write_int8_checkpoint
from pagedserve.testing.paged_runner import greedy_generate_paged, prefill_logits_paged
from pagedserve.testing.tiny_models import make_tiny_model
from tests.test_models import make_prompts
from tests.test_parallel_layers import check_sharded_model, run_ranks
from worker_svc.int8_quantization import Int8Scheme
from worker_svc.model_config import ModelConfig
from worker_svc.models.model_loader import load_model

SCHEMES = {"w8a8_dynamic": ("channel", True), "w8a8_static": ("tensor", False)}
# The projections a fused layer quantizes its input for once (a static scale: their largest).
FUSED_GROUPS = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj"),
                "v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
                "up_proj": ("gate_proj", "up_proj")}
NEW_TOKENS = 12


def _compressed_tensors_reference(served):
    """transformers' model of the INT8 checkpoint `served`, loaded by compressed-tensors (decompressed weights,
    each Linear's input quantized by compressed-tensors' forward), with every static input scale set to its
    fused group's largest, as the engine's fused matmul uses."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32).eval()
    modules = dict(model.named_modules())
    quantized = [name for name in modules if LINEAR_WEIGHT.match(f"{name}.weight")]
    assert quantized and all(modules[name].quantization_scheme.input_activations is not None for name in quantized)
    with torch.no_grad():
        for name in quantized:
            if hasattr(modules[name], "input_scale"):
                stem, _, projection = name.rpartition(".")
                group = FUSED_GROUPS.get(projection, (projection,))
                largest = max(modules[f"{stem}.{part}"].input_scale.max() for part in group)
                modules[name].input_scale.fill_(largest)
    return model


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


def _median_row_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm(dim=-1) / reference.norm(dim=-1)).median().item()


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_logits_equal_compressed_tensors_forward_of_the_same_checkpoint(tmp_path, arch, scheme):
    source = make_tiny_model(tmp_path, arch, seed=3)
    served = write_int8_checkpoint(source, tmp_path / f"{arch}-{scheme}", *SCHEMES[scheme])
    model, config = load_model(served, torch.float32, "cpu")
    assert isinstance(config.quantization, Int8Scheme)
    assert all(module.weight.dtype == torch.int8 for name, module in model.named_modules()
               if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")))
    reference = _compressed_tensors_reference(served)
    unquantized, _ = load_model(source, torch.float32, "cpu")
    # The same weights without the activation quantization: shows the activations really are quantized.
    weights_only = _compressed_tensors_reference(served)
    for module in weights_only.modules():
        module.quantization_enabled = False
    prompts = make_prompts(config.vocab_size, [23, 5, 40])
    ours = prefill_logits_paged(model, config, prompts, seed=2)
    for prompt, logits in zip(prompts, ours):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
            unquantized_activations = weights_only(torch.tensor([prompt])).logits[0]
        # The same math: most positions agree to float32 noise. Not all: the engine's attention sums in another
        # order than transformers', and a 1e-7 difference that moves an activation across a rounding boundary
        # moves that int8 value by one step, and with it this position and every later one a little (on
        # these prompts at most 7 of 23 positions, at most 1.5% each).
        assert _median_row_error(logits, expected) < 1e-5
        assert _relative_error(logits, expected) < 2e-2
        assert _median_row_error(logits, unquantized_activations) > 1e-4  # the activations are quantized
    int8_tokens = greedy_generate_paged(model, config, prompts, NEW_TOKENS, prefill_chunk=7, seed=4)
    plain_tokens = greedy_generate_paged(unquantized, config, prompts, NEW_TOKENS, prefill_chunk=7, seed=4)
    agreement = sum(a == b for x, y in zip(int8_tokens, plain_tokens) for a, b in zip(x, y)) / (3 * NEW_TOKENS)
    print(f"{arch} {scheme}: greedy tokens agreeing with the unquantized model: {agreement:.0%}")


def test_a_static_int8_checkpoint_over_two_ranks_gives_the_single_rank_logits_and_tokens(tmp_path):
    """Per-channel weight scales split with the rows, static input scales: each rank quantizes its share of a
    row-parallel input exactly as one rank quantizes the whole, so the ranks' partial products sum to the single
    rank's."""
    source = make_tiny_model(tmp_path, "qwen2", seed=3)
    served = write_int8_checkpoint(source, tmp_path / "qwen2-static", "channel", dynamic=False)
    prompts = [[1, 17, 300, 42, 9, 255, 7], [1, 5, 5, 480, 2, 61, 99, 100, 3]]
    run_ranks(check_sharded_model, str(served), prompts, 1e-4)


def test_a_dummy_int8_model_has_int8_weights_of_a_sane_scale_and_finite_distinct_logits(tmp_path):
    served = write_int8_checkpoint(make_tiny_model(tmp_path, "llama", seed=3), tmp_path / "static", "tensor", False)
    model, config = load_model(served, torch.float32, "cpu", load_format="dummy")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8
    assert 0.005 < qkv(torch.eye(config.hidden_size)).std().item() < 0.05  # about N(0, 0.02), as unquantized
    (logits,) = prefill_logits_paged(model, config, [[1, 17, 300, 42, 9]])
    assert torch.isfinite(logits).all() and logits.std(dim=-1).min() > 0


@pytest.mark.parametrize("strategy, dynamic", [("channel", True), ("tensor", False)])
def test_compressed_tensors_compresses_to_our_int8_bytes_and_reads_our_weights(tmp_path, strategy, dynamic):
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    source = make_tiny_model(tmp_path, "llama", seed=11)
    served = write_int8_checkpoint(source, tmp_path / "int8", strategy, dynamic)
    originals, ours = load_file(next(source.glob("*.safetensors"))), load_file(next(served.glob("*.safetensors")))
    dequantized = dequantized_int8_state_dict(served)
    group = json.loads((served / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate(group)
    if strategy == "channel":  # llm-compressor's W8A8 preset, field for field (its observer is filled in later)
        preset = preset_name_to_scheme("W8A8", ["Linear"])
        for ours_args, preset_args in [(scheme.weights, preset.weights),
                                       (scheme.input_activations, preset.input_activations)]:
            assert ours_args.model_dump(exclude={"observer"}) == preset_args.model_dump(exclude={"observer"})
    for layer in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        scale = ours[f"{layer}.weight_scale"]
        assert scale.shape == ((ours[f"{layer}.weight"].shape[0], 1) if strategy == "channel" else (1,))
        theirs = IntQuantizationCompressor.compress({"weight": originals[f"{layer}.weight"], "weight_scale": scale},
                                                    scheme)
        assert theirs["weight"].dtype == torch.int8 and torch.equal(theirs["weight"], ours[f"{layer}.weight"])
        assert set(theirs) == {"weight", "weight_scale"}
        read = IntQuantizationCompressor.decompress({"weight": ours[f"{layer}.weight"], "weight_scale": scale},
                                                    scheme)["weight"]
        torch.testing.assert_close(read.float(), dequantized[f"{layer}.weight"], rtol=0, atol=0)
        assert (ours[f"{layer}.input_scale"].shape == (1,)) if not dynamic else f"{layer}.input_scale" not in ours


def _edited(tmp_path, group_change: dict, **config_change):
    served = write_int8_checkpoint(make_tiny_model(tmp_path, "llama", seed=3), tmp_path / "int8")
    config = json.loads((served / "config.json").read_text())
    for part, fields in group_change.items():
        config["quantization_config"]["config_groups"]["group_0"][part] = fields and {
            **config["quantization_config"]["config_groups"]["group_0"][part], **fields}
    config["quantization_config"].update(config_change)
    (served / "config.json").write_text(json.dumps(config))
    return served


@pytest.mark.parametrize("group_change, words", [
    ({"input_activations": {"symmetric": False}}, "asymmetric input_activations \\(zero points\\) is not served"),
    ({"weights": {"symmetric": False}}, "int-quantized weights .* are not served"),
    ({"weights": {"strategy": "group", "group_size": 128}}, "int-quantized weights .* are not served"),
    ({"weights": {"num_bits": 4}}, "int-quantized weights .* are not served"),
    ({"input_activations": {"strategy": "tensor"}}, "input_activations .* are not served"),
    ({"input_activations": {"type": "float"}}, "input_activations .* are not served"),
    ({"input_activations": None}, "without input_activations \\(weight-only int8\\)"),
])
def test_int8_configs_we_cannot_serve_are_refused_by_name(tmp_path, group_change, words):
    with pytest.raises(ValueError, match=words):
        ModelConfig.from_path(_edited(tmp_path, group_change))


def test_int8_checkpoints_parse_to_their_scheme_and_are_refused_on_fused_moe_models(tmp_path):
    served = write_int8_checkpoint(make_tiny_model(tmp_path, "llama", seed=3), tmp_path / "int8", "tensor", False)
    assert ModelConfig.from_path(served).quantization == Int8Scheme("tensor", False, ("lm_head",))
    assert ModelConfig.from_path(served, "compressed-tensors").quantization == Int8Scheme("tensor", False,
                                                                                          ("lm_head",))
    with pytest.raises(ValueError, match="already quantized .*'compressed-tensors'"):
        ModelConfig.from_path(served, "fp8")
    moe = make_tiny_model(tmp_path / "moe", "mixtral", seed=3)
    config = json.loads((moe / "config.json").read_text())
    config["quantization_config"] = json.loads((served / "config.json").read_text())["quantization_config"]
    (moe / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="INT8 W8A8 .* is not served for mixtral models: their fused MoE experts "
                                         "have no INT8 kernel"):
        ModelConfig.from_path(moe)
