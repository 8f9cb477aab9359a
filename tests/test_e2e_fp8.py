"""FP8 through the real processes: a compressed-tensors FP8 checkpoint, and `--quantization fp8` on an unquantized
one, serve concurrent requests with prefix-cache hits and chunked prefill, and their greedy output equals the
in-process engine's on the same checkpoint; what is refused (another method, a --quantization that contradicts the
checkpoint, static FP8 input scales on a MoE model) is refused in one line by `serve` before any child starts, and by a worker started
alone with the load-refusal exit."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from pagedserve.testing.fp8_checkpoints import write_fp8_checkpoint
from pagedserve.testing.paged_runner import greedy_generate_paged
from pagedserve.testing.server_harness import REPO_ROOT, running_server
from pagedserve.testing.tiny_models import make_tiny_model
from service_runtime.load_refusal import LOAD_REFUSED_EXIT_CODE
from tests.test_e2e_greedy import MAX_TOKENS, _generate_all  # one server's greedy requests, as there
from tests.test_log_noise import assert_one_line_refusal
from tests.test_model_refusals import _serve
from worker_svc.models.model_loader import load_model

NUM_KV_BLOCKS = 24  # of 16 tokens


@pytest.fixture(scope="module", params=["compressed-tensors", "online"])
def served(request, tmp_path_factory):
    """(model dir, --quantization, running server): chunked prefill (24-token budget), prefix caching on."""
    source = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=7)
    if request.param == "online":
        model, flag = source, ["--quantization", "fp8"]
    else:
        model, flag = write_fp8_checkpoint(source, tmp_path_factory.mktemp("fp8") / "llama-fp8"), []
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model), "--num-kv-blocks",
                        str(NUM_KV_BLOCKS), "--max-num-batched-tokens", "24", *flag) as server:
        yield model, (flag[1] if flag else None), server


def test_concurrent_fp8_requests_sharing_a_prefix_equal_the_in_process_engine(served):
    model_dir, quantization, server = served
    rng = random.Random(1)
    prefix = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    with server.client() as client:
        info = client.model_info()
    assert (info.quantization, info.kv_cache_dtype) == (quantization or "compressed-tensors", "auto")
    before = server.wait_all_blocks_free()
    results = _generate_all(server, prompts[:1]) + _generate_all(server, prompts[1:])  # the first fills the cache
    after = server.wait_all_blocks_free()
    model, config = load_model(model_dir, torch.float32, "cpu", quantization=quantization)
    assert config.quantization is not None
    expected = greedy_generate_paged(model, config, prompts, MAX_TOKENS)
    for result, tokens in zip(results, expected):
        assert list(result.token_ids) == tokens
        assert result.finish_reason == "length" and result.completion_tokens == MAX_TOKENS
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens >= 4 * 32
    unquantized, _ = load_model(model_dir, torch.float32, "cpu") if quantization else (None, None)
    if unquantized is not None:  # online: the server did quantize (its tokens are not the float model's)
        assert greedy_generate_paged(unquantized, config, prompts, MAX_TOKENS) != expected


def _declared(tmp_path, method: str):
    """A tiny Llama whose config.json declares `method` (its tensors stay unquantized)."""
    model = make_tiny_model(tmp_path, "llama", seed=5)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 128}
    (model / "config.json").write_text(json.dumps(config))
    return model


def _static_fp8_mixtral(tmp_path):
    return write_fp8_checkpoint(make_tiny_model(tmp_path, "mixtral", seed=5), tmp_path / "mixtral-static", "tensor",
                                dynamic=False)


def test_serve_refuses_a_quantization_flag_the_checkpoint_contradicts_and_static_fp8_on_moe_in_one_line(tmp_path):
    gptq = _declared(tmp_path, "gptq")
    assert_one_line_refusal(_serve(gptq, "--quantization", "compressed-tensors", timeout=90),
                            "--quantization compressed-tensors was given", "quant_method 'gptq'")
    fp8 = write_fp8_checkpoint(make_tiny_model(tmp_path, "llama", seed=5), tmp_path / "fp8")
    assert_one_line_refusal(_serve(fp8, "--quantization", "fp8", timeout=90), "already quantized")
    assert_one_line_refusal(_serve(_static_fp8_mixtral(tmp_path), timeout=90), "static input scales",
                            "fused MoE experts")


@pytest.mark.parametrize("case, flag, words", [
    ("bitsandbytes", [], "quant_method 'bitsandbytes', which this engine does not serve"),
    ("gptq", ["--quantization", "compressed-tensors"], "--quantization compressed-tensors was given"),
    ("mixtral", [], "static input scales is not served for mixtral models"),
])
def test_a_worker_started_alone_refuses_with_the_load_refusal_exit_and_the_message(tmp_path, case, flag, words):
    model = _static_fp8_mixtral(tmp_path) if case == "mixtral" else _declared(tmp_path, case)
    result = subprocess.run([sys.executable, "-m", "worker_svc", "--model", str(model), *flag,
                             "--scheduler-address", f"ipc://{tmp_path}/nowhere"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=90)
    assert result.returncode == LOAD_REFUSED_EXIT_CODE, result.stderr[-2000:]
    assert words in result.stderr and "Traceback" not in result.stderr
