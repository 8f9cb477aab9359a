"""A stream resumed after a scheduler loss goes on exactly: the scheduler's OutputStream, primed with the
received tokens and characters, sends what the undisturbed stream would have sent after them (held-back
text, stop strings straddling the cut, characters split over tokens); the edge refuses what cannot resume;
the SDK builds the resumed request from what it received and waits only for a scheduler it had reached."""

from __future__ import annotations

import grpc
import pytest

from client.errors import InvalidRequestError as ClientInvalidRequestError
from client.errors import ServerUnavailableError
from client.stream_resume import ResumePolicy, StreamProgress
from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.api.resume_validation import resumed_output
from scheduler_svc.core.request import FinishReason, Request
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.validated_request import InvalidRequestError, ResumedOutput
from scheduler_svc.text.output_stream import OutputStream
from scheduler_svc.text.tokenizer_loading import load_tokenizer
from service_runtime.model_source import resolve_model

TEXT = "café — 😀 he said: STOP, then 你好 and more STOP words 👍🏽 at the end"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None).path)


def _advance(stream: OutputStream, request: Request, tokens: list[int], start: int, end: int) -> tuple[str, bool]:
    """Feeds tokens[start:end] one step at a time (the last of all tokens ends the request by length);
    returns the text sent and whether a stop string ended it."""
    sent = []
    for index in range(start, end):
        request.output_token_ids.append(tokens[index])
        if index == len(tokens) - 1:
            request.finish_reason = FinishReason.LENGTH
        delta, stopped = stream.advance(request)
        assert delta.token_ids == (tokens[index],)  # no token twice, none missing
        sent.append(delta.text)
        if stopped:
            return "".join(sent), True
    return "".join(sent), False


@pytest.mark.parametrize("stop", [(), ("STOP w",), ("said: STOP",), ("你好 and",)])
def test_a_stream_resumed_at_any_token_sends_exactly_what_the_undisturbed_one_would(tokenizer, stop):
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(tokens), stop=stop)
    prompt = tokenizer.encode("Say something.", add_special_tokens=False)

    def request(output=()):
        return Request("r", list(prompt), params, output_token_ids=list(output))

    whole_request = request()
    whole, whole_stopped = _advance(OutputStream(whole_request, tokenizer), whole_request, tokens, 0, len(tokens))
    num_streamed = len(whole_request.output_token_ids)
    for cut in range(1, num_streamed):
        first_request = request()
        before, stopped = _advance(OutputStream(first_request, tokenizer), first_request, tokens, 0, cut)
        assert not stopped
        resumed_request = request(tokens[:cut])
        resumed = OutputStream(resumed_request, tokenizer)
        resumed.skip_sent(resumed_request, len(before))
        after, resumed_stopped = _advance(resumed, resumed_request, tokens, cut, len(tokens))
        assert before + after == whole, f"cut after {cut} tokens"
        assert resumed_stopped == whole_stopped and resumed_request.output_token_ids == whole_request.output_token_ids


def _wire_request(**sampling) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(text="hi", sampling=generate_pb2.SamplingParams(**sampling))
    request.resume.token_ids.extend([5, 6])
    request.resume.num_sent_chars = 3
    return request


@pytest.mark.parametrize("sampling, field", [
    ({"n": 2, "seed": 1, "max_tokens": 8}, "resume"),
    ({"beam_width": 2, "max_tokens": 8}, "resume"),
    ({"temperature": 1.0, "max_tokens": 8}, "sampling.seed"),
    ({"temperature": 0.0, "max_tokens": 2}, "resume.token_ids"),
])
def test_the_edge_refuses_a_resume_that_cannot_go_on_exactly_naming_the_field(sampling, field):
    params = SamplingParams(**{key: value for key, value in sampling.items() if key != "beam_width"},
                            beam_width=sampling.get("beam_width", 1))
    with pytest.raises(InvalidRequestError) as refused:
        resumed_output(_wire_request(**sampling), params, vocab_size=512)
    assert refused.value.field == field


def test_the_edge_refuses_resumed_token_ids_outside_the_vocabulary():
    request = _wire_request(temperature=0.0, max_tokens=8)
    request.resume.token_ids.append(512)
    with pytest.raises(InvalidRequestError, match=r"resume.token_ids: token ids must be in \[0, 512\)"):
        resumed_output(request, SamplingParams(temperature=0.0, max_tokens=8), vocab_size=512)


def test_a_valid_resume_and_a_new_request():
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8)
    assert resumed_output(_wire_request(temperature=1.0, seed=7, max_tokens=8), params, 512) == \
        ResumedOutput((5, 6), 3, 0.0)
    assert resumed_output(generate_pb2.GenerateRequest(text="hi"), params, 512) is None


def _response(text: str, ids: list[int], **fields) -> generate_pb2.GenerateResponse:
    return generate_pb2.GenerateResponse(request_id="server-id", text=text, token_ids=ids, logprobs=[-0.5] * len(ids),
                                         **fields)


def test_the_sdk_resumes_with_what_it_received_its_request_id_and_the_servers_seed():
    original = generate_pb2.GenerateRequest(text="hi", sampling=generate_pb2.SamplingParams(max_tokens=9),
                                            return_prompt=True)
    progress = StreamProgress(original)
    assert progress.next_request() is original  # nothing received: the request as sent
    progress.saw(_response("Hé", [3, 4], seed=1234))
    progress.saw(_response("llo", [5]))
    resumed = progress.next_request()
    assert resumed.request_id == "server-id" and resumed.sampling.seed == 1234
    assert list(resumed.resume.token_ids) == [3, 4, 5] and resumed.resume.num_sent_chars == 5
    assert resumed.resume.cumulative_logprob == pytest.approx(-1.5)
    assert resumed.text == "hi" and resumed.sampling.max_tokens == 9  # the rest as first sent
    assert not progress.complete
    progress.saw(_response("", [6], finish_reason=generate_pb2.FINISH_REASON_LENGTH))
    assert progress.complete


def test_a_stream_of_several_sequences_ends_with_a_clear_error_once_it_delivered_something():
    progress = StreamProgress(generate_pb2.GenerateRequest(text="hi", sampling=generate_pb2.SamplingParams(n=2)))
    lost = ServerUnavailableError(grpc.StatusCode.UNAVAILABLE, "Socket closed")
    progress.check_resumable(lost)  # nothing received yet: it starts again
    progress.saw(_response("a", [3], index=1))
    with pytest.raises(ServerUnavailableError, match="several sequences cannot resume"):
        progress.check_resumable(lost)


def test_the_sdk_waits_only_for_a_scheduler_it_reached_and_that_did_not_refuse_on_purpose():
    policy = ResumePolicy(resume_timeout=30.0)
    lost = ServerUnavailableError(grpc.StatusCode.UNAVAILABLE, "Socket closed")
    assert policy.wait_deadline(lost, server_reached=True, call_deadline=None) is not None
    assert policy.wait_deadline(lost, server_reached=False, call_deadline=None) is None  # a wrong address fails fast
    draining = ServerUnavailableError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
    assert policy.wait_deadline(draining, server_reached=True, call_deadline=None) is None
    stopped = ServerUnavailableError(grpc.StatusCode.UNAVAILABLE, "the engine stopped: worker rank 0 disconnected")
    assert policy.wait_deadline(stopped, server_reached=True, call_deadline=None) is None  # exits 1: not restarted
    invalid = ClientInvalidRequestError(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: ...")
    assert policy.wait_deadline(invalid, server_reached=True, call_deadline=None) is None
    assert ResumePolicy(0.0).wait_deadline(lost, server_reached=True, call_deadline=None) is None
    assert policy.wait_deadline(lost, server_reached=True, call_deadline=5.0) == 5.0  # within the call's timeout


def test_a_stream_that_loses_its_scheduler_twice_in_a_row_without_a_message_is_not_resent_again():
    progress = StreamProgress(generate_pb2.GenerateRequest(text="hi"))
    lost = ServerUnavailableError(grpc.StatusCode.UNAVAILABLE, "Socket closed")
    progress.check_resumable(lost)  # first loss: re-sent
    progress.saw(_response("a", [3]))
    progress.check_resumable(lost)  # a message since: re-sent again
    with pytest.raises(ServerUnavailableError, match="lost 2 times in a row"):
        progress.check_resumable(lost)  # no message since the last loss: it may be what crashes the scheduler
