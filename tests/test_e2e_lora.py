"""Multi-LoRA through the real processes (`pagedserve serve --enable-lora --lora-modules ...`): three PEFT adapters of
different ranks and targets and the base model, interleaved in one batch, each request greedy token for token
PEFT's `PeftModel` output, beside preemption and prefix-cache hits with --max-loras 2; over the OpenAI gateway
(an adapter is a model: /v1/models lists it with its parent, an unknown model is a 404 in OpenAI's shape); an
unknown adapter over gRPC is NOT_FOUND; at -tp 2 through the offline LLM's LoRARequest; and the refusals at start,
each in one line before the model loads (or, for a tensor the model has no layer for, from the worker)."""

from __future__ import annotations

import json
import random
import shutil

import grpc
import pytest

from client.errors import NotFoundError
from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.testing.server_harness import http_json, running_server
from pagedserve.testing.tiny_lora import generate_with_adapters, make_tiny_adapter, peft_greedy
from pagedserve.testing.tiny_models import make_tiny_model
from scheduler_svc.api.lora_registry import LoraRefused, LoraRegistry
from service_runtime.lora_modules import LoraModule
from tests.test_model_refusals import _serve

MAX_TOKENS = 10
ADAPTERS = {  # name: (rank, targets, extra config)
    "attn": (4, ["q_proj", "k_proj", "v_proj", "o_proj"], {}),
    "mlp": (8, ["gate_proj", "up_proj", "down_proj"], {"use_rslora": True}),
    "mixed": (2, ["v_proj", "up_proj", "down_proj"], {"alpha": 4.0}),
}
# 7 blocks of 16 tokens for 8 requests of 3 blocks each: preemption; each adapter's two prompts share a block.
SMALL_POOL = ["--num-kv-blocks", "7", "--block-size", "16", "--max-num-batched-tokens", "64", "--swap-space", "0.01"]


def _adapters(root, model) -> dict:
    return {name: make_tiny_adapter(model, root / name, rank, targets, seed=index + 10, **extra)
            for index, (name, (rank, targets, extra)) in enumerate(ADAPTERS.items())}


def _lora_flags(adapters) -> list[str]:
    return ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]


def _requests(seed: int) -> list[tuple[str | None, list[int]]]:
    """Two prompts per adapter (and the base model), sharing a 20-token prefix within each adapter, shuffled."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(20)]
    requests = [(name, prefix + [rng.randrange(3, 512) for _ in range(6)]) for name in [None, *ADAPTERS] * 2]
    rng.shuffle(requests)
    return requests


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-llama")
    model = make_tiny_model(root, "llama", seed=6)
    return model, _adapters(root, model)


@pytest.fixture(scope="module")
def server(llama, tmp_path_factory):
    model, adapters = llama
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model), *SMALL_POOL, *_lora_flags(adapters),
                        http=True) as server:
        yield server


def _expected(model, adapters, requests) -> list[list[int]]:
    return [peft_greedy(model, None if name is None else adapters[name], prompt, MAX_TOKENS)
            for name, prompt in requests]


def test_adapters_and_the_base_model_interleaved_equal_peft_with_preemption_and_prefix_hits(llama, server):
    model, adapters = llama
    requests = _requests(seed=1)
    outputs = generate_with_adapters(server, requests, MAX_TOKENS)
    stats = server.wait_all_blocks_free()
    assert outputs == _expected(model, adapters, requests)
    assert len({tuple(output) for output in outputs}) == len(outputs)  # every adapter changes the output
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0, stats


def test_the_gateway_serves_an_adapter_as_a_model_and_lists_it(llama, server):
    """The tiny model has no tokenizer, so the completion's tokens are compared by their logprobs: the gateway's
    for `model: mlp` are those of the gRPC request with lora_name "mlp" (whose tokens are PEFT's), not the base
    model's."""
    model, _ = llama
    prompt = _requests(seed=2)[0][1]
    status, _, body = http_json(f"{server.http_url}/v1/completions", {
        "model": "mlp", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0})
    assert status == 200, body
    assert body["model"] == "mlp"
    with server.client() as client:
        by_name = {name: client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
                                         lora_name=name).outputs[0].logprobs for name in ("mlp", None)}
    over_http = body["choices"][0]["logprobs"]["token_logprobs"]
    assert over_http == pytest.approx([_chosen(entry) for entry in by_name["mlp"]], abs=1e-5)
    assert over_http != pytest.approx([_chosen(entry) for entry in by_name[None]], abs=1e-3)
    status, _, listed = http_json(f"{server.http_url}/v1/models")
    cards = {card["id"]: card for card in listed["data"]}
    base = listed["data"][0]["id"]
    assert base == model.name and cards[base]["parent"] is None
    assert set(cards) == {base, *ADAPTERS} and all(cards[name]["parent"] == base for name in ADAPTERS)


def _chosen(entry) -> float:
    """The sampled token's logprob of one SDK logprobs entry."""
    return entry if isinstance(entry, float) else entry.logprob


def test_an_unknown_adapter_is_not_found_over_grpc_and_a_404_over_http(server):
    with server.client() as client, pytest.raises(NotFoundError, match="'nope'"):
        client.generate([5, 6, 7], max_tokens=2, lora_name="nope")
    status, _, body = http_json(f"{server.http_url}/v1/completions",
                                {"model": "nope", "prompt": [5, 6, 7], "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"


def test_two_ranks_through_the_offline_llm_equal_peft(tmp_path):
    root = tmp_path / "qwen2"
    model = make_tiny_model(root, "qwen2", seed=7)
    adapters = _adapters(root, model)
    requests = _requests(seed=3)
    with LLM(str(model), tensor_parallel_size=2, enable_lora=True, max_loras=3, max_lora_rank=8,
             lora_modules=adapters, num_kv_blocks=64) as llm:
        results = llm.generate([prompt for _, prompt in requests],
                               SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                               lora_request=[None if name is None else LoRARequest(name, index + 1, str(adapters[name]))
                                             for index, (name, _) in enumerate(requests)], use_tqdm=False)
        with pytest.raises(ValueError, match="not served"):
            llm.generate([[1, 2]], lora_request=LoRARequest("other", 9, "/elsewhere"))
    assert [list(result.outputs[0].token_ids) for result in results] == _expected(model, adapters, requests)


def test_a_lora_name_is_invalid_without_enable_lora_and_not_found_when_unknown():
    """The gRPC edge's choice of status (LoraRegistry.selection), without a server."""
    registry = LoraRegistry()
    assert registry.selection("") is None
    with pytest.raises(LoraRefused, match="--enable-lora") as refused:
        registry.selection("sql")
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    registry = LoraRegistry(enable_lora=True, modules=(LoraModule("a", "/a"), LoraModule("b", "/b")))
    assert registry.selection("b") == LoraModule("b", "/b")
    with pytest.raises(LoraRefused, match="'sql'") as refused:
        registry.selection("sql")
    assert refused.value.code == grpc.StatusCode.NOT_FOUND


def _edited(adapter, tmp_path, **changes):
    copy = tmp_path / "edited"
    shutil.copytree(adapter, copy)
    config = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return copy


def _refusal_line(result) -> str:
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert "gRPC listening" not in result.stderr + result.stdout
    return result.stderr.strip().splitlines()[-1]


def test_refusals_at_start_name_the_adapter_and_the_key(llama, tmp_path):
    model, adapters = llama
    dora = _edited(adapters["attn"], tmp_path, use_dora=True)
    cases = [
        (["--max-loras", "2"], "--max-loras: LoRA flags need --enable-lora"),
        (["--enable-lora", "--lora-modules", f"odd={dora}"], "'odd'"),
        (["--enable-lora", "--max-lora-rank", "4", "--lora-modules", f"m={adapters['mlp']}"], "--max-lora-rank 4"),
        (["--enable-lora", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
         "--speculative-config"),
        (["--enable-lora", "--batch-invariant"], "--batch-invariant"),
    ]
    for args, words in cases:
        line = _refusal_line(_serve(model, *args, timeout=90))
        assert words in line, (args, line)
    assert "use_dora" in _refusal_line(_serve(model, "--enable-lora", "--lora-modules", f"odd={dora}", timeout=90))
