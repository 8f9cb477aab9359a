"""The Python SDK and CLI against an in-process fake server (the real server is tested end to end elsewhere).

The fake (tests/fake_generation_server.py) records every request and chooses its behaviour from the prompt
text (see FakeGeneration).
"""

from __future__ import annotations

import asyncio
import json
import dataclasses
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from client import (
    AsyncClient,
    Client,
    DeadlineExceededError,
    InvalidRequestError,
    LatencyHistogram,
    ModelInfo,
    OverloadedError,
    SamplingParams,
    ServerStats,
    ServerUnavailableError,
)
from pagedserve.testing.server_harness import free_port
from protos.pagedserve.v1 import generate_pb2
from tests.fake_generation_server import DATA_PARALLEL_FIELDS, NORMAL_CHUNKS, STATS, FakeGeneration, FakeServer

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server():
    fake_server = FakeServer()
    yield fake_server
    fake_server.stop()


@pytest.fixture()
def fake(server) -> FakeGeneration:
    return server.reset()


@pytest.fixture()
def client(server, fake):
    with Client(server.target) as sync_client:
        yield sync_client


# ---- Client (blocking) ----------------------------------------------------------------------------------


def test_stream_yields_each_chunk_with_finish_and_usage_on_the_last_only(client):
    chunks = list(client.generate_stream("hello", max_tokens=5))
    assert [(chunk.text, chunk.token_ids) for chunk in chunks] == [(t, tuple(ids)) for t, ids in NORMAL_CHUNKS]
    assert all(chunk.request_id == "fake-1" for chunk in chunks)
    assert [(c.finish_reason, c.prompt_tokens, c.completion_tokens) for c in chunks[:-1]] == [(None, None, None)] * 3
    assert (chunks[-1].finish_reason, chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == ("stop", 7, 5)


def test_generate_concatenates_the_stream(client):
    result = client.generate("hello", request_id="mine")
    assert (result.request_id, result.text, result.token_ids) == ("mine", "Hello world", (1, 2, 3, 4, 5))
    assert (result.finish_reason, result.prompt_tokens, result.completion_tokens) == ("stop", 7, 5)


def test_text_token_ids_and_chat_reach_the_server_as_the_right_prompt_form(client, fake):
    client.generate("plain text")
    client.generate([5, 6, 7])
    client.generate(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    text, token_ids, chat = fake.requests
    assert (text.WhichOneof("prompt"), text.text) == ("text", "plain text")
    assert (token_ids.WhichOneof("prompt"), list(token_ids.token_ids.ids)) == ("token_ids", [5, 6, 7])
    assert chat.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in chat.chat.messages] == [("system", "Be brief."), ("user", "Hi")]


def test_sampling_keywords_map_to_their_fields_and_unset_ones_stay_unset(client, fake):
    client.generate(
        "x", max_tokens=9, temperature=0.0, top_p=0.5, top_k=3, seed=2**64 - 1, stop="###",
        stop_token_ids=[2, 3], ignore_eos=True,
    )
    client.generate("x", max_tokens=4, temperature=None)
    client.generate("x")
    full, partial, bare = (request.sampling for request in fake.requests)
    assert (full.max_tokens, full.top_p, full.top_k, full.seed) == (9, 0.5, 3, 2**64 - 1)
    assert full.HasField("temperature") and full.temperature == 0.0  # 0 (greedy) is sent, not dropped
    assert (list(full.stop), list(full.stop_token_ids), full.ignore_eos) == (["###"], [2, 3], True)
    assert partial.HasField("max_tokens") and partial.max_tokens == 4
    for unset in ("temperature", "top_p", "top_k", "seed"):
        assert not partial.HasField(unset)
    assert not fake.requests[2].HasField("sampling") and not bare.HasField("max_tokens")


def test_unknown_or_conflicting_arguments_raise_type_error_before_any_call(client, fake):
    with pytest.raises(TypeError, match="guided_json.*use_beam_search"):
        client.generate_stream("x", use_beam_search=True, guided_json={}, best_of=2)
    with pytest.raises(TypeError, match="exactly one"):
        client.generate("x", messages=[{"role": "user", "content": "y"}])
    with pytest.raises(TypeError, match="exactly one"):
        client.generate()
    assert fake.requests == []


def test_server_errors_become_typed_errors_with_the_details(client, server):
    with pytest.raises(InvalidRequestError) as invalid:
        client.generate("invalid")
    assert invalid.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert invalid.value.details == "sampling.temperature: must be >= 0, got -0.5"
    with pytest.raises(OverloadedError, match="too many requests waiting"):
        list(client.generate_stream("overloaded"))
    with Client(server.target, timeout=0.3) as impatient, pytest.raises(DeadlineExceededError):
        impatient.generate("endless")
    with Client(f"127.0.0.1:{free_port()}") as nobody, pytest.raises(ServerUnavailableError):
        nobody.model_info()


def test_breaking_out_of_the_stream_cancels_it_on_the_server(client, fake):
    for chunk in client.generate_stream("endless"):
        assert chunk.text == "x"
        break
    assert fake.cancelled.wait(20), "the server never saw the stream cancelled"


def test_model_info_and_stats_mirror_the_server_responses(client):
    info = client.model_info()
    assert (info.model_name, info.max_model_len, info.vocab_size, info.block_size) == ("fake-model", 2048, 32000, 16)
    assert (info.num_kv_blocks, info.num_swap_blocks, info.eos_token_ids) == (100, 50, (2, 7))
    assert (info.has_tokenizer, info.has_chat_template) == (True, False)
    info_fields = [field.name for field in generate_pb2.ModelInfoResponse.DESCRIPTOR.fields]
    assert [field.name for field in dataclasses.fields(ModelInfo)] == info_fields
    stats = client.stats()
    proto_fields = [field.name for field in generate_pb2.GetStatsResponse.DESCRIPTOR.fields]
    assert [field.name for field in dataclasses.fields(ServerStats)] == proto_fields  # no counter left behind
    counters = [(index + 1, field.name) for index, field in enumerate(generate_pb2.GetStatsResponse.DESCRIPTOR.fields)
                if field.message_type is None and field.name not in DATA_PARALLEL_FIELDS]
    assert [getattr(stats, name) for _, name in counters] == [
        (position, position + 1) if generate_pb2.GetStatsResponse.DESCRIPTOR.fields_by_name[name].is_repeated
        else position for position, name in counters]
    assert (stats.engines, stats.router_policy) == ((), "")  # a data-parallel front's (tests/test_data_parallel.py)
    histograms = set(proto_fields) - {name for _, name in counters} - set(DATA_PARALLEL_FIELDS)
    assert histograms == {"time_to_first_token", "time_per_output_token", "e2e_request_latency",
                          "inter_token_latency", "request_queue_time", "request_prefill_time",
                          "request_decode_time", "request_inference_time", "request_prompt_tokens",
                          "request_generation_tokens", "request_params_n", "request_params_max_tokens",
                          "iteration_tokens"}
    for name in histograms:
        assert getattr(stats, name) == LatencyHistogram(upper_bounds=(0.5, 1.0), counts=(1, 0, 0), sum=0.25, count=1)


def test_wait_ready_returns_once_the_server_turns_serving(client, server):
    server.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    flip = threading.Timer(0.4, server.set_health, args=(health_pb2.HealthCheckResponse.SERVING,))
    started = time.monotonic()
    flip.start()
    client.wait_ready(timeout=10)
    assert 0.35 < time.monotonic() - started < 3


def test_wait_ready_times_out_naming_the_target(client, server):
    server.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(TimeoutError, match=f"{server.target}.*NOT_SERVING"):
        client.wait_ready(timeout=0.4)
    target = f"127.0.0.1:{free_port()}"
    with Client(target) as nobody, pytest.raises(TimeoutError, match=f"{target}.*UNAVAILABLE"):
        nobody.wait_ready(timeout=0.4)


def test_wait_ready_notices_a_late_server_soon_after_its_start():
    # Ours: within ~0.85 s. gRPC's default backoff would next try at 4.1 to 6.2 s: usually more than 1.5 s late.
    port = free_port()
    late_server: list[FakeServer] = []
    started_at: list[float] = []

    def start_server():
        late_server.append(FakeServer(port))
        started_at.append(time.monotonic())

    starter = threading.Timer(3.3, start_server)
    starter.start()
    try:
        with Client(f"127.0.0.1:{port}") as client:
            client.wait_ready(timeout=15)
            ready_at = time.monotonic()
    finally:
        starter.join()
        late_server[0].stop()
    assert ready_at - started_at[0] < 1.5


# ---- AsyncClient ----------------------------------------------------------------------------------------


def test_async_client_streams_generates_and_reports(server, fake):
    async def scenario():
        async with AsyncClient(server.target) as client:
            await client.wait_ready(timeout=5)
            chunks = [chunk async for chunk in client.generate_stream([5, 6], temperature=0.0)]
            result = await client.generate(messages=[{"role": "user", "content": "Hi"}], top_k=4)
            return chunks, result, await client.model_info(), await client.stats()

    chunks, result, info, stats = asyncio.run(scenario())
    assert "".join(chunk.text for chunk in chunks) == "Hello world" and chunks[-1].finish_reason == "stop"
    assert (result.text, result.token_ids, result.completion_tokens) == ("Hello world", (1, 2, 3, 4, 5), 5)
    assert (info.model_name, stats.num_steps) == ("fake-model", STATS.num_steps)
    token_ids, chat = fake.requests
    assert token_ids.WhichOneof("prompt") == "token_ids" and token_ids.sampling.temperature == 0.0
    assert chat.WhichOneof("prompt") == "chat" and chat.sampling.top_k == 4


def test_async_client_raises_typed_errors(server, fake):
    async def scenario():
        async with AsyncClient(server.target) as client:
            with pytest.raises(InvalidRequestError, match="sampling.temperature"):
                await client.generate("invalid")
            with pytest.raises(TypeError, match="use_beam_search"):
                client.generate_stream("x", use_beam_search=True)

    asyncio.run(scenario())
    with pytest.raises(RuntimeError, match="running event loop"):
        AsyncClient(server.target)


def test_cancelling_the_consuming_task_cancels_the_stream_on_the_server(server, fake):
    async def scenario():
        async with AsyncClient(server.target) as client:
            first_chunk = asyncio.Event()

            async def consume():
                async for _ in client.generate_stream("endless"):
                    first_chunk.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(first_chunk.wait(), 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await asyncio.to_thread(fake.cancelled.wait, 20)

    assert asyncio.run(scenario()), "the server never saw the stream cancelled"


def test_breaking_out_of_an_async_stream_cancels_it_on_the_server(server, fake):
    async def scenario():
        async with AsyncClient(server.target) as client:
            async for _ in client.generate_stream("endless"):
                break
            return await asyncio.to_thread(fake.cancelled.wait, 20)

    assert asyncio.run(scenario()), "the server never saw the stream cancelled"


def test_async_wait_ready_waits_for_serving_and_times_out_otherwise(server, fake):
    async def scenario():
        async with AsyncClient(server.target) as client:
            server.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            with pytest.raises(TimeoutError, match=server.target):
                await client.wait_ready(timeout=0.3)
            threading.Timer(0.3, server.set_health, args=(health_pb2.HealthCheckResponse.SERVING,)).start()
            await client.wait_ready(timeout=10)

    asyncio.run(scenario())


# ---- CLI ------------------------------------------------------------------------------------------------


def cli_environment() -> dict[str, str]:
    """The caller's environment minus PYTHONUNBUFFERED, so the CLI's own flushing is what gets tested."""
    return {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "client", *args],
        cwd=REPO_ROOT, env=cli_environment(), capture_output=True, text=True, timeout=timeout,
    )


def test_cli_streams_each_delta_as_it_arrives_then_reports_the_finish(server, fake):
    process = subprocess.Popen(
        [sys.executable, "-m", "client", "gated", "--target", server.target, "--max-tokens", "5",
         "--temperature", "0.5", "--top-p", "0.9", "--top-k", "8", "--seed", "3", "--stop", "END", "STOP"],
        cwd=REPO_ROOT, env=cli_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        # The server holds the rest back until the first delta is on our side of the pipe: proves the flush.
        ready, _, _ = select.select([process.stdout], [], [], 20)
        assert ready, "the first delta never reached stdout"
        assert os.read(process.stdout.fileno(), 100) == b"first"
        fake.gate.set()
        rest, errors = process.communicate(timeout=20)
    finally:
        fake.gate.set()
        process.kill()
    assert process.returncode == 0, errors
    assert rest == b" second\n"
    assert errors.decode().strip() == "finish_reason=stop prompt_tokens=7 completion_tokens=5"
    sampling = fake.requests[0].sampling
    assert (sampling.max_tokens, sampling.top_k, sampling.seed, list(sampling.stop)) == (5, 8, 3, ["END", "STOP"])
    assert sampling.temperature == pytest.approx(0.5) and sampling.top_p == pytest.approx(0.9)


def test_cli_chat_flag_sends_the_prompt_as_one_user_message(server, fake):
    result = run_cli("What is 2+2?", "--chat", "--target", server.target, "--wait", "5")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "Hello world\n"
    (request,) = fake.requests
    assert [(m.role, m.content) for m in request.chat.messages] == [("user", "What is 2+2?")]
    assert not request.sampling.HasField("max_tokens")


def test_cli_errors_print_one_line_and_exit_nonzero(server, fake):
    invalid = run_cli("invalid", "--target", server.target)
    assert invalid.returncode == 2 and invalid.stdout == ""
    assert invalid.stderr.strip().splitlines() == [
        "error: invalid request: INVALID_ARGUMENT: sampling.temperature: must be >= 0, got -0.5"
    ]
    target = f"127.0.0.1:{free_port()}"
    unreachable = run_cli("hello", "--target", target)
    assert unreachable.returncode == 1 and len(unreachable.stderr.strip().splitlines()) == 1
    assert unreachable.stderr.startswith(f"error: server at {target} failed: UNAVAILABLE")
    never_ready = run_cli("hello", "--target", target, "--wait", "0.3")
    assert never_ready.returncode == 1 and target in never_ready.stderr


def test_cli_flags_for_penalties_masks_and_logprobs_reach_the_request(server, fake):
    result = run_cli("hello", "--target", server.target, "--min-p", "0.1", "--presence-penalty", "0.5",
                     "--frequency-penalty", "-0.5", "--repetition-penalty", "1.2", "--logit-bias", "5=2.5", "7=-100",
                     "--bad-words", "foo", "bar baz", "--min-tokens", "3", "--stop-token-ids", "9", "--ignore-eos",
                     "--include-stop-str-in-output", "--logprobs", "2", "--prompt-logprobs", "1",
                     "--keep-special-tokens", "--no-spaces-between-special-tokens")
    assert result.returncode == 0, result.stderr
    sampling = fake.requests[0].sampling
    assert (sampling.min_p, sampling.presence_penalty, sampling.frequency_penalty) == pytest.approx((0.1, 0.5, -0.5))
    assert sampling.repetition_penalty == pytest.approx(1.2) and dict(sampling.logit_bias) == {5: 2.5, 7: -100.0}
    assert list(sampling.bad_words) == ["foo", "bar baz"] and list(sampling.stop_token_ids) == [9]
    assert (sampling.min_tokens, sampling.logprobs, sampling.prompt_logprobs) == (3, 2, 1)
    assert sampling.ignore_eos and sampling.include_stop_str_in_output
    assert sampling.HasField("skip_special_tokens") and not sampling.skip_special_tokens
    assert sampling.HasField("spaces_between_special_tokens") and not sampling.spaces_between_special_tokens


def test_sampling_params_object_carries_the_new_fields_as_keywords(client, fake):
    params = SamplingParams(min_p=0.2, logit_bias={3: 1.0}, bad_words=["x"], logprobs=0, repetition_penalty=1.1)
    assert hash(params) == hash(SamplingParams(min_p=0.2, logit_bias={3: 1.0}, bad_words=("x",), logprobs=0,
                                               repetition_penalty=1.1))
    client.generate("x", **params.keywords())
    sampling = fake.requests[0].sampling
    assert dict(sampling.logit_bias) == {3: 1.0} and list(sampling.bad_words) == ["x"]
    assert sampling.HasField("logprobs") and sampling.logprobs == 0
    assert not sampling.HasField("prompt_logprobs") and not sampling.HasField("min_tokens")


def test_chat_options_and_prompt_encoding_keywords_reach_the_request(client, fake):
    client.generate(messages=[{"role": "assistant", "content": "Once"}], add_generation_prompt=False,
                    continue_final_message=True, chat_template_kwargs={"enable_thinking": False},
                    documents=[{"title": "t"}], add_special_tokens=True, strict_context_length=True)
    client.generate("plain")
    chat, plain = fake.requests
    assert (chat.chat.add_generation_prompt, chat.chat.continue_final_message) == (False, True)
    assert json.loads(chat.chat.chat_template_kwargs_json) == {"enable_thinking": False}
    assert json.loads(chat.chat.documents_json) == [{"title": "t"}]
    assert chat.add_special_tokens and chat.strict_context_length
    assert not plain.HasField("add_special_tokens") and not plain.strict_context_length
    with pytest.raises(TypeError, match="chat options apply to messages only"):
        client.generate("plain", continue_final_message=True)
    with pytest.raises(TypeError, match="documents must be a list of dicts"):
        client.generate(messages=[{"role": "user", "content": "x"}], documents={"title": "t"})


def test_tools_and_tool_call_messages_reach_the_request(client, fake):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    client.generate(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}], tools=tools)
    chat = fake.requests[0].chat
    assert json.loads(chat.tools_json) == tools
    assistant, tool = chat.messages[1], chat.messages[2]
    assert not assistant.HasField("content") and assistant.reasoning_content == "Look it up."
    assert (assistant.tool_calls[0].id, assistant.tool_calls[0].name) == ("call_1", "get_weather")
    assert json.loads(assistant.tool_calls[0].arguments) == {"city": "Oslo"}  # a dict travels as JSON text
    assert tool.tool_call_id == "call_1" and not tool.HasField("reasoning_content")
    with pytest.raises(ValueError, match=r"messages\[0\].tool_calls\[0\]"):
        client.generate(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}])
    with pytest.raises(TypeError, match="tools must be a list of dicts"):
        client.generate(messages=[{"role": "user", "content": "x"}], tools={"type": "function"})


def test_tokenize_and_detokenize_sync_and_async(server, client, fake):
    tokenization = client.tokenize("a b c", return_token_strs=True)
    assert (tokenization.token_ids, tokenization.count, tokenization.max_model_len) == ([1, 2, 3], 3, 2048)
    assert tokenization.token_strs == ["t1", "t2", "t3"]
    assert client.tokenize(messages=[{"role": "user", "content": "x"}], add_generation_prompt=False).token_strs is None
    assert client.detokenize([4, 5]) == "t4 t5"
    with pytest.raises(InvalidRequestError, match="token_ids"):
        client.detokenize([40000])

    async def scenario():
        async with AsyncClient(server.target) as async_client:
            return await async_client.tokenize("x y"), await async_client.detokenize([1])

    tokenized, text = asyncio.run(scenario())
    assert tokenized.token_ids == [1, 2] and text == "t1"
    text_request, chat_request = fake.requests[:2]
    assert text_request.text == "a b c" and text_request.return_token_strs
    assert not chat_request.chat.add_generation_prompt


def test_the_sdk_listens_for_the_accepted_metadata_key_the_scheduler_sends():
    from client import async_client
    from scheduler_svc.api import grpc_server

    assert grpc_server.ACCEPTED_METADATA == ((async_client._ACCEPTED_KEY, "1"),)
