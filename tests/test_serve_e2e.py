"""`pagedserve serve` as a vLLM user runs it, through real processes: the model's generation_config.json gives
the defaults of unset sampling fields (`--generation-config auto`) or does not (`vllm`), reported by ModelInfo
and /v1/models; `--seed` makes unseeded sampling repeat across restarts (offline `LLM(seed=)` too); an API key
from VLLM_API_KEY guards gRPC and HTTP without ever appearing on a command line; `--disable-log-requests`
silences the gateway's access log; `--tokenizer` and `--chat-template` replace the model's."""

from __future__ import annotations

import importlib.metadata
import json
import urllib.error
import urllib.request

import pytest

from client.errors import PagedServeError
from pagedserve import LLM
from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model
from scheduler_svc.text.tokenizer_loading import load_tokenizer
from service_runtime.model_source import resolve_model

KEY = "key-from-the-environment-0123456789"
PROMPT = [5, 6, 7, 8]
SERVER_FLAGS = ("--max-model-len", "128", "--num-kv-blocks", "64", "--swap-space", "0.01")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random model whose generation_config.json asks for top_k 1 (greedy even at temperature 1) and
    6 new tokens."""
    model = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=3)
    (model / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "top_k": 1, "max_new_tokens": 6}))
    return model


@pytest.fixture(scope="module")
def keyed_server(model_dir, tmp_path_factory):
    """`--generation-config auto` (the default) with `--override-generation-config` setting 5 new tokens over
    the file's 6, the HTTP gateway, its API key given only as $VLLM_API_KEY, and no access log
    (`--disable-log-requests`)."""
    with running_server(tmp_path_factory.mktemp("keyed"), str(model_dir), *SERVER_FLAGS, "--disable-log-requests",
                        "--override-generation-config", '{"max_new_tokens": 5}',
                        http=True,
                        env={"VLLM_API_KEY": KEY}, client_options={"api_key": KEY}) as server:
        yield server


def test_unset_fields_take_the_models_generation_config_and_set_ones_win(keyed_server):
    with keyed_server.client() as client:
        info = client.model_info()
        assert info.default_sampling == {"top_k": 1, "max_tokens": 5}
        assert (info.generation_config, info.version) == ("auto", importlib.metadata.version("pagedserve"))
        greedy = client.generate(PROMPT, temperature=0.0).token_ids
        assert len(greedy) == 5  # the overridden max_new_tokens, not the file's 6 or vLLM's 16
        # temperature 1 (unset), but top_k 1 from the file: every unseeded request is the greedy answer
        assert [client.generate(PROMPT).token_ids for _ in range(3)] == [greedy] * 3
        assert len(client.generate(PROMPT, max_tokens=9, temperature=0.0).token_ids) == 9
        sampled = {tuple(client.generate(PROMPT, top_k=-1, max_tokens=12).token_ids) for _ in range(3)}
        assert len(sampled) > 1, "a request's own top_k overrides the file's"


def test_the_model_card_lists_the_generation_defaults(keyed_server):
    request = urllib.request.Request(f"{keyed_server.http_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        (card,) = json.load(response)["data"]
    assert card["default_sampling"] == {"top_k": 1, "max_tokens": 5}
    assert card["generation_config"] == "auto" and card["version"] == importlib.metadata.version("pagedserve")


def test_an_api_key_from_the_environment_guards_both_apis_and_is_on_no_command_line(keyed_server):
    for pid in [keyed_server.process.pid, *keyed_server.children]:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            assert KEY.encode() not in cmdline.read(), f"process {pid} shows the key in its argv"
    with keyed_server.client(api_key=None) as client, pytest.raises(PagedServeError, match="(?i)api key"):
        client.model_info()
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{keyed_server.http_url}/v1/models", timeout=10)
    assert refused.value.code == 401


def test_disable_log_requests_leaves_out_the_gateways_line_per_request(keyed_server):
    urllib.request.urlopen(f"{keyed_server.http_url}/health", timeout=10).close()
    assert "GET /health" not in keyed_server.log()  # the harness polled it too; see the next test for the line


def unseeded_answers(generate) -> list[list[int]]:
    """Three unseeded requests in a row (one at a time: --seed fixes the seeds in admission order)."""
    return [generate() for _ in range(3)]


def test_generation_config_vllm_ignores_the_file_and_seed_repeats_unseeded_sampling_across_restarts(
        model_dir, tmp_path):
    with running_server(tmp_path, str(model_dir), *SERVER_FLAGS, "--generation-config", "vllm",
                        "--seed", "11", http=True) as server, server.client() as client:
        assert '"GET /health HTTP/1.1" 200' in server.log()  # the access log is on by default
        info = client.model_info()
        assert (info.default_sampling, info.generation_config) == ({}, "vllm")
        online = unseeded_answers(lambda: client.generate(PROMPT).token_ids)
    assert all(len(tokens) == 16 for tokens in online)  # vLLM's default max_tokens
    assert len({tuple(tokens) for tokens in online}) > 1, "temperature 1, no top_k: requests sample differently"

    def offline(seed: int) -> list[list[int]]:
        with LLM(str(model_dir), seed=seed, generation_config="vllm", max_model_len=128, num_kv_blocks=64,
                 swap_space=0.01) as llm:
            return unseeded_answers(lambda: llm.generate([PROMPT], use_tqdm=False)[0].outputs[0].token_ids)

    assert offline(11) == online  # the same seed, the same requests in the same order: the same tokens
    assert offline(12) != online


def test_tokenizer_and_chat_template_replace_the_models(tmp_path):
    """A model without tokenizer files serves text and chat with --tokenizer's (SmolLM2's GGUF vocabulary),
    rendered by --chat-template's inline template instead of SmolLM2's own."""
    model = make_tiny_model(tmp_path, "llama", seed=4, vocab_size=49152)
    smollm2 = resolve_model(None).path
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
    with running_server(tmp_path, str(model), *SERVER_FLAGS, "--tokenizer", smollm2,
                        "--chat-template", template) as server, server.client() as client:
        assert client.model_info().has_chat_template
        chat = client.generate(messages=[{"role": "user", "content": "Hi there"}], max_tokens=2, temperature=0.0,
                               return_prompt=True)
        assert chat.prompt == "[user] Hi there\n[assistant]"
        text = client.generate("Hello world", max_tokens=2, temperature=0.0, return_prompt=True)
        assert text.prompt_token_ids == tuple(load_tokenizer(smollm2).encode("Hello world"))
