"""Validation at the gRPC edge: every sampling parameter out of range, and every senseless combination, is
refused naming the field and the allowed range; valid values reach SamplingParams; bad_words are tokenized
as vLLM does (as given and with a leading space)."""

from __future__ import annotations

import pytest

from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.api.request_validation import ServingLimits, validate_request
from scheduler_svc.core.validated_request import InvalidRequestError
from scheduler_svc.text.bad_words import bad_words_token_ids
from scheduler_svc.text.tokenizer_loading import load_tokenizer
from service_runtime.model_source import resolve_model

LIMITS = ServingLimits(max_model_len=256, vocab_size=512, kv_capacity_tokens=4096)


def _request(**sampling) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]))
    logit_bias = sampling.pop("logit_bias", {})
    request.sampling.CopyFrom(generate_pb2.SamplingParams(**sampling))
    for token_id, bias in logit_bias.items():
        request.sampling.logit_bias[token_id] = bias
    return request


@pytest.mark.parametrize("sampling, field, allowed", [
    (dict(min_p=-0.1), "sampling.min_p", "[0, 1]"),
    (dict(min_p=1.5), "sampling.min_p", "[0, 1]"),
    (dict(min_p=float("nan")), "sampling.min_p", "[0, 1]"),
    (dict(presence_penalty=2.5), "sampling.presence_penalty", "[-2, 2]"),
    (dict(frequency_penalty=-3.0), "sampling.frequency_penalty", "[-2, 2]"),
    (dict(frequency_penalty=float("inf")), "sampling.frequency_penalty", "[-2, 2]"),
    (dict(repetition_penalty=0.0), "sampling.repetition_penalty", "(0, 2]"),
    (dict(repetition_penalty=2.5), "sampling.repetition_penalty", "(0, 2]"),
    (dict(logit_bias={600: 1.0}), "sampling.logit_bias", "[0, 512)"),
    (dict(logit_bias={5: 101.0}), "sampling.logit_bias", "[-100, 100]"),
    (dict(logprobs=21), "sampling.logprobs", "[0, 20] (--max-logprobs)"),
    (dict(prompt_logprobs=50), "sampling.prompt_logprobs", "[0, 20] (--max-logprobs)"),
    (dict(max_tokens=4, min_tokens=5), "sampling.min_tokens", "[0, max_tokens]"),
    (dict(n=3, best_of=2), "sampling.best_of", "[n, 64]"),
    (dict(beam_width=2, temperature=0.7), "sampling.temperature", "must be 0"),
    (dict(beam_width=2, logprobs=2), "sampling.logprobs", "beam search"),
    (dict(beam_width=2, presence_penalty=0.5), "sampling.beam_width", "penalties"),
    (dict(bad_words=["x"]), "sampling.bad_words", "tokenizer"),
    (dict(top_k=-3), "sampling.top_k", "-1"),
    (dict(top_p=0.0), "sampling.top_p", "(0, 1]"),
    (dict(temperature=-1.0), "sampling.temperature", ">= 0"),
])
def test_out_of_range_parameters_and_senseless_combinations_name_the_field_and_range(sampling, field, allowed):
    with pytest.raises(InvalidRequestError) as refused:
        validate_request(_request(**sampling), None, LIMITS)
    assert refused.value.field == field
    assert allowed in str(refused.value)


def test_valid_parameters_reach_the_sampling_params():
    params = validate_request(_request(
        min_p=0.05, presence_penalty=-1.0, frequency_penalty=2.0, repetition_penalty=1.1, logit_bias={7: -100.0},
        min_tokens=3, max_tokens=3, logprobs=20, prompt_logprobs=0, include_stop_str_in_output=True,
        skip_special_tokens=False, spaces_between_special_tokens=False,
    ), None, LIMITS).sampling_params
    assert (params.min_p, params.presence_penalty, params.frequency_penalty) == (pytest.approx(0.05), -1.0, 2.0)
    assert params.repetition_penalty == pytest.approx(1.1) and params.logit_bias == ((7, -100.0),)
    assert (params.min_tokens, params.logprobs, params.prompt_logprobs) == (3, 20, 0)
    assert params.include_stop_str_in_output and not params.skip_special_tokens
    assert not params.spaces_between_special_tokens
    defaults = validate_request(_request(), None, LIMITS).sampling_params
    assert defaults.logprobs is None and defaults.prompt_logprobs is None and defaults.skip_special_tokens
    assert defaults.spaces_between_special_tokens and defaults.repetition_penalty == 1.0


def test_bad_words_are_tokenized_as_given_and_with_a_leading_space():
    tokenizer = load_tokenizer(resolve_model(None).path)
    sequences = bad_words_token_ids(("Paris", " hello world"), tokenizer)
    assert tuple(tokenizer.encode("Paris", add_special_tokens=False)) in sequences
    assert tuple(tokenizer.encode(" Paris", add_special_tokens=False)) in sequences
    assert tuple(tokenizer.encode("hello world", add_special_tokens=False)) in sequences
    assert tuple(tokenizer.encode(" hello world", add_special_tokens=False)) in sequences
    params = validate_request(_request(bad_words=["Paris"]), tokenizer, LIMITS).sampling_params
    assert params.bad_words_token_ids == bad_words_token_ids(("Paris",), tokenizer)
