"""The public API's behaviour through the real processes, on a tiny random model without a tokenizer:
validation (INVALID_ARGUMENT naming the field, the server keeps serving what is in flight), cancellation
freeing blocks, stop token ids, ModelInfo and stats."""

from __future__ import annotations

import threading

import grpc
import pytest

from client import InvalidRequestError
from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import generate_pb2, generate_pb2_grpc

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=5)
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model), "--max-model-len",
                        str(MAX_MODEL_LEN), "--num-kv-blocks", "64", "--block-size", "16") as running:
        yield running


pytestmark = pytest.mark.usefixtures("no_block_leaks")


def test_model_info_reports_the_pool_and_limits(server):
    with server.client() as client:
        info = client.model_info()
    assert info.max_model_len == MAX_MODEL_LEN
    assert info.vocab_size == 512
    assert info.block_size == 16
    assert info.num_kv_blocks == 64
    assert not info.has_tokenizer
    assert (info.quantization, info.kv_cache_dtype) == ("", "auto")  # an unquantized checkpoint


BAD_REQUESTS = [
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[1] * MAX_MODEL_LEN), "prompt"),
    (dict(prompt=[1, 2], max_tokens=-1), "max_tokens"),
    (dict(prompt=[1, 2], temperature=-0.5), "temperature"),
    (dict(prompt=[1, 2], top_p=0.0), "top_p"),
    (dict(prompt=[1, 2], top_p=1.5), "top_p"),
    (dict(prompt=[1, 2], top_k=-2), "top_k"),
    (dict(prompt=[1, 512]), "token_ids"),
    (dict(prompt=[-1, 2]), "token_ids"),
    (dict(prompt="text needs a tokenizer"), "prompt.text"),
    (dict(prompt=[1, 2], stop=["x"]), "stop"),
    (dict(prompt=[1, 2], min_p=1.5), "sampling.min_p: must lie in [0, 1]"),
    (dict(prompt=[1, 2], presence_penalty=3.0), "sampling.presence_penalty: must lie in [-2, 2]"),
    (dict(prompt=[1, 2], repetition_penalty=0.0), "sampling.repetition_penalty: must lie in (0, 2]"),
    (dict(prompt=[1, 2], logit_bias={512: 1.0}), "sampling.logit_bias: token ids must lie in [0, 512)"),
    (dict(prompt=[1, 2], logprobs=21), "sampling.logprobs: must lie in [0, 20]"),
    (dict(prompt=[1, 2], max_tokens=2, min_tokens=3), "sampling.min_tokens"),
    (dict(prompt=[1, 2], n=3, best_of=2), "sampling.best_of"),
    (dict(prompt=[1, 2], bad_words=["x"]), "sampling.bad_words"),
]


def test_bad_input_is_refused_naming_the_field_while_requests_in_flight_go_on(server):
    in_flight: dict = {}

    def long_request():
        with server.client() as client:
            in_flight["result"] = client.generate([3, 4, 5], max_tokens=100, temperature=0.0, ignore_eos=True)

    runner = threading.Thread(target=long_request)
    runner.start()
    with server.client() as client:
        for kwargs, field in BAD_REQUESTS:
            with pytest.raises(InvalidRequestError) as refused:
                client.generate(**kwargs)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert field in refused.value.details, (kwargs, refused.value.details)
    runner.join(timeout=120)
    result = in_flight["result"]
    assert result.finish_reason == "length" and len(result.token_ids) == 100


def test_a_prompt_without_prompt_field_is_refused(server):
    with grpc.insecure_channel(server.target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(generate_pb2.GenerateRequest()))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in refused.value.details()


def test_cancelled_stream_frees_its_blocks(server):
    with server.client() as client:
        stream = client.generate_stream([7] * 40, max_tokens=80, temperature=0.0, ignore_eos=True)
        chunks = [next(stream), next(stream)]
        assert all(chunk.finish_reason is None for chunk in chunks)
        assert client.stats().num_free_kv_blocks < 64, "the running request holds blocks"
        stream.close()
    stats = server.wait_all_blocks_free()
    assert stats.num_free_kv_blocks == 64 and stats.num_running == 0


def test_stream_delivers_tokens_as_they_come_and_usage_on_the_last(server):
    """Tokens stream in order, a few per message at most (a handler that fell behind the steps sends what
    waits as one message), and only the last message ends the stream and carries the usage."""
    with server.client() as client:
        chunks = list(client.generate_stream([9, 8, 7, 6], max_tokens=12, temperature=0.0, ignore_eos=True))
        whole = client.generate([9, 8, 7, 6], max_tokens=12, temperature=0.0, ignore_eos=True)
    assert 1 < len(chunks) <= 12 and all(chunk.token_ids for chunk in chunks)
    assert [t for c in chunks for t in c.token_ids] == list(whole.token_ids)
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert chunks[-1].prompt_tokens == 4 and chunks[-1].completion_tokens == 12


def test_stop_token_ids_end_the_request(server):
    with server.client() as client:
        free_run = client.generate([11, 12, 13], max_tokens=20, temperature=0.0, ignore_eos=True)
        stop_at = free_run.token_ids[5]
        first = free_run.token_ids.index(stop_at)
        stopped = client.generate([11, 12, 13], max_tokens=20, temperature=0.0, stop_token_ids=[stop_at])
    assert stopped.finish_reason == "stop"
    assert list(stopped.token_ids) == list(free_run.token_ids[: first + 1])


def test_max_model_len_ends_a_request_with_length(server):
    prompt = [5] * (MAX_MODEL_LEN - 4)
    with server.client() as client:
        result = client.generate(prompt, max_tokens=50, temperature=0.0, ignore_eos=True)
    assert result.finish_reason == "length" and len(result.token_ids) == 4


def test_seeded_sampling_is_reproducible_and_differs_by_seed(server):
    with server.client() as client:
        runs = [client.generate([1, 2, 3], max_tokens=16, temperature=1.0, seed=s).token_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
