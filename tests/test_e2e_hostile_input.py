"""Hostile input through the real processes: every size limit refuses with INVALID_ARGUMENT naming the field
and the limit but never echoing the input, a message over --max-message-bytes gets INVALID_ARGUMENT (past twice
it, gRPC's own RESOURCE_EXHAUSTED, which the SDK does not retry), bytes
that are not a GenerateRequest (or carry invalid UTF-8) get INVALID_ARGUMENT, and a hypothesis fuzz of every
GenerateRequest field never gets INTERNAL or UNKNOWN; the server serves normally afterwards."""

from __future__ import annotations

import json

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client import InvalidRequestError
from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import generate_pb2

GENERATE = "/pagedserve.v1.Generation/Generate"
MAX_MESSAGE_BYTES = 65536
LIMIT_FLAGS = ("--max-n", "4", "--max-stop-strings", "2", "--max-stop-string-length", "8", "--max-tokens-limit", "64",
               "--max-prompt-tokens", "100", "--max-message-bytes", str(MAX_MESSAGE_BYTES))
# Only these statuses may end a call, whatever it carried.
EXPECTED_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=5)
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model), "--max-model-len", "128",
                        *LIMIT_FLAGS) as running:
        yield running


pytestmark = pytest.mark.usefixtures("no_block_leaks")

SECRET = "HOSTILE-PAYLOAD"
OVER_LIMIT = [
    (dict(prompt=[1] * 101), "prompt", "--max-prompt-tokens"),
    (dict(prompt=[1, 2], n=5, temperature=1.0), "sampling.n", "--max-n"),
    (dict(prompt=[1, 2], n=1, best_of=5, temperature=1.0), "sampling.best_of", "--max-n"),
    (dict(prompt=[1, 2], beam_width=5, temperature=0.0), "sampling.beam_width", "--max-n"),
    (dict(prompt=[1, 2], max_tokens=65), "sampling.max_tokens", "--max-tokens-limit"),
    (dict(prompt=[1, 2], stop=["a", "b", SECRET]), "sampling.stop", "--max-stop-strings"),
    (dict(prompt=[1, 2], stop=[SECRET]), "sampling.stop", "--max-stop-string-length"),
]


@pytest.mark.parametrize("kwargs, field, flag", OVER_LIMIT, ids=[case[2] + "-" + case[1] for case in OVER_LIMIT])
def test_each_limit_refuses_naming_field_and_limit_without_echoing_the_input(server, kwargs, field, flag):
    with server.client() as client:
        with pytest.raises(InvalidRequestError) as refused:
            client.generate(**kwargs)
    details = refused.value.details
    assert details.startswith(f"{field}:") and flag in details, details
    assert SECRET not in details


def test_limits_leave_requests_within_them_alone(server):
    with server.client() as client:
        result = client.generate([1] * 100, max_tokens=4, n=4, temperature=1.0, seed=1, ignore_eos=True)
    assert len(result.outputs) == 4 and all(len(output.token_ids) == 4 for output in result.outputs)


def _raw_generate(server, payload: bytes, timeout: float = 30.0):
    """Sends `payload` as the Generate request's bytes; returns (status code, details, responses)."""
    with grpc.insecure_channel(server.target) as channel:
        call = channel.unary_stream(GENERATE)(payload, timeout=timeout)
        try:
            responses = list(call)
        except grpc.RpcError as error:
            return error.code(), error.details() or "", []
        return grpc.StatusCode.OK, "", responses


def test_a_message_over_the_size_limit_is_invalid_argument_naming_the_limit(server):
    """A request that can never succeed: INVALID_ARGUMENT, not gRPC's RESOURCE_EXHAUSTED ("not now")."""
    request = generate_pb2.GenerateRequest(text="x" * (MAX_MESSAGE_BYTES + 10))
    code, details, _ = _raw_generate(server, request.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith("request:") and f"{MAX_MESSAGE_BYTES:,}-byte" in details and "--max-message-bytes" in details


def test_a_message_over_twice_the_limit_is_refused_by_grpc_and_the_sdk_does_not_retry_it(server):
    """Past twice the limit gRPC refuses it before decoding (RESOURCE_EXHAUSTED); the SDK reads gRPC's wording
    as a request that can never succeed: InvalidRequestError, after one attempt."""
    request = generate_pb2.GenerateRequest(text="x" * (2 * MAX_MESSAGE_BYTES + 10))
    code, details, _ = _raw_generate(server, request.SerializeToString())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
    with server.client() as client:
        with pytest.raises(InvalidRequestError):  # not OverloadedError, which the SDK retries
            client.generate("x" * (2 * MAX_MESSAGE_BYTES + 10), max_tokens=1)


@pytest.mark.parametrize("payload", [
    b"\x12\x02\xff\xfe",  # prompt.text (field 2) holding bytes that are not UTF-8
    b"\x0a\x03\xc3\x28\x41",  # request_id (field 1) with an invalid UTF-8 sequence
    b"\xff\xff\xff\xff\xff",  # not protobuf at all
    b"\x1a\x05\x0a\x03\x01",  # prompt.token_ids truncated inside its packed ids
], ids=["text-not-utf8", "request-id-not-utf8", "garbage", "truncated"])
def test_undecodable_requests_are_invalid_argument(server, payload):
    code, details, _ = _raw_generate(server, payload)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith("request:")


def test_out_of_vocabulary_ids_are_invalid_argument(server):
    with server.client() as client:
        for bad in ([1, 512], [2**31 - 1], [-(2**31)]):
            with pytest.raises(InvalidRequestError) as refused:
                client.generate(bad, max_tokens=2)
            assert refused.value.details.startswith("prompt.token_ids:")
        with pytest.raises(InvalidRequestError):
            client.generate([1, 2], max_tokens=2, stop_token_ids=[100000])


# ---- fuzz -----------------------------------------------------------------------------------------------

_int32 = st.integers(-(2**31), 2**31 - 1)
_uint32 = st.integers(0, 2**32 - 1)
_floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
_texts = st.text(max_size=40)
_json_texts = st.recursive(st.none() | st.booleans() | _texts | st.integers(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_texts, inner, max_size=3),
                           max_leaves=8).map(json.dumps) | st.just("[" * 5_000)


@st.composite
def generate_requests(draw) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(request_id=draw(_texts), priority=draw(_int32))
    kind = draw(st.sampled_from(["text", "token_ids", "chat", None]))
    if kind == "text":
        request.text = draw(_texts)
    elif kind == "token_ids":
        request.token_ids.ids.extend(draw(st.lists(st.one_of(st.integers(-2, 520), _int32), max_size=140)))
    elif kind == "chat":
        for role, content in draw(st.lists(st.tuples(_texts, _texts), max_size=3)):
            request.chat.messages.add(role=role, content=content)
        if draw(st.booleans()):
            request.chat.add_generation_prompt = draw(st.booleans())
        request.chat.continue_final_message = draw(st.booleans())
        request.chat.chat_template_kwargs_json = draw(st.one_of(_texts, _json_texts))
        request.chat.documents_json = draw(st.one_of(_texts, _json_texts))
    if draw(st.booleans()):
        request.add_special_tokens = draw(st.booleans())
    request.strict_context_length = draw(st.booleans())
    sampling = request.sampling
    optional = {
        "max_tokens": st.one_of(st.integers(-2, 70), _int32),
        "temperature": _floats,
        "top_p": _floats,
        "top_k": _int32,
        "seed": st.integers(0, 2**64 - 1),
        "n": st.one_of(st.integers(0, 6), _uint32),
        "best_of": st.one_of(st.integers(0, 6), _uint32),
        "beam_width": st.one_of(st.integers(0, 6), _uint32),
        "length_penalty": _floats,
    }
    for name, values in optional.items():
        if draw(st.booleans()):
            setattr(sampling, name, draw(values))
    sampling.stop.extend(draw(st.lists(_texts, max_size=3)))
    sampling.stop_token_ids.extend(draw(st.lists(st.one_of(st.integers(-2, 520), _int32), max_size=3)))
    sampling.ignore_eos = draw(st.booleans())
    sampling.early_stopping = draw(st.booleans())
    return request


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=generate_requests())
def test_fuzzed_requests_never_get_internal_or_crash_the_server(server, request):
    code, details, responses = _raw_generate(server, request.SerializeToString())
    assert code in EXPECTED_CODES, (code, details, request)
    if code == grpc.StatusCode.OK:
        assert responses and responses[-1].finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(payload=st.binary(max_size=64))
def test_fuzzed_bytes_never_get_internal(server, payload):
    code, details, _ = _raw_generate(server, payload)
    assert code in EXPECTED_CODES, (code, details, payload)


def test_the_server_still_serves_after_the_fuzz(server):
    with server.client() as client:
        result = client.generate([3, 4, 5], max_tokens=8, temperature=0.0, ignore_eos=True)
    assert len(result.token_ids) == 8 and result.finish_reason == "length"
