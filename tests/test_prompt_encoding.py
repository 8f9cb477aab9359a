"""Prompt encoding at the gRPC edge as vLLM's chat request does it (transformers' apply_chat_template):
add_generation_prompt, continue_final_message (as transformers, on SmolLM2's real template), chat_template_kwargs
and documents reaching the template, add_special_tokens' defaults per prompt form, strict_context_length with
vLLM's message, and the Tokenize/Detokenize handlers."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.api.request_validation import ServingLimits, validate_request
from scheduler_svc.api.tokenization import detokenize, tokenize
from scheduler_svc.core.validated_request import InvalidRequestError
from scheduler_svc.text.tokenizer_loading import load_tokenizer
from pagedserve.testing.tiny_tokenizers import write_opt_tokenizer
from service_runtime.model_source import resolve_model

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}"
    "{% for d in documents or [] %}[doc:{{ d.title }}]{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}[no-think]{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
LIMITS = ServingLimits(max_model_len=64, vocab_size=400, kv_capacity_tokens=4096)
CONVERSATION = [generate_pb2.ChatMessage(role="user", content="Hello"),
                generate_pb2.ChatMessage(role="assistant", content="The capital of France is")]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = write_opt_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    return load_tokenizer(str(directory))


def _chat_request(messages=CONVERSATION, **options) -> generate_pb2.GenerateRequest:
    add_special_tokens = options.pop("add_special_tokens", None)
    request = generate_pb2.GenerateRequest(chat=generate_pb2.ChatPrompt(messages=messages, **options))
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


def _rendered(tokenizer, request) -> str:
    return tokenizer.decode(validate_request(request, tokenizer, LIMITS).prompt_token_ids, skip_special_tokens=False)


def test_chat_options_reach_the_template(tokenizer):
    assert _rendered(tokenizer, _chat_request()) == "<|user|>Hello</s><|assistant|>The capital of France is</s><|assistant|>"
    assert _rendered(tokenizer, _chat_request(add_generation_prompt=False)).endswith("France is</s>")
    continued = _rendered(tokenizer, _chat_request(add_generation_prompt=False, continue_final_message=True))
    assert continued == "<|user|>Hello</s><|assistant|>The capital of France is"
    kwargs = _rendered(tokenizer, _chat_request(chat_template_kwargs_json=json.dumps({"enable_thinking": False})))
    assert kwargs.endswith("</s>[no-think]<|assistant|>")
    documents = json.dumps([{"title": "Paris", "text": "..."}, {"title": "Lyon", "text": "..."}])
    assert "[doc:Paris][doc:Lyon]<|assistant|>" in _rendered(tokenizer, _chat_request(documents_json=documents))


def test_add_special_tokens_defaults_to_true_for_text_and_false_for_chat(tokenizer):
    bos = tokenizer.bos_token_id
    text = validate_request(generate_pb2.GenerateRequest(text="Hello"), tokenizer, LIMITS).prompt_token_ids
    assert text[0] == bos
    bare = generate_pb2.GenerateRequest(text="Hello", add_special_tokens=False)
    assert validate_request(bare, tokenizer, LIMITS).prompt_token_ids == text[1:]
    chat = validate_request(_chat_request(), tokenizer, LIMITS).prompt_token_ids
    assert chat[0] != bos
    assert validate_request(_chat_request(add_special_tokens=True), tokenizer, LIMITS).prompt_token_ids == [bos, *chat]


@pytest.mark.parametrize("options, field, reason", [
    (dict(continue_final_message=True), "prompt.chat.continue_final_message", "add_generation_prompt"),
    (dict(continue_final_message=True, add_generation_prompt=False, messages=CONVERSATION[:1]),
     "prompt.chat.continue_final_message", "assistant"),
    (dict(chat_template_kwargs_json="[1]"), "prompt.chat.chat_template_kwargs", "JSON object"),
    (dict(chat_template_kwargs_json="{"), "prompt.chat.chat_template_kwargs", "not valid JSON"),
    (dict(documents_json="[" * 5_000), "prompt.chat.documents", "nested too deeply"),
    (dict(chat_template_kwargs_json='{"messages": [], "bos_token": "x"}'), "prompt.chat.chat_template_kwargs",
     "reserved names may not be set: bos_token, messages"),
    (dict(documents_json='{"title": "x"}'), "prompt.chat.documents", "array of objects"),
])
def test_bad_chat_options_are_refused_naming_the_field(tokenizer, options, field, reason):
    with pytest.raises(InvalidRequestError) as refused:
        validate_request(_chat_request(**options), tokenizer, LIMITS)
    assert refused.value.field == field and reason in str(refused.value)


def test_strict_context_length_refuses_with_vllms_message(tokenizer):
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5] * 10), strict_context_length=True)
    request.sampling.max_tokens = 55
    with pytest.raises(InvalidRequestError) as refused:
        validate_request(request, tokenizer, LIMITS)
    assert refused.value.field == "sampling.max_tokens"
    assert str(refused.value) == (
        "sampling.max_tokens: This model's maximum context length is 64 tokens. However, you requested 65 tokens "
        "(10 in the messages, 55 in the completion). Please reduce the length of the messages or completion.")
    request.sampling.max_tokens = 54
    assert validate_request(request, tokenizer, LIMITS).sampling_params.max_tokens == 54
    request.sampling.max_tokens, request.strict_context_length = 55, False  # the offline engine's: ends at the limit
    assert validate_request(request, tokenizer, LIMITS).sampling_params.max_tokens == 55


def test_tokenize_counts_what_generate_reads_and_detokenize_inverts_it(tokenizer):
    request = generate_pb2.TokenizeRequest(chat=_chat_request().chat, return_token_strs=True)
    response = asyncio.run(tokenize(request, tokenizer, LIMITS))
    assert list(response.token_ids) == validate_request(_chat_request(), tokenizer, LIMITS).prompt_token_ids
    assert response.max_model_len == 64
    assert list(response.token_strs) == tokenizer.convert_ids_to_tokens(list(response.token_ids))
    text = asyncio.run(detokenize(generate_pb2.DetokenizeRequest(token_ids=response.token_ids), tokenizer, LIMITS)).text
    assert text == _rendered(tokenizer, _chat_request())
    large = "Hello world. " * 2000  # encoded off the event loop; the same ids
    big = asyncio.run(tokenize(generate_pb2.TokenizeRequest(text=large), tokenizer, LIMITS))
    assert list(big.token_ids) == tokenizer.encode(large)
    with pytest.raises(InvalidRequestError, match="token_ids: ids must lie in"):
        asyncio.run(detokenize(generate_pb2.DetokenizeRequest(token_ids=[400]), tokenizer, LIMITS))


def test_continue_final_message_renders_as_transformers_on_smollm2():
    import transformers

    path = resolve_model(None).path
    ours = load_tokenizer(path)
    reference = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    messages = [{"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "Sure: Paris, "}]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                             continue_final_message=True)
    assert ours.apply_chat_template(messages, False, continue_final_message=True) == expected
