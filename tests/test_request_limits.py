"""RequestLimits on their own (the end-to-end refusals are in test_e2e_hostile_input.py): limits are
inclusive, unset ones do not apply, and the logprobs bound reads whichever logprobs fields a wire carries."""

from __future__ import annotations


import pytest

from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.api.request_limits import RequestLimitError, RequestLimits, check_wire_limits

LIMITS = RequestLimits(max_prompt_tokens=4, max_n=2, max_tokens_limit=8, max_stop_strings=1, max_stop_string_length=3,
                       max_logprobs=5, max_chat_messages=2, max_bad_words=2)


def request(**sampling) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2]),
                                        sampling=generate_pb2.SamplingParams(**sampling))


def test_values_at_each_limit_pass():
    check_wire_limits(request(n=2, best_of=2, max_tokens=8, stop=["abc"], bad_words=["abc", "de"]), LIMITS)
    check_wire_limits(generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1] * 4)), LIMITS)


@pytest.mark.parametrize("wire, field", [
    (generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1] * 5)), "prompt"),
    (request(beam_width=3), "sampling.beam_width"),
    (request(max_tokens=9), "sampling.max_tokens"),
    (request(stop=["a", "b"]), "sampling.stop"),
    (request(stop=["abcd"]), "sampling.stop"),
    (request(bad_words=["a", "b", "c"]), "sampling.bad_words"),
    (request(bad_words=["abcd"]), "sampling.bad_words"),
    (generate_pb2.GenerateRequest(chat=generate_pb2.ChatPrompt(messages=[generate_pb2.ChatMessage()] * 3)),
     "prompt.chat.messages"),
], ids=["prompt", "beam_width", "max_tokens", "stop-count", "stop-length", "bad-words-count",
                        "bad-words-length", "chat"])
def test_each_limit_names_its_field(wire, field):
    with pytest.raises(RequestLimitError) as refused:
        check_wire_limits(wire, LIMITS)
    assert refused.value.field == field


def test_unset_limits_do_not_apply():
    check_wire_limits(generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1] * 5000),
                                                   sampling=generate_pb2.SamplingParams(max_tokens=10**9)),
                      RequestLimits())


