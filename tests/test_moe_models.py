"""Mixtral and Qwen3-MoE over a paged KV cache reproduce transformers token for token (float32, CPU) and
round where it rounds in bf16; their checkpoints load per expert (the hub's names) or stacked (transformers 5's
layout), and what we do not support is refused at load naming the key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.layer_ops import torch_layer_ops
from pagedserve.testing.hf_reference import bf16_prefill_errors
from pagedserve.testing.paged_runner import greedy_generate_paged, prefill_logits_paged
from pagedserve.testing.tiny_models import make_tiny_model
from tests.test_models import NEW_TOKENS, PROMPT_LENS, hf_greedy, hf_logits, make_prompts
from worker_svc.layers.fused_moe import FusedMoE
from worker_svc.models.model_loader import load_model

# Experts each family's tiny model has, and the least number a prefill must route to in every sparse layer.
NUM_EXPERTS = {"mixtral": 4, "qwen3_moe": 8}
MIN_CHOSEN = {"mixtral": 4, "qwen3_moe": 6}


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_pair(request, tmp_path_factory):
    """(arch, checkpoint dir, our model, its config, HF model, experts each router chose in the first prefill)."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=0)
    chosen: list[set[int]] = []

    def recording_moe(hidden, router_logits, *args):
        chosen.append(set(torch.topk(router_logits, args[2], dim=-1).indices.flatten().tolist()))
        return torch_layer_ops().fused_moe(hidden, router_logits, *args)

    ops = dataclasses.replace(torch_layer_ops(), fused_moe=recording_moe)
    model, config = load_model(path, torch.float32, "cpu", layer_ops=ops)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, model, config, hf_model, chosen


def test_sparse_and_dense_layers_follow_the_config(moe_pair):
    """Mixtral: every layer sparse. The tiny Qwen3-MoE sets mlp_only_layers [1]: layer 1 is a dense MLP."""
    arch, _, model, _, _, _ = moe_pair
    sparse = [isinstance(layer.mlp, FusedMoE) for layer in model.model.layers]
    assert sparse == ([True, True, True] if arch == "mixtral" else [True, False, True])
    assert model.model.layers[0].mlp.w13_weight.shape[0] == NUM_EXPERTS[arch]


def test_batched_paged_prefill_logits_match_hf_and_route_to_many_experts(moe_pair):
    arch, _, model, config, hf_model, chosen = moe_pair
    chosen.clear()
    prompts = make_prompts(config.vocab_size, PROMPT_LENS)
    ours = prefill_logits_paged(model, config, prompts, block_size=16, seed=3)
    for prompt, logits in zip(prompts, ours):
        torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)
    assert chosen and all(len(experts) >= MIN_CHOSEN[arch] for experts in chosen), chosen


@pytest.mark.parametrize("prefill_chunk", [None, 7], ids=["whole_prefill", "chunked_prefill"])
def test_batched_paged_greedy_decode_matches_hf_generate(moe_pair, prefill_chunk):
    _, _, model, config, hf_model, _ = moe_pair
    prompts = make_prompts(config.vocab_size, PROMPT_LENS)
    ours = greedy_generate_paged(
        model, config, prompts, NEW_TOKENS, block_size=16, prefill_chunk=prefill_chunk, seed=5
    )
    for prompt, generated in zip(prompts, ours):
        assert generated == hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert len(set(generated)) > 1


def test_bf16_prefill_logits_round_where_transformers_rounds(moe_pair):
    """As tests/test_models.py's bf16 check: the same computation as transformers in bf16 (the MoE op rounds at
    HF's points, kernels/fused_moe_ref.py), so the error is far below bf16's own against fp32."""
    _, path, _, config, _, _ = moe_pair
    bf16_model, _ = load_model(path, torch.bfloat16, "cpu")
    prompts = make_prompts(config.vocab_size, [17, 40])
    for prompt, logits in zip(prompts, prefill_logits_paged(bf16_model, config, prompts,
                                                            kv_cache_dtype=torch.bfloat16)):
        ours_vs_hf, hf_bf16_vs_fp32 = bf16_prefill_errors(path, prompt, logits)
        assert ours_vs_hf < 0.1 * hf_bf16_vs_fp32, (len(prompt), ours_vs_hf, hf_bf16_vs_fp32)


def write_stacked_checkpoint(source: Path, target: Path, num_experts: int) -> Path:
    """The same weights with each layer's experts stacked as transformers 5 holds them
    (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]; Mixtral's block renamed mlp)."""
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    tensors = {name.replace(".block_sparse_moe.", ".mlp."): t for name, t in load_file(source / "model.safetensors").items()}
    gate, up, down = ("w1", "w3", "w2") if "mixtral" in source.name else ("gate_proj", "up_proj", "down_proj")
    layers = {name.split(".mlp.experts.")[0] for name in tensors if ".mlp.experts." in name}
    for layer in layers:
        expert = [f"{layer}.mlp.experts.{e}" for e in range(num_experts)]
        tensors[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([tensors.pop(f"{e}.{gate}.weight"), tensors.pop(f"{e}.{up}.weight")]) for e in expert])
        tensors[f"{layer}.mlp.experts.down_proj"] = torch.stack([tensors.pop(f"{e}.{down}.weight") for e in expert])
    save_file(tensors, target / "model.safetensors")
    return target


def test_stacked_experts_checkpoint_loads_the_same_weights(moe_pair, tmp_path):
    arch, path, model, config, _, _ = moe_pair
    stacked_dir = write_stacked_checkpoint(path, tmp_path / path.name, NUM_EXPERTS[arch])
    stacked, _ = load_model(stacked_dir, torch.float32, "cpu")
    ours = dict(model.named_parameters())
    for name, parameter in stacked.named_parameters():
        assert torch.equal(parameter, ours[name]), name


def test_a_missing_expert_is_refused(moe_pair, tmp_path):
    arch, path, _, _, _, _ = moe_pair
    target = tmp_path / "missing"
    target.mkdir()
    (target / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    up = "w3" if arch == "mixtral" else "up_proj"
    del tensors[f"model.layers.2.{block}.experts.3.{up}.weight"]
    save_file(tensors, target / "model.safetensors")
    with pytest.raises(ValueError, match=rf"lacks 1 parameters.*layers\.2\.{block}\.experts\.3\.{up}"):
        load_model(target, torch.float32, "cpu")


@pytest.mark.parametrize("key,value", [("shared_expert_intermediate_size", 64), ("use_sliding_window", True),
                                       ("hidden_act", "gelu")])
def test_unsupported_qwen3_moe_features_are_refused_naming_the_key(tmp_path, key, value):
    path = make_tiny_model(tmp_path, "qwen3_moe", num_hidden_layers=2)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=key):
        load_model(path, torch.float32, "cpu")


def test_a_rank_takes_the_same_slices_from_stacked_and_per_expert_tensors():
    """Rank 1 of 2: its half of each expert's intermediate dim, whichever layout the checkpoint has."""
    from worker_svc.layers.checkpoint_tensor import CheckpointTensor
    from worker_svc.layers.fused_moe import ALL_EXPERTS, GATE, UP
    from worker_svc.tensor_parallel import TensorParallel

    experts, hidden, inter = 3, 8, 6
    w13, w2 = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    tp = TensorParallel(rank=1, world_size=2)
    stacked, per_expert = (FusedMoE(hidden, experts, inter, 2, True, False, torch_layer_ops(), tp) for _ in "ab")
    stacked.load("w13_weight", CheckpointTensor(w13, tuple(w13.shape)), (ALL_EXPERTS, GATE))
    stacked.load("w2_weight", CheckpointTensor(w2, tuple(w2.shape)), (ALL_EXPERTS, GATE))
    for e in range(experts):
        gate, up = w13[e, :inter], w13[e, inter:]
        per_expert.load("w13_weight", CheckpointTensor(gate, tuple(gate.shape)), (e, GATE))
        per_expert.load("w13_weight", CheckpointTensor(up, tuple(up.shape)), (e, UP))
        per_expert.load("w2_weight", CheckpointTensor(w2[e], tuple(w2[e].shape)), (e, GATE))
    half = slice(inter // 2, inter)
    assert torch.equal(stacked.w13_weight, torch.cat([w13[:, :inter][:, half], w13[:, inter:][:, half]], dim=1))
    assert torch.equal(stacked.w2_weight, w2[:, :, half])
    assert torch.equal(per_expert.w13_weight, stacked.w13_weight) and torch.equal(per_expert.w2_weight, stacked.w2_weight)


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "mixtral-8x7b", "qwen2.5-1.5b"])
def test_benchmark_shapes_build_and_count_their_weights(shape, tmp_path):
    """benchmarks/model_shapes.py: the config the benchmark serves with --load-format dummy builds (on the meta
    device: no memory) with the parameters its byte count says; a decode step of one token reads k experts a
    layer, one of W1's 256 sequences (nearly) all of them."""
    from benchmarks.model_shapes import decode_weight_bytes, experts, parameter_bytes, write_config_dir
    from worker_svc.model_config import ModelConfig
    from worker_svc.models.registry import build_model

    config = ModelConfig.from_path(write_config_dir(shape, tmp_path / shape))
    with torch.device("meta"):
        model = build_model(config)
    num_params = sum(p.numel() for p in model.parameters())
    assert 2 * num_params == parameter_bytes(shape)
    if experts(shape)[0]:
        num_experts, top_k, width = experts(shape)
        skipped = (num_experts - top_k) * 3 * config.hidden_size * width * config.num_hidden_layers * 2
        assert decode_weight_bytes(shape, 1) == pytest.approx(parameter_bytes(shape) - skipped)
        assert decode_weight_bytes(shape, 256) == pytest.approx(parameter_bytes(shape), rel=1e-3)
    else:
        assert decode_weight_bytes(shape, 1) == parameter_bytes(shape)
