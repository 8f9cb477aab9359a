"""The test checkpoints' integer layouts are the real tools' own, checked by running the tools' code on them:
AutoAWQ 0.2.9 (`WQLinear_GEMM.from_linear` packs, `dequantize_gemm` reads), AutoGPTQ 0.7.1 (`QuantLinear.pack` of
its CPU-packable "cuda-old" layer) and compressed-tensors 0.20.0 (`PackedQuantizationCompressor.decompress`).

Why here and not only in pagedserve/testing/int_checkpoints.py's docstring: the serving tests run our writers'
checkpoints through our loader; if a writer and the loader shared a misreading of a format, both would pass. These
tools install without the network (`make install` puts them in with --no-deps: only their packing and reading
code is imported, by file, never their packages' heavy __init__s), so the check runs in every `make test`.
Each tool's reader dequantizes our checkpoint to what our reference reader (int_checkpoint_reader.py) says, and,
given the checkpoint's integers, scales and zero points, each tool's packer writes our words bit for bit. The
serving tests compare our loader with that reader, so the loader is checked against the tools' own reading.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from pagedserve.testing.int_checkpoint_reader import dequantized_int_state_dict
from pagedserve.testing.int_checkpoints import (
    write_awq_checkpoint,
    write_compressed_tensors_int_checkpoint,
    write_gptq_checkpoint,
)
from pagedserve.testing.tiny_models import make_tiny_model

LAYERS = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj")
GROUP = 32


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)  # finds the installed package without running its __init__
    assert spec is not None and spec.submodule_search_locations, f"{name} is installed by `make install`"
    return spec.submodule_search_locations[0]


@pytest.fixture(scope="module")
def autoawq():
    """AutoAWQ's awq package with an empty __init__ (its own imports datasets and the CUDA kernels)."""
    saved = sys.modules.get("awq")
    package = types.ModuleType("awq")
    package.__path__ = [_package_dir("awq")]
    sys.modules["awq"] = package
    try:
        from awq.modules.linear.gemm import WQLinear_GEMM
        from awq.utils.packing_utils import dequantize_gemm, reverse_awq_order, unpack_awq

        yield types.SimpleNamespace(WQLinear_GEMM=WQLinear_GEMM, dequantize_gemm=dequantize_gemm,
                                    unpack_awq=unpack_awq, reverse_awq_order=reverse_awq_order)
    finally:
        for name in [name for name in sys.modules if name == "awq" or name.startswith("awq.")]:
            del sys.modules[name]
        if saved is not None:
            sys.modules["awq"] = saved


@pytest.fixture(scope="module")
def autogptq_quant_linear():
    """AutoGPTQ's QuantLinear of qlinear_cuda_old.py, loaded by file (its package imports accelerate's hooks,
    peft and the CUDA extension); without the extension it still packs on the CPU."""
    path = f"{_package_dir('auto_gptq')}/nn_modules/qlinear/qlinear_cuda_old.py"
    spec = importlib.util.spec_from_file_location("autogptq_qlinear_cuda_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.QuantLinear


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("real-tools"), "llama", seed=11)


def _tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_autoawq_packs_our_awq_words_and_reads_our_checkpoint_to_our_weights(autoawq, source, tmp_path):
    target = write_awq_checkpoint(source, tmp_path / "awq", group_size=GROUP)
    tensors, ours = _tensors(target), dequantized_int_state_dict(target)
    for layer in LAYERS:
        qweight, qzeros, scales = (tensors[f"{layer}.{kind}"] for kind in ("qweight", "qzeros", "scales"))
        theirs = autoawq.dequantize_gemm(qweight, qzeros, scales, 4, GROUP)  # [in, out] in float16
        torch.testing.assert_close(theirs.float().t(), ours[f"{layer}.weight"], rtol=1e-3, atol=1e-3)
        values, zeros = autoawq.reverse_awq_order(*autoawq.unpack_awq(qweight, qzeros, 4), 4)
        values, zeros = values.int() & 15, (zeros.int() & 15).float()
        per_row = [t.float().repeat_interleave(GROUP, dim=0) for t in (zeros, scales)]
        linear = nn.Linear(qweight.shape[0], scales.shape[1], bias=False)
        linear.weight.data = ((values - per_row[0]) * per_row[1]).t().contiguous()  # exactly on the grid
        packed = autoawq.WQLinear_GEMM.from_linear(linear, 4, GROUP, scales=scales.float(), zeros=zeros)
        assert torch.equal(packed.qweight, qweight), layer
        assert torch.equal(packed.qzeros, qzeros), layer


@pytest.mark.parametrize("bits,sym", [(4, True), (4, False), (8, True), (8, False)])
def test_autogptq_packs_our_gptq_words_given_our_scales_and_zero_points(autogptq_quant_linear, source, tmp_path,
                                                                        bits, sym):
    target = write_gptq_checkpoint(source, tmp_path / "gptq", bits=bits, group_size=GROUP, sym=sym)
    tensors, ours = _tensors(target), dequantized_int_state_dict(target)
    for layer in LAYERS:
        qweight, qzeros, scales = (tensors[f"{layer}.{kind}"] for kind in ("qweight", "qzeros", "scales"))
        weight = ours[f"{layer}.weight"]  # [out, in], on the grid of the checkpoint's scales and zero points
        out_features, in_features = weight.shape
        # The zero points as GPTQ v1 defines them (stored - 1, packed along the output dimension), unpacked here by
        # plain shifts: if our writer's "- 1" were wrong, the weights' grid would not be (q - zero) * scale and
        # AutoGPTQ's qweight (round((W + zero * scale) / scale)) would differ from ours.
        shifts = torch.arange(0, 32, bits, dtype=torch.int32)
        zeros = ((qzeros.unsqueeze(-1) >> shifts) & (2**bits - 1)).reshape(qzeros.shape[0], -1) + 1
        zeros = zeros.t().float()  # [out, in // G], as QuantLinear.pack takes them
        layer_module = autogptq_quant_linear(bits, GROUP, in_features, out_features, bias=False,
                                             weight_dtype=torch.float32)
        linear = nn.Linear(in_features, out_features, bias=False)
        linear.weight.data = weight.clone()
        g_idx = torch.arange(in_features, dtype=torch.int32) // GROUP
        layer_module.pack(linear, scales.float().t().contiguous(), zeros, g_idx)
        assert torch.equal(layer_module.qweight, qweight), layer
        assert torch.equal(layer_module.qzeros, qzeros), layer


def test_compressed_tensors_decompresses_our_pack_quantized_checkpoint_to_our_weights(source, tmp_path):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    for bits, group_size, symmetric in [(4, GROUP, False), (8, None, True), (4, 64, True)]:
        target = write_compressed_tensors_int_checkpoint(source, tmp_path / f"ct{bits}-{group_size}-{symmetric}",
                                                         bits=bits, group_size=group_size, symmetric=symmetric)
        tensors, ours = _tensors(target), dequantized_int_state_dict(target)
        config = json.loads((target / "config.json").read_text())["quantization_config"]
        scheme = QuantizationScheme.model_validate(config["config_groups"]["group_0"])
        for layer in LAYERS:
            local = {kind: tensors[f"{layer}.{kind}"] for kind in
                     ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
                     if f"{layer}.{kind}" in tensors}
            theirs = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
            torch.testing.assert_close(theirs.float(), ours[f"{layer}.weight"], rtol=1e-6, atol=1e-6)


def test_compressed_tensors_reads_our_actorder_checkpoint_with_its_columns_sorted_by_weight_g_idx(source, tmp_path):
    """compressed-tensors 0.20.0 removed actorder "group" (its QuantizationArgs refuses it, its decompress takes no
    g_idx). The versions before read weight_g_idx in `_process_quantization`: sort the columns by g_idx, dequantize
    groups of G consecutive sorted columns with weight_scale[:, group], put the columns back. That sort is done here
    around 0.20.0's own unpack, pack and `PackedQuantizationCompressor.decompress` (the scheme without actorder);
    the result must be our reader's weights."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    target = write_compressed_tensors_int_checkpoint(source, tmp_path / "ct-actorder", bits=4, group_size=GROUP,
                                                     symmetric=False, actorder=True)
    tensors, ours = _tensors(target), dequantized_int_state_dict(target)
    group = json.loads((target / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["weights"]["actorder"] == "group"
    with pytest.raises(ValueError, match="actorder='group' has been removed"):
        QuantizationArgs.model_validate(group["weights"])
    scheme = QuantizationScheme.model_validate({**group, "weights": {**group["weights"], "actorder": None}})
    for layer in LAYERS:
        g_idx, shape = tensors[f"{layer}.weight_g_idx"].long(), tensors[f"{layer}.weight_shape"]
        assert not torch.equal(g_idx, torch.arange(int(shape[1])) // GROUP)
        order = torch.argsort(g_idx, stable=True)
        values = unpack_from_int32(tensors[f"{layer}.weight_packed"], 4, shape)  # signed, in column order
        local = {"weight_packed": pack_to_int32(values[:, order], 4), "weight_shape": shape,
                 **{kind: tensors[f"{layer}.{kind}"] for kind in ("weight_scale", "weight_zero_point")}}
        sorted_weight = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        theirs = sorted_weight[:, torch.argsort(order)]
        torch.testing.assert_close(theirs.float(), ours[f"{layer}.weight"], rtol=1e-6, atol=1e-6)
