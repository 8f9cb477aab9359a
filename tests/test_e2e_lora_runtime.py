"""LoRA adapters loaded and unloaded while serving, through the real processes: one server started with no
--lora-modules, --max-loras 1 and --allow-runtime-lora-updating. Three PEFT adapters loaded at run time (over HTTP,
vLLM's /v1/load_lora_adapter, and the SDK) and requested concurrently with the base model each give PEFT's greedy
output (one GPU slot, reloaded as the adapters take turns); /v1/models follows the loads and unloads; a refused
load names the problem (400 / INVALID_ARGUMENT); unloading lets the request in flight finish and new ones get
NOT_FOUND / 404; an adapter unloaded, rewritten on disk and loaded again under the same name and path serves its new
weights (a new load generation: its slot, the workers' host copy and its prefix-cache blocks are not the old
ones'). Without the flag a load is refused (the scheduler's registry, without a second server)."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from client.errors import InvalidRequestError, NotFoundError
from pagedserve.testing.server_harness import http_json, running_server
from pagedserve.testing.tiny_lora import generate_with_adapters, make_tiny_adapter, peft_greedy
from pagedserve.testing.tiny_models import make_tiny_model
from scheduler_svc.api.lora_registry import LoraRefused, LoraRegistry

MAX_TOKENS = 8
LONG = 200  # the request in flight while its adapter is unloaded
ADAPTERS = {  # name: (rank, targets, extra config): other targets each, so a slot left dirty shows
    "attn": (4, ["q_proj", "k_proj", "v_proj", "o_proj"], {}),
    "mlp": (8, ["gate_proj", "up_proj", "down_proj"], {"use_rslora": True}),
    "mixed": (2, ["v_proj", "up_proj", "down_proj"], {"alpha": 4.0}),
}
PROMPTS = [[5, 9, 2, 7, 3, 5, 9, 30, 31], [11, 4, 8, 30, 31, 2, 2, 9, 40, 41, 42]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-runtime")
    model = make_tiny_model(root, "llama", seed=6)
    adapters = {name: make_tiny_adapter(model, root / name, rank, targets, seed=index + 20, **extra)
                for index, (name, (rank, targets, extra)) in enumerate(ADAPTERS.items())}
    return model, adapters


@pytest.fixture(scope="module")
def server(llama, tmp_path_factory):
    model, _ = llama
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model), "--num-kv-blocks", "64",
                        "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
                        "--allow-runtime-lora-updating", http=True) as server:
        yield server


def post_text(url: str, body: dict) -> tuple[int, str]:
    """POST JSON; (status, body text): vLLM's LoRA endpoints answer plain text on success, JSON errors else."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def listed_models(server) -> set[str]:
    status, _, listed = http_json(f"{server.http_url}/v1/models")
    assert status == 200
    return {card["id"] for card in listed["data"][1:]}


def test_adapters_loaded_at_run_time_share_one_slot_and_each_equals_peft(llama, server):
    model, adapters = llama
    for name in ("attn", "mlp"):
        status, text = post_text(f"{server.http_url}/v1/load_lora_adapter",
                                 {"lora_name": name, "lora_path": str(adapters[name])})
        assert status == 200 and f"'{name}'" in text, text
    with server.client() as client:
        client.load_lora_adapter("mixed", str(adapters["mixed"]))
    assert {"attn", "mlp", "mixed"} <= listed_models(server)
    requests = [(name, prompt) for prompt in PROMPTS for name in (*ADAPTERS, None)]
    outputs = generate_with_adapters(server, requests, MAX_TOKENS)
    expected = [peft_greedy(model, None if name is None else adapters[name], prompt, MAX_TOKENS)
                for name, prompt in requests]
    assert outputs == expected
    assert len({tuple(output) for output in outputs}) == len(outputs)  # every adapter changes the output


def test_refused_loads_name_the_problem(llama, server, tmp_path):
    _, adapters = llama
    dora = shutil.copytree(adapters["attn"], tmp_path / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    url = f"{server.http_url}/v1/load_lora_adapter"
    status, text = post_text(url, {"lora_name": "dora", "lora_path": str(dora)})
    assert status == 400 and "use_dora" in text, text
    wide = shutil.copytree(adapters["attn"], tmp_path / "wide")  # trained on a model with wider layers
    weights = load_file(wide / "adapter_model.safetensors")
    name = next(key for key in weights if key.endswith("q_proj.lora_A.weight"))
    weights[name] = torch.zeros(weights[name].shape[0], weights[name].shape[1] + 16)
    save_file(weights, wide / "adapter_model.safetensors")
    status, text = post_text(url, {"lora_name": "wide", "lora_path": str(wide)})
    assert status == 400 and "the model's projection needs" in text and "q_proj" in text, text
    status, text = post_text(url, {"lora_name": "nowhere", "lora_path": str(tmp_path / "missing")})
    assert status == 400 and "not a PEFT adapter directory" in text, text
    with server.client() as client:
        client.load_lora_adapter("twice", str(adapters["attn"]))
        with pytest.raises(InvalidRequestError, match="already loaded"):
            client.load_lora_adapter("twice", str(adapters["mlp"]))
    status, text = post_text(url, {"lora_name": "twice", "lora_path": str(adapters["mlp"])})
    assert status == 400 and "already loaded" in text, text
    status, text = post_text(f"{server.http_url}/v1/unload_lora_adapter", {"lora_name": "never"})
    assert status == 404 and "'never'" in text, text
    assert not {"dora", "wide"} & listed_models(server) and "twice" in listed_models(server)


def test_unloading_lets_the_request_in_flight_finish_and_new_ones_are_not_found(llama, server):
    model, adapters = llama
    with server.client() as client:
        client.load_lora_adapter("gone", str(adapters["mlp"]))
        stream = client.generate_stream(PROMPTS[0], max_tokens=LONG, temperature=0.0, ignore_eos=True,
                                        lora_name="gone")
        tokens = list(next(stream).token_ids)  # running now
        client.unload_lora_adapter("gone")
        assert client.stats().num_running == 1  # unloaded while it runs (LONG tokens take far longer than this)
        tokens += [token for chunk in stream for token in chunk.token_ids]
        assert tokens == peft_greedy(model, adapters["mlp"], PROMPTS[0], LONG)
        with pytest.raises(NotFoundError, match="'gone'"):
            client.generate(PROMPTS[0], max_tokens=2, lora_name="gone")
        with pytest.raises(NotFoundError, match="'gone'"):
            client.unload_lora_adapter("gone")
    assert "gone" not in listed_models(server)
    status, _, body = http_json(f"{server.http_url}/v1/completions",
                                {"model": "gone", "prompt": PROMPTS[0], "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_an_adapter_reloaded_after_its_files_changed_serves_the_new_weights(llama, server, tmp_path):
    """Same name, same directory, other files: PEFT's output with the new weights, token for token, on the
    prompt the old weights filled the prefix cache with (several full blocks)."""
    model, adapters = llama
    path = shutil.copytree(adapters["attn"], tmp_path / "reloaded")
    prompt = list(range(3, 60))
    with server.client() as client:
        client.load_lora_adapter("reloaded", str(path))
        old = [list(client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                    lora_name="reloaded").outputs[0].token_ids) for _ in range(2)]
        assert old == [peft_greedy(model, adapters["attn"], prompt, MAX_TOKENS)] * 2
        client.unload_lora_adapter("reloaded")
        shutil.rmtree(path)
        shutil.copytree(adapters["mlp"], path)
        client.load_lora_adapter("reloaded", str(path))
        new = list(client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                   lora_name="reloaded").outputs[0].token_ids)
        client.unload_lora_adapter("reloaded")
    expected = peft_greedy(model, path, prompt, MAX_TOKENS)
    assert expected != old[0], "the rewritten adapter must change the output"
    assert new == expected


def test_each_runtime_load_of_a_name_is_a_new_generation(llama):
    _, adapters = llama
    registry = LoraRegistry(enable_lora=True, max_lora_rank=8, allow_runtime_updating=True)
    generations = []
    for _ in range(3):
        generations.append(registry.load("attn", str(adapters["attn"])).generation)
        registry.unload("attn")
    assert generations == [1, 2, 3]
    assert registry.load("other", str(adapters["attn"])).generation == 1


def test_runtime_loads_are_refused_without_the_flag(llama):
    _, adapters = llama
    for registry in (LoraRegistry(enable_lora=True, max_lora_rank=8),
                     LoraRegistry(enable_lora=False, max_lora_rank=8, allow_runtime_updating=True)):
        with pytest.raises(LoraRefused, match="--allow-runtime-lora-updating") as refused:
            registry.load("attn", str(adapters["attn"]))
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(LoraRefused, match="--allow-runtime-lora-updating"):
            registry.unload("attn")
    registry = LoraRegistry(enable_lora=True, max_lora_rank=8, allow_runtime_updating=True)
    assert registry.load("attn", str(adapters["attn"])).path == str(adapters["attn"])
    assert registry.selection("attn").name == "attn" and registry.selection("") is None
