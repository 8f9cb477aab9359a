"""The whole stack (HTTP -> gateway -> gRPC -> scheduler -> worker) on a tiny random OPT with Qwen2.5's
tool-calling template: /v1/completions with echo, logprobs and max_tokens 0 returns the prompt's logprobs as
transformers computes them (and as the gRPC API's prompt_logprobs gives them), in the shape
lm-evaluation-harness reads; tools reach the template as transformers renders them (checked through
/tokenize), and a conversation with tool calls and tool results is served."""

from __future__ import annotations

import pytest

from pagedserve.testing.hf_reference import hf_log_softmax
from pagedserve.testing.server_harness import http_json, running_server
from pagedserve.testing.tiny_models import make_tiny_model
from pagedserve.testing.tiny_tokenizers import write_opt_tokenizer
from pagedserve.testing.tool_chat_template import QWEN2_5_TOOL_TEMPLATE

PROMPT = "The capital of France is"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = write_opt_tokenizer(make_tiny_model(tmp_path_factory.mktemp("models"), "opt", seed=3,
                                                     max_position_embeddings=1024))
    (directory / "chat_template.jinja").write_text(QWEN2_5_TOOL_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model_dir), "--max-model-len", "1024",
                        "--num-kv-blocks", "128", "--block-size", "16", "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", http=True) as running:
        yield running


def post(server, path: str, body: dict) -> dict:
    status, _, reply = http_json(f"{server.http_url}{path}", body)
    assert status == 200, reply
    return reply


def test_echo_logprobs_with_max_tokens_0_equal_transformers_and_the_grpc_prompt_logprobs(server, model_dir):
    with server.client() as client:
        generated_before = client.stats().num_generation_tokens
        reply = post(server, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 0,
                                                  "temperature": 0})
        grpc = client.generate(PROMPT, max_tokens=0, temperature=0.0, prompt_logprobs=2, return_prompt=True)
        # Nothing was sampled, not even a token dropped afterwards: the engine counted no generated token.
        assert client.stats().num_generation_tokens == generated_before
    choice = reply["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 0
    assert grpc.outputs[0].token_ids == () and grpc.outputs[0].finish_reason == "length"
    logprobs = choice["logprobs"]
    ids = list(grpc.prompt_token_ids)
    assert len(logprobs["tokens"]) == len(ids) == reply["usage"]["prompt_tokens"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    reference = hf_log_softmax(str(model_dir), ids)
    for position in range(1, len(ids)):
        expected = reference[position - 1, ids[position]].item()
        assert logprobs["token_logprobs"][position] == pytest.approx(expected, abs=2e-3)
        grpc_logprob = grpc.outputs[0].prompt_logprobs[position].token.logprob
        assert logprobs["token_logprobs"][position] == pytest.approx(grpc_logprob, abs=1e-6)
        top = logprobs["top_logprobs"][position]
        assert max(top.values()) == pytest.approx(reference[position - 1].max().item(), abs=2e-3)
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(len(ids))]


def test_max_tokens_0_serves_n_choices_and_a_one_token_prompt(server):
    reply = post(server, "/v1/completions", {"prompt": [[5], [5, 6, 7]], "echo": True, "logprobs": 1,
                                              "max_tokens": 0, "n": 2})
    choices = sorted(reply["choices"], key=lambda choice: choice["index"])
    assert [choice["finish_reason"] for choice in choices] == ["length"] * 4
    assert [len(choice["logprobs"]["token_logprobs"]) for choice in choices] == [1, 1, 3, 3]
    assert choices[2]["logprobs"]["token_logprobs"] == choices[3]["logprobs"]["token_logprobs"]
    assert reply["usage"]["completion_tokens"] == 0


def test_lm_eval_harness_request_shape_token_ids_and_max_tokens_1(server):
    # local-completions sends token ids in a batch, echo, logprobs 1 and max_tokens 1, then reads
    # token_logprobs[context length:-1] (the continuation's tokens, without the generated one).
    with server.client() as client:
        ids = list(client.tokenize(PROMPT).token_ids)
    reply = post(server, "/v1/completions", {"prompt": [ids, ids[:3]], "echo": True, "logprobs": 1, "max_tokens": 1,
                                              "temperature": 0})
    first, second = sorted(reply["choices"], key=lambda choice: choice["index"])
    assert len(first["logprobs"]["token_logprobs"]) == len(ids) + 1
    assert len(second["logprobs"]["token_logprobs"]) == 3 + 1
    shared = second["logprobs"]["token_logprobs"][1:3]
    assert first["logprobs"]["token_logprobs"][1:3] == pytest.approx(shared, abs=1e-4)


def test_tools_reach_the_template_and_tool_conversations_are_served(server, model_dir):
    from transformers import AutoTokenizer

    tokenized = post(server, "/tokenize", {"messages": CONVERSATION, "tools": TOOLS})
    reference = AutoTokenizer.from_pretrained(str(model_dir))
    history = [dict(message) for message in CONVERSATION]
    history[1] = {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}
    rendered = reference.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tools>" in rendered and '"arguments": {"city": "Paris"}' in rendered
    assert tokenized["tokens"] == reference(rendered, add_special_tokens=False)["input_ids"]
    reply = post(server, "/v1/chat/completions", {"messages": CONVERSATION, "tools": TOOLS, "max_tokens": 8,
                                                   "temperature": 0})
    # A random model writes no <tool_call>: its text is content, and the request finishes as usual.
    assert reply["choices"][0]["finish_reason"] in ("stop", "length")
    assert reply["usage"]["prompt_tokens"] == len(tokenized["tokens"])
