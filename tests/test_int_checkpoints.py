"""The AWQ, GPTQ and compressed-tensors pack-quantized test checkpoints (pagedserve/testing/int_checkpoints.py) of a
tiny Llama: tensor names, dtypes and shapes as each tool saves them, config.json's quantization_config, words
unpacked by hand in each format's own order, dequantized weights within half a quantization step of the
original, and transformers running the dequantized state dict (int_checkpoint_reader.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.testing.fp8_checkpoints import LINEAR_WEIGHT
from pagedserve.testing.int_checkpoint_reader import dequantized_int_state_dict
from pagedserve.testing.int_checkpoints import (
    GPTQMODEL_META,
    act_order_permutation,
    pack_int32,
    write_awq_checkpoint,
    write_compressed_tensors_int_checkpoint,
    write_gptq_checkpoint,
)
from pagedserve.testing.tiny_models import make_tiny_model

AWQ, GPTQ, CT = write_awq_checkpoint, write_gptq_checkpoint, write_compressed_tensors_int_checkpoint
# name: (writer, its arguments, wide). Wide models (hidden 128, intermediate 256) take group 128.
CASES = {
    "awq-g32": (AWQ, dict(group_size=32), False),
    "awq-g128": (AWQ, dict(group_size=128), True),
    "awq-g64-no-zero-point": (AWQ, dict(group_size=64, zero_point=False), False),
    "awq-g32-down-proj-float": (AWQ, dict(group_size=32, modules_to_not_convert=("mlp.down_proj",)), False),
    "gptq4-g32": (GPTQ, dict(bits=4, group_size=32), False),
    "gptq4-g32-asym": (GPTQ, dict(bits=4, group_size=32, sym=False), False),
    "gptq4-g32-asym-v2": (GPTQ, dict(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2"), False),
    "gptq4-g128-desc-act": (GPTQ, dict(bits=4, group_size=128, desc_act=True), True),
    "gptq8-g32-asym-desc-act": (GPTQ, dict(bits=8, group_size=32, sym=False, desc_act=True), False),
    "gptq8-g32": (GPTQ, dict(bits=8, group_size=32), False),
    "ct4-g32": (CT, dict(bits=4, group_size=32), False),
    "ct4-g64-asym": (CT, dict(bits=4, group_size=64, symmetric=False), False),
    "ct4-g32-asym-actorder": (CT, dict(bits=4, group_size=32, symmetric=False, actorder=True), False),
    "ct4-g128-asym": (CT, dict(bits=4, group_size=128, symmetric=False), True),
    "ct4-channel-asym": (CT, dict(bits=4, group_size=None, symmetric=False), False),
    "ct8-channel": (CT, dict(bits=8, group_size=None), False),
    "ct8-g64-asym": (CT, dict(bits=8, group_size=64, symmetric=False), False),
}
Q_PROJ = "model.layers.0.self_attn.q_proj"
MASK = 0xFFFFFFFF  # an int32 word as its 32 unsigned bits


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    directory = tmp_path_factory.mktemp("int-sources")
    return {False: make_tiny_model(directory, "llama", seed=5),
            True: make_tiny_model(directory, "llama", seed=5, hidden_size=128, intermediate_size=256)}


@pytest.fixture(scope="module")
def written(sources, tmp_path_factory):
    """case name -> (source directory, quantized directory), each written once."""
    directory = tmp_path_factory.mktemp("int-checkpoints")
    return {name: (sources[wide], writer(sources[wide], directory / name, **kwargs))
            for name, (writer, kwargs, wide) in CASES.items()}


def _tensors(directory):
    tensors = {}
    for file in directory.glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


def _converted(case: str, layer: str) -> bool:
    return not any(module in layer for module in CASES[case][1].get("modules_to_not_convert", ()))


def _expected_layout(case: str, layer: str, out_features: int,
                     in_features: int) -> dict[str, tuple[torch.dtype, tuple]]:
    writer, kwargs, _ = CASES[case]
    bits = kwargs.get("bits", 4)
    pack, groups = 32 // bits, in_features // (kwargs["group_size"] or in_features)
    if not _converted(case, layer):
        return {"weight": (torch.float32, (out_features, in_features))}
    if writer is AWQ:
        return {"qweight": (torch.int32, (in_features, out_features // 8)),
                "qzeros": (torch.int32, (groups, out_features // 8)), "scales": (torch.float16, (groups, out_features))}
    if writer is GPTQ:
        return {"qweight": (torch.int32, (in_features // pack, out_features)),
                "qzeros": (torch.int32, (groups, out_features // pack)),
                "scales": (torch.float16, (groups, out_features)), "g_idx": (torch.int32, (in_features,))}
    layout = {"weight_packed": (torch.int32, (out_features, in_features // pack)),
              "weight_scale": (torch.float32, (out_features, groups)), "weight_shape": (torch.int64, (2,))}
    if not kwargs.get("symmetric", True):
        layout["weight_zero_point"] = (torch.int32, (out_features // pack, groups))
    if kwargs.get("actorder"):
        layout["weight_g_idx"] = (torch.int32, (in_features,))
    return layout


def _element_scales(case: str, tensors, layer: str) -> torch.Tensor:
    """The scale each element of `layer`'s W [out, in] was quantized with, read the format's way."""
    writer = CASES[case][0]
    if writer is AWQ:
        scales = tensors[f"{layer}.scales"].float()
        return scales.repeat_interleave(tensors[f"{layer}.qweight"].shape[0] // scales.shape[0], dim=0).t()
    if writer is GPTQ:
        return tensors[f"{layer}.scales"].float()[tensors[f"{layer}.g_idx"].long()].t()
    scales = tensors[f"{layer}.weight_scale"].float()
    if f"{layer}.weight_g_idx" in tensors:
        return scales[:, tensors[f"{layer}.weight_g_idx"].long()]
    return scales.repeat_interleave(int(tensors[f"{layer}.weight_shape"][1]) // scales.shape[1], dim=1)


@pytest.mark.parametrize("case", CASES)
def test_each_linear_is_stored_with_the_tools_names_dtypes_and_shapes(written, case):
    source, directory = written[case]
    original, tensors = _tensors(source), _tensors(directory)
    linears = [name for name in original if LINEAR_WEIGHT.match(name)]
    assert len(linears) == 7 * 3
    for name in linears:
        layer = name.removesuffix(".weight")
        stored = {key.removeprefix(f"{layer}."): (value.dtype, tuple(value.shape))
                  for key, value in tensors.items() if key.startswith(f"{layer}.")}
        assert stored == _expected_layout(case, layer, *original[name].shape), layer
    unquantized = {name for name in original if not LINEAR_WEIGHT.match(name)}
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= unquantized
    assert all(torch.equal(tensors[name], original[name]) for name in unquantized)


@pytest.mark.parametrize("case", CASES)
def test_dequantized_weights_are_within_half_a_step_of_the_original(written, case):
    source, directory = written[case]
    original, tensors, dequantized = _tensors(source), _tensors(directory), dequantized_int_state_dict(directory)
    assert set(dequantized) == set(original)
    for name, weight in original.items():
        if not LINEAR_WEIGHT.match(name) or not _converted(case, name.removesuffix(".weight")):
            assert torch.equal(dequantized[name], weight)
            continue
        assert dequantized[name].dtype == torch.float32 and dequantized[name].shape == weight.shape
        scales = _element_scales(case, tensors, name.removesuffix(".weight"))
        error = (dequantized[name] - weight).abs()
        assert (error <= 0.505 * scales + 1e-7).all(), (name, (error / scales).max())
        assert error.max() > 0.1 * scales.max()  # really rounded, not a copy


def test_quantization_configs_are_what_the_tools_write(written):
    def config(case):
        return json.loads((written[case][1] / "config.json").read_text())["quantization_config"]

    assert config("awq-g64-no-zero-point") == {"quant_method": "awq", "zero_point": False, "group_size": 64,
                                               "bits": 4, "version": "gemm", "modules_to_not_convert": None}
    assert config("gptq8-g32-asym-desc-act") == {
        "bits": 8, "group_size": 32, "desc_act": True, "sym": False, "lm_head": False, "quant_method": "gptq",
        "checkpoint_format": "gptq", "pack_dtype": "int32", "meta": GPTQMODEL_META}
    channel = config("ct4-channel-asym")
    assert channel["quant_method"] == "compressed-tensors" and channel["format"] == "pack-quantized"
    assert channel["ignore"] == ["lm_head"] and channel["quantization_status"] == "compressed"
    assert channel["config_groups"] == {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None, "format": "pack-quantized",
        "weights": {"num_bits": 4, "type": "int", "symmetric": False, "group_size": None, "strategy": "channel",
                    "dynamic": False}}}
    assert config("ct8-g64-asym")["config_groups"]["group_0"]["weights"] == {
        "num_bits": 8, "type": "int", "symmetric": False, "group_size": 64, "strategy": "group", "dynamic": False}
    assert config("ct4-g32-asym-actorder")["config_groups"]["group_0"]["weights"] == {
        "num_bits": 4, "type": "int", "symmetric": False, "group_size": 32, "strategy": "group", "dynamic": False,
        "actorder": "group"}
    assert config("awq-g32-down-proj-float")["modules_to_not_convert"] == ["mlp.down_proj"]


def test_awq_word_holds_eight_output_columns_in_autoawq_order(written):
    source, directory = written["awq-g32"]
    tensors, weight = _tensors(directory), _tensors(source)[f"{Q_PROJ}.weight"]
    dequantized = dequantized_int_state_dict(directory)[f"{Q_PROJ}.weight"]
    k = 37  # input row 37, group 1; word 1 holds output columns 8..15
    word, zero_word = int(tensors[f"{Q_PROJ}.qweight"][k, 1]) & MASK, int(tensors[f"{Q_PROJ}.qzeros"][1, 1]) & MASK
    for slot, column in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
        n = 8 + column
        q, zero = (word >> 4 * slot) & 0xF, (zero_word >> 4 * slot) & 0xF
        scale = float(tensors[f"{Q_PROJ}.scales"][1, n])
        assert float(dequantized[n, k]) == pytest.approx((q - zero) * scale, rel=1e-6)
        assert abs((q - zero) * scale - float(weight[n, k])) <= 0.505 * scale


def test_awq_without_zero_point_stores_zero_points_of_eight(written):
    qzeros = _tensors(written["awq-g64-no-zero-point"][1])[f"{Q_PROJ}.qzeros"]
    assert (qzeros == torch.tensor(0x88888888 - 2**32, dtype=torch.int32)).all()


def test_gptq_word_holds_consecutive_input_rows_and_zeros_are_stored_minus_one(written):
    source, directory = written["gptq4-g32-asym"]
    tensors, weight = _tensors(directory), _tensors(source)[f"{Q_PROJ}.weight"]
    dequantized = dequantized_int_state_dict(directory)[f"{Q_PROJ}.weight"]
    n = 13
    word = int(tensors[f"{Q_PROJ}.qweight"][5, n]) & MASK  # input rows 40..47, group 1
    zero = ((int(tensors[f"{Q_PROJ}.qzeros"][1, n // 8]) & MASK) >> 4 * (n % 8) & 0xF) + 1
    scale = float(tensors[f"{Q_PROJ}.scales"][1, n])
    for i in range(8):
        q, k = (word >> 4 * i) & 0xF, 40 + i
        assert float(dequantized[n, k]) == pytest.approx((q - zero) * scale, rel=1e-6)
        assert abs((q - zero) * scale - float(weight[n, k])) <= 0.505 * scale
    # Symmetric v1: every zero point is 2**(bits - 1), stored minus one in every field.
    for case, word in (("gptq4-g32", 0x77777777), ("gptq8-g32", 0x7F7F7F7F)):
        tensors = _tensors(written[case][1])
        assert (tensors[f"{Q_PROJ}.qzeros"] == word).all()
        assert torch.equal(tensors[f"{Q_PROJ}.g_idx"], torch.arange(64, dtype=torch.int32) // 32)


def test_gptq_act_order_groups_follow_the_permutation_shared_by_projections_of_one_input(written):
    source, directory = written["gptq8-g32-asym-desc-act"]
    tensors, weight = _tensors(directory), _tensors(source)
    dequantized = dequantized_int_state_dict(directory)

    def g_idx(layer, projection):
        return tensors[f"model.layers.{layer}.{projection}.g_idx"]

    for layer in range(3):
        assert torch.equal(g_idx(layer, "self_attn.q_proj"), g_idx(layer, "self_attn.k_proj"))
        assert torch.equal(g_idx(layer, "self_attn.q_proj"), g_idx(layer, "self_attn.v_proj"))
        assert torch.equal(g_idx(layer, "mlp.gate_proj"), g_idx(layer, "mlp.up_proj"))
    assert not torch.equal(g_idx(0, "self_attn.q_proj"), g_idx(0, "self_attn.o_proj"))
    assert not torch.equal(g_idx(0, "self_attn.q_proj"), g_idx(1, "self_attn.q_proj"))
    down = g_idx(0, "mlp.down_proj")
    permutation = act_order_permutation("model.layers.0.mlp.down_proj", 128)
    assert torch.equal(down[permutation], torch.arange(128, dtype=torch.int32) // 32)  # row perm[i]: group i // G
    assert not torch.equal(down, torch.arange(128, dtype=torch.int32) // 32)
    # 8-bit: input rows 4k..4k+3 in one word's bytes; row 7's group is g_idx[7], not 7 // 32.
    layer, n, k = "model.layers.0.mlp.down_proj", 3, 7
    word, group = int(tensors[f"{layer}.qweight"][1, n]) & MASK, int(down[k])
    zero = ((int(tensors[f"{layer}.qzeros"][group, n // 4]) & MASK) >> 8 * (n % 4) & 0xFF) + 1
    scale = float(tensors[f"{layer}.scales"][group, n])
    value = ((word >> 24) & 0xFF) - zero
    assert float(dequantized[f"{layer}.weight"][n, k]) == pytest.approx(value * scale, rel=1e-6)
    assert abs(value * scale - float(weight[f"{layer}.weight"][n, k])) <= 0.505 * scale


def test_gptq_v2_stores_the_zero_points_that_v1_stores_minus_one(written):
    """GPTQModel's v2 -> v1 conversion subtracts 1 from every 4-bit field (0x11111111 a word); the rest is one."""
    v1, v2 = (_tensors(written[case][1]) for case in ("gptq4-g32-asym", "gptq4-g32-asym-v2"))
    for name, tensor in v1.items():
        if name.endswith(".qzeros"):
            assert torch.equal(((v2[name].long() - 0x11111111) & MASK), tensor.long() & MASK), name
        else:
            assert torch.equal(v2[name], tensor), name
    config = json.loads((written["gptq4-g32-asym-v2"][1] / "config.json").read_text())["quantization_config"]
    assert config["checkpoint_format"] == "gptq_v2"


def test_a_zero_point_of_zero_is_stored_in_gptq_v2_and_refused_in_v1(sources, tmp_path):
    """Non-negative weights: every group's minimum is 0, its zero point 0, which v1's zero - 1 cannot hold."""
    source = tmp_path / "non-negative"
    shutil.copytree(sources[False], source)
    for file in source.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({name: tensor.abs() if LINEAR_WEIGHT.match(name) else tensor for name, tensor in tensors.items()},
                  file)
    v2 = GPTQ(source, tmp_path / "v2", 4, 32, sym=False, checkpoint_format="gptq_v2")
    assert (_tensors(v2)[f"{Q_PROJ}.qzeros"] == 0).all()
    with pytest.raises(ValueError, match="a zero point of 0 cannot be stored in GPTQ v1"):
        GPTQ(source, tmp_path / "v1", 4, 32, sym=False)


def test_compressed_tensors_actorder_groups_permuted_columns_and_stores_their_group_per_column(written):
    """actorder "group": the same act-order permutation as the GPTQ writer's (q/k/v and gate/up share one), the
    groups of 32 permuted columns in group order in weight_scale / weight_zero_point, weight_packed in the
    original column order."""
    source, directory = written["ct4-g32-asym-actorder"]
    tensors, weight = _tensors(directory), _tensors(source)
    gptq = _tensors(written["gptq8-g32-asym-desc-act"][1])
    for name in [name for name in tensors if name.endswith(".weight_g_idx")]:
        assert torch.equal(tensors[name], gptq[name.replace("weight_g_idx", "g_idx")]), name
    g_idx = tensors[f"{Q_PROJ}.weight_g_idx"]
    assert torch.equal(g_idx, tensors["model.layers.0.self_attn.k_proj.weight_g_idx"])
    assert not torch.equal(g_idx, torch.arange(64, dtype=torch.int32) // 32)
    dequantized = dequantized_int_state_dict(directory)[f"{Q_PROJ}.weight"]
    n = 13
    word = int(tensors[f"{Q_PROJ}.weight_packed"][n, 5]) & MASK  # input columns 40..47, each its own group
    for i in range(8):
        q, k = (word >> 4 * i) & 0xF, 40 + i
        group = int(g_idx[k])
        zero = (int(tensors[f"{Q_PROJ}.weight_zero_point"][n // 8, group]) & MASK) >> 4 * (n % 8) & 0xF
        scale = float(tensors[f"{Q_PROJ}.weight_scale"][n, group])
        assert float(dequantized[n, k]) == pytest.approx((q - zero) * scale, rel=1e-6)
        assert abs((q - zero) * scale - float(weight[f"{Q_PROJ}.weight"][n, k])) <= 0.505 * scale
    # Group g holds the columns of places 32g..32g+31 of the permutation: its scale is their range's.
    permutation = act_order_permutation(Q_PROJ, 64)
    first = weight[f"{Q_PROJ}.weight"][:, permutation[:32]].float()
    spread = first.amax(dim=1).clamp(min=0) - first.amin(dim=1).clamp(max=0)
    torch.testing.assert_close(tensors[f"{Q_PROJ}.weight_scale"][:, 0].float(), spread / 15, rtol=1e-6, atol=0)


def test_awq_modules_to_not_convert_keep_their_float_weights(written):
    source, directory = written["awq-g32-down-proj-float"]
    tensors, original = _tensors(directory), _tensors(source)
    for layer in range(3):
        down = f"model.layers.{layer}.mlp.down_proj"
        assert torch.equal(tensors[f"{down}.weight"], original[f"{down}.weight"])
        assert f"{down}.qweight" not in tensors
        assert f"model.layers.{layer}.mlp.up_proj.qweight" in tensors


@pytest.mark.parametrize("case", ["ct4-g64-asym", "ct4-g32"])
def test_compressed_tensors_word_holds_input_columns_offset_by_eight(written, case):
    source, directory = written[case]
    tensors, weight = _tensors(directory), _tensors(source)[f"{Q_PROJ}.weight"]
    dequantized = dequantized_int_state_dict(directory)[f"{Q_PROJ}.weight"]
    n, group_size = 13, CASES[case][1]["group_size"]
    word = int(tensors[f"{Q_PROJ}.weight_packed"][n, 5]) & MASK  # input columns 40..47
    group = 40 // group_size
    zero = 8  # symmetric: the +8 offset alone
    if f"{Q_PROJ}.weight_zero_point" in tensors:  # output rows 8..15's zero points in one word
        zero = (int(tensors[f"{Q_PROJ}.weight_zero_point"][n // 8, group]) & MASK) >> 4 * (n % 8) & 0xF
    scale = float(tensors[f"{Q_PROJ}.weight_scale"][n, group])
    assert tensors[f"{Q_PROJ}.weight_shape"].tolist() == [64, 64]
    for i in range(8):
        q, k = (word >> 4 * i) & 0xF, 40 + i
        assert float(dequantized[n, k]) == pytest.approx((q - zero) * scale, rel=1e-6)
        assert abs((q - zero) * scale - float(weight[n, k])) <= 0.505 * scale


def test_packing_matches_compressed_tensors_pack_to_int32():
    """Words compressed_tensors 0.20.0's pack_to_int32 returned (run once by hand) for the signed values below;
    pack_int32 takes them offset by 2**(bits - 1), as the compressor stores them."""
    int4 = torch.arange(-8, 8).reshape(2, 8)
    assert pack_int32(int4 + 8, 4).tolist() == [[1985229328], [-19088744]]
    int8 = torch.tensor([[-128, -1, 0, 127, 5, -5, 64, -64]])
    assert pack_int32(int8 + 128, 8).tolist() == [[-8356096, 1086356357]]


@pytest.mark.parametrize("case", ["awq-g32", "gptq4-g128-desc-act", "gptq8-g32-asym-desc-act", "ct4-channel-asym"])
def test_transformers_runs_the_dequantized_state_dict(written, case):
    from transformers import AutoModelForCausalLM

    source, directory = written[case]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    state = dequantized_int_state_dict(directory)
    with torch.no_grad():
        original = model(tokens).logits
        missing, unexpected = model.load_state_dict(state, strict=False)
        logits = model(tokens).logits
    assert not missing and not unexpected
    assert torch.equal(model.get_parameter(f"{Q_PROJ}.weight"), state[f"{Q_PROJ}.weight"])
    assert torch.isfinite(logits).all() and not torch.equal(logits, original)
    # Quantization noise, not a misplaced weight: random weights would leave no correlation.
    similarity = torch.nn.functional.cosine_similarity(logits.flatten(), original.flatten(), dim=0)
    assert similarity > (0.99 if CASES[case][1].get("bits") == 8 else 0.7)
