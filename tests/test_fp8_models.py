"""Tiny Llama and Qwen2 served FP8: compressed-tensors checkpoints (per-channel weights with per-token
activations, llm-compressor's FP8_DYNAMIC; per-tensor weights with static activations, its FP8) and online
`--quantization fp8`. The engine's logits equal transformers' running the dequantized weights with each
linear layer's input quantized the same way, sharded over two ranks too; what is refused is refused by
ModelConfig, before loading (worker_svc/quantization_config.py). MoE models: tests/test_fp8_moe_models.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kernels.fp8_linear_ref import quantize_per_token, quantize_to_fp8, quantize_weight_per_channel
from pagedserve.testing.fp8_checkpoints import LINEAR_WEIGHT, dequantized_state_dict, write_fp8_checkpoint
from pagedserve.testing.paged_runner import greedy_generate_paged, prefill_logits_paged
from pagedserve.testing.tiny_models import make_tiny_model
from tests.test_models import make_prompts
from tests.test_parallel_layers import check_sharded_model, run_ranks
from worker_svc.model_config import ModelConfig
from worker_svc.models.model_loader import load_model

SCHEMES = {"fp8_dynamic": ("channel", True), "fp8_static": ("tensor", False), "online": None}
# The checkpoint projections each fused layer quantizes its input for once (a static scale: their largest).
FUSED_GROUPS = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj"),
                "v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
                "up_proj": ("gate_proj", "up_proj")}
NEW_TOKENS = 12


def _checkpoints(tmp_path, arch: str, scheme: str):
    """(unquantized dir, dir the engine loads, its --quantization flag)."""
    source = make_tiny_model(tmp_path, arch, seed=3)
    if SCHEMES[scheme] is None:
        return source, source, "fp8"
    strategy, dynamic = SCHEMES[scheme]
    return source, write_fp8_checkpoint(source, tmp_path / f"{arch}-{scheme}", strategy, dynamic), None


def _static_input_scales(fp8_dir) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in fp8_dir.glob("*.safetensors"):
        tensors.update(load_file(file))
    return {name.removesuffix(".input_scale"): tensor.float() for name, tensor in tensors.items()
            if name.endswith(".input_scale")}


def _transformers_reference(source, fp8_dir, online: bool):
    """transformers' model of `source` with the dequantized weights, each decoder linear layer's input quantized
    and dequantized as the FP8 layer does (per token; or the fused group's largest static scale)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    if online:
        state = {name: quantize_weight_per_channel(weight) for name, weight in model.state_dict().items()
                 if LINEAR_WEIGHT.match(name)}
        state = {name: q.float() * s.reshape(-1, 1) for name, (q, s) in state.items()}
    else:
        state = dequantized_state_dict(fp8_dir)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not any(LINEAR_WEIGHT.match(name) for name in missing), (missing, unexpected)
    static = {} if online else _static_input_scales(fp8_dir)
    for name, module in model.named_modules():
        if not LINEAR_WEIGHT.match(f"{name}.weight"):
            continue
        stem, _, projection = name.rpartition(".")
        group = FUSED_GROUPS.get(projection, (projection,))
        scale = max(static[f"{stem}.{part}"] for part in group) if static else None

        def fake_quantize(module, args, scale=scale):
            x = args[0].reshape(-1, args[0].shape[-1])
            if scale is None:
                quantized, scales = quantize_per_token(x)
            else:
                quantized, scales = quantize_to_fp8(x, scale), scale
            return ((quantized.float() * scales).reshape(args[0].shape),)

        module.register_forward_pre_hook(fake_quantize)
    return model


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp8_logits_equal_transformers_on_the_dequantized_weights_with_quantized_activations(tmp_path, arch, scheme):
    source, served, flag = _checkpoints(tmp_path, arch, scheme)
    model, config = load_model(served, torch.float32, "cpu", quantization=flag)
    assert config.quantization is not None
    assert all(module.weight.dtype == torch.float8_e4m3fn for name, module in model.named_modules()
               if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")))
    reference = _transformers_reference(source, served, online=flag == "fp8")
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


def test_a_static_fp8_checkpoint_over_two_ranks_gives_the_single_rank_logits_and_tokens(tmp_path):
    """Per-tensor weight scales (one per fused part on every rank) and static input scales: each rank quantizes
    its share of a row-parallel input exactly as one rank quantizes the whole, so the ranks' partial products
    sum to the single rank's."""
    source = make_tiny_model(tmp_path, "qwen2", seed=3)
    served = write_fp8_checkpoint(source, tmp_path / "qwen2-static", "tensor", dynamic=False)
    prompts = [[1, 17, 300, 42, 9, 255, 7], [1, 5, 5, 480, 2, 61, 99, 100, 3]]
    run_ranks(check_sharded_model, str(served), prompts, 1e-4)


def _with_quantization_config(tmp_path, arch: str, quantization: dict | None = None, **overrides):
    model = make_tiny_model(tmp_path, arch, seed=3, **overrides)
    if quantization is not None:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return model


def test_quantization_refusals_name_the_method_and_the_flag(tmp_path):
    bnb = _with_quantization_config(tmp_path / "bnb", "llama", {"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes', which this engine does not serve"):
        ModelConfig.from_path(bnb)
    gptq = _with_quantization_config(tmp_path, "llama", {"quant_method": "gptq", "bits": 4, "group_size": 32})
    with pytest.raises(ValueError, match="--quantization compressed-tensors was given, but the checkpoint's "
                                         "quantization_config says quant_method 'gptq'"):
        ModelConfig.from_path(gptq, "compressed-tensors")
    with pytest.raises(ValueError, match="--quantization fp8 quantizes an unquantized checkpoint at load, but this "
                                         "one is already quantized"):
        ModelConfig.from_path(gptq, "fp8")
    source = make_tiny_model(tmp_path, "llama", seed=3)
    fp8 = write_fp8_checkpoint(source, tmp_path / "fp8")
    assert ModelConfig.from_path(fp8, "compressed-tensors").quantization == ModelConfig.from_path(fp8).quantization
    with pytest.raises(ValueError, match="already quantized .*'compressed-tensors'"):
        ModelConfig.from_path(fp8, "fp8")
    with pytest.raises(ValueError, match="declares no quantization_config"):
        ModelConfig.from_path(source, "compressed-tensors")
    with pytest.raises(ValueError, match="--quantization gguf needs a .gguf model file"):
        ModelConfig.from_path(source, "gguf")
    assert ModelConfig.from_path(source).quantization is None


@pytest.mark.parametrize("change, words", [
    ({"format": "marlin-24"}, "format 'marlin-24' is not served"),
    ({"format": "pack-quantized"}, "pack-quantized with input_activations is not served"),
    ({"config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                                       "strategy": "group", "group_size": 128}}}},
     "compressed-tensors weights"),
    ({"config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}}},
     "weight-only FP8 is not served yet"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
])
def test_compressed_tensors_schemes_other_than_fp8_w8a8_are_refused(tmp_path, change, words):
    fp8 = write_fp8_checkpoint(make_tiny_model(tmp_path, "llama", seed=3), tmp_path / "fp8")
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"].update(change)
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=words):
        ModelConfig.from_path(fp8)


def test_an_ignore_list_that_splits_a_fused_projection_is_refused_and_one_that_names_all_of_it_is_served(tmp_path):
    source = make_tiny_model(tmp_path, "llama", seed=3)
    split = write_fp8_checkpoint(source, tmp_path / "split", ignore=("lm_head", "model.layers.0.self_attn.q_proj"))
    from service_runtime.load_refusal import LoadRefused

    with pytest.raises(LoadRefused, match="leaves some of .*q_proj.* unquantized"):
        load_model(split, torch.float32, "cpu")
    whole = write_fp8_checkpoint(source, tmp_path / "whole", ignore=("lm_head", "re:.*layers\\.0\\.mlp\\..*"))
    model, _ = load_model(whole, torch.float32, "cpu")
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float32  # ignored: unquantized
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert model.model.layers[1].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn


def test_fp8_with_batch_invariant_kernels_is_refused(tmp_path):
    from kernels.batch_invariant_ref import batch_invariant_torch_layer_ops
    from service_runtime.load_refusal import LoadRefused

    with pytest.raises(LoadRefused, match="no batch-invariant matmul"):
        load_model(make_tiny_model(tmp_path, "llama", seed=3), torch.float32, "cpu",
                   layer_ops=batch_invariant_torch_layer_ops(), quantization="fp8")


@pytest.mark.parametrize("value", ["fp8", "compressed-tensors", "awq", "gptq", "awq_marlin", "gptq_marlin"])
def test_serve_accepts_the_quantization_flags_and_forwards_them_to_every_rank(value):
    from pagedserve.launcher import worker_rank_argvs
    from tests.test_serve_cli import serve

    args = serve("--quantization", value, "--tensor-parallel-size", "2")
    for argv in worker_rank_argvs(args, [], "ipc://x", "tcp://127.0.0.1:1"):
        assert argv[argv.index("--quantization") + 1] == value
    (plain,) = worker_rank_argvs(serve(), [], "ipc://x", None)
    assert "--quantization" not in plain
