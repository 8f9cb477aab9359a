"""The table of sampling fields (protos/pagedserve/v1/sampling_fields.py) and every place that carries a sampling
field agree: generate.proto's SamplingParams, the SDK's keywords and SamplingParams dataclass, the CLI's flags,
the gateway's request models, the scheduler's validation and its SamplingParams.

Each check takes a table and returns what disagrees with it, so the same check is run on the real table (it
must find nothing) and on a drifted copy (it must find the drift): a check that found nothing either way
would prove nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf.descriptor import FieldDescriptor
from pydantic import ValidationError

from client import cli
from client.request_builder import build_generate_request
from client.sampling_params import SamplingParams as SdkSamplingParams
from client.types import ModelInfo
from gateway.errors import OpenAIError
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.refused_fields import REFUSED_FIELDS
from gateway.sampling import chat_keywords, completion_keywords
from gateway.tool_choice import ToolPlan
from protos.pagedserve.v1 import generate_pb2
from protos.pagedserve.v1.sampling_fields import INTEGER_WIRE_RANGES, SAMPLING_FIELDS, SamplingField, ValueRange
from scheduler_svc.api.request_limits import RequestLimitError
from scheduler_svc.api.request_validation import ServingLimits, validate_request
from scheduler_svc.core.sampling_params import SamplingParams as CoreSamplingParams
from scheduler_svc.core.validated_request import InvalidRequestError

Table = tuple[SamplingField, ...]

_SCALAR_TYPES = {FieldDescriptor.TYPE_INT32: "int32", FieldDescriptor.TYPE_UINT32: "uint32",
                 FieldDescriptor.TYPE_UINT64: "uint64", FieldDescriptor.TYPE_FLOAT: "float",
                 FieldDescriptor.TYPE_BOOL: "bool", FieldDescriptor.TYPE_STRING: "string"}
# The scheduler's SamplingParams fields made at the edge from others (no row of their own).
_CORE_DERIVED = {"bad_words_token_ids", "structured_grammar", "structured_grammar_after_token_id"}
# A value of each wire type that is no field's default, as the SDK takes it.
_SAMPLES: dict[str, Any] = {"int32": 3, "uint32": 3, "uint64": 3, "float": 0.5, "string": "x",
                            "map<int32, float>": {5: 1.5}, "StructuredOutputs": {"regex": "a+"}}
# Gateway body values of the OpenAI names whose value is not the SDK's, and what each makes of the keyword.
_GATEWAY_SAMPLES: dict[str, tuple[Any, Callable[[Any], bool]]] = {
    "logit_bias": ({"5": 1.5}, lambda keyword: keyword == {5: 1.5}),
    "response_format": ({"type": "json_object"}, lambda keyword: keyword is not None),
    "structured_outputs": ({"regex": "a+"}, lambda keyword: keyword is not None),
    "guided_json": ({"type": "object"}, lambda keyword: keyword is not None),
    "guided_regex": ("a+", lambda keyword: keyword is not None),
    "guided_choice": (["a", "b"], lambda keyword: keyword is not None),
    "guided_grammar": ('root ::= "a"', lambda keyword: keyword is not None),
}
_GATEWAY_EXTRAS = {"top_logprobs": {"logprobs": True}}  # chat's top_logprobs needs logprobs=true
_MODEL = ModelInfo("m", 256, 512, 16, 64, 0, (2,), True, True)


def _sample(row: SamplingField) -> Any:
    if row.wire_type == "bool":
        return not row.default
    value = _SAMPLES[row.wire_type]
    return [value] if row.repeated else value


def _wire_type(field: FieldDescriptor) -> str:
    message = field.message_type
    if message is not None and message.GetOptions().map_entry:
        key, value = (_SCALAR_TYPES[entry.type] for entry in message.fields)
        return f"map<{key}, {value}>"
    return message.name if message is not None else _SCALAR_TYPES.get(field.type, f"type {field.type}")


def proto_disagreements(table: Table) -> list[str]:
    """generate.proto's SamplingParams has exactly the table's fields, of its types, with presence where an
    unset field must be told from one set to the type's zero value."""
    wire = {field.name: field for field in generate_pb2.SamplingParams.DESCRIPTOR.fields}
    problems = [f"{name}: in generate.proto, not in the table" for name in wire.keys() - {r.name for r in table}]
    for row in table:
        field = wire.get(row.name)
        if field is None:
            problems.append(f"{row.name}: not in generate.proto")
            continue
        is_map = row.wire_type.startswith("map<")
        if _wire_type(field) != row.wire_type or field.is_repeated != (row.repeated or is_map):
            problems.append(f"{row.name}: generate.proto has {_wire_type(field)}, the table {row.wire_type}")
        zero = row.python_type() if row.python_type else None
        if not (row.repeated or is_map or field.has_presence) and (row.default is None or row.default != zero):
            problems.append(f"{row.name}: default {row.default!r} needs `optional` in generate.proto")
    return problems


def sdk_disagreements(table: Table) -> list[str]:
    """The SDK's SamplingParams has a field per row, unset (None) by default, and each row's keyword reaches
    the wire's field of the same name."""
    fields = {field.name: field for field in dataclasses.fields(SdkSamplingParams)}
    problems = [f"{name}: an SDK SamplingParams field, not in the table"
                for name in fields.keys() - {row.name for row in table}]
    for row in table:
        if row.name not in fields or fields[row.name].default is not None:
            problems.append(f"{row.name}: no SDK SamplingParams field defaulting to None")
        try:
            wire = build_generate_request([1], **{row.name: _sample(row)}).sampling
        except TypeError as error:
            problems.append(f"{row.name}: the SDK refuses the keyword ({error})")
            continue
        given = getattr(wire, row.name, None)
        reached = (dict(given) == _sample(row) if row.wire_type.startswith("map<")
                   else given.WhichOneof("kind") == "regex" if row.wire_type == "StructuredOutputs"
                   else list(given) == _sample(row) if row.repeated else given == _sample(row))
        if not reached:
            problems.append(f"{row.name}: the keyword does not reach the wire's {row.name}")
    return problems


def cli_disagreements(table: Table) -> list[str]:
    """Each row with a CLI metavar has its flag, of the row's type, and the flag's value reaches the keyword of
    the row's name; every sampling keyword the CLI sends is a row's."""
    options = {option: action for action in cli._parser()._actions for option in action.option_strings}
    names = {row.name for row in table}
    problems, argv = [], ["a prompt"]
    for row in table:
        if not row.cli_metavar:
            continue
        action = options.get(row.cli_flag)
        if action is None or action.type is not row.python_type or action.metavar != row.cli_metavar:
            problems.append(f"{row.name}: no {row.cli_flag} {row.cli_metavar} flag of type {row.python_type}")
        else:
            argv += [row.cli_flag, str(_sample(row))]
    keywords = cli.sampling_keywords(cli._parser().parse_args(argv))
    problems += [f"{name}: a CLI sampling keyword, not in the table" for name in keywords.keys() - names]
    problems += [f"{row.name}: {row.cli_flag} does not reach the keyword" for row in table
                 if row.cli_metavar and row.cli_flag in options and keywords.get(row.name) != _sample(row)]
    return problems


def _gateway_body(model: type, name: str, value: Any):
    base = {"prompt": "hi"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]}
    return model.model_validate({**base, name: value, **_GATEWAY_EXTRAS.get(name, {})})


def _served(model: type, name: str, row: SamplingField) -> bool:
    """Whether the endpoint of `model` turns the body field `name` into the row's keyword; False where the
    endpoint refuses the field (chat's prompt_logprobs) or does not take the value."""
    value, reached = _GATEWAY_SAMPLES.get(name, (_sample(row), lambda keyword: keyword == _sample(row)))
    try:
        body = _gateway_body(model, name, value)
        keywords = (completion_keywords(body) if model is CompletionRequest
                    else chat_keywords(body, _MODEL, ToolPlan(None, None)))
    except (OpenAIError, ValidationError):
        return False
    return reached(keywords.get(row.name))


def _takes(model: type, name: str, value: Any) -> bool:
    try:
        _gateway_body(model, name, value)
    except ValidationError:
        return False
    return True


def gateway_disagreements(table: Table) -> list[str]:
    """Each OpenAI name is a field of a gateway request model, served by at least one endpoint as the row's
    keyword; integers past the wire type's range are refused by the model (a 400 naming the field); a model
    field named as a row but not among its OpenAI names is refused by name (refused_fields.py)."""
    problems = []
    for row in table:
        for name in row.openai_names:
            models = [model for model in (CompletionRequest, ChatCompletionRequest) if name in model.model_fields]
            if not models:
                problems.append(f"{row.name}: no gateway request field {name}")
            elif not any(_served(model, name, row) for model in models):
                problems.append(f"{row.name}: the gateway's {name} does not reach the keyword")
            if row.wire_type in INTEGER_WIRE_RANGES:
                past = INTEGER_WIRE_RANGES[row.wire_type][1] + 1
                problems += [f"{row.name}: {model.__name__}.{name} takes {past}, past {row.wire_type}"
                             for model in models if _takes(model, name, [past] if row.repeated else past)]
        problems += [f"{row.name}: {model.__name__} declares it, neither served nor refused"
                     for model in (CompletionRequest, ChatCompletionRequest)
                     if row.name in model.model_fields and row.name not in row.openai_names
                     and row.name not in REFUSED_FIELDS]
    return problems


def core_disagreements(table: Table) -> list[str]:
    """The scheduler's SamplingParams holds each row (constraints aside: they become a grammar) with the
    table's default; its other fields are the known derived ones."""
    fields = {field.name: field for field in dataclasses.fields(CoreSamplingParams)}
    held = [row for row in table if row.python_type is not None or row.wire_type.startswith("map<")]
    problems = [f"{name}: a scheduler SamplingParams field, not in the table"
                for name in fields.keys() - {row.name for row in held} - _CORE_DERIVED]
    for row in held:
        if row.name not in fields or fields[row.name].default != row.default:
            problems.append(f"{row.name}: the scheduler's default is not the table's {row.default!r}")
    return problems


_LIMITS = ServingLimits(max_model_len=256, vocab_size=512, kv_capacity_tokens=4096)
_BASE = {"max_tokens": 4}
_RESOLVED = {"--max-n": _LIMITS.request_limits.max_n, "--max-logprobs": _LIMITS.request_limits.max_logprobs,
             "n": 1, "max_tokens": _BASE["max_tokens"]}


def _refusal(sampling: dict[str, Any]) -> str | None:
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]))
    logit_bias = sampling.pop("logit_bias", {})
    request.sampling.CopyFrom(generate_pb2.SamplingParams(**sampling))
    for token_id, bias in logit_bias.items():
        request.sampling.logit_bias[token_id] = bias
    try:
        validate_request(request, None, _LIMITS)
    except (InvalidRequestError, RequestLimitError) as error:
        return str(error)
    return None


def _probes(row: SamplingField) -> list[tuple[float, bool, bool]]:
    """(value, whether the table accepts it, whether the refusal is the table's word for word): each bound,
    and a step past it (past a server limit, request_limits.py may refuse first, naming the field and flag)."""
    bounds, step = row.bounds, 1 if row.python_type is int else 0.01
    wire_low, wire_high = INTEGER_WIRE_RANGES.get(row.wire_type, (float("-inf"), float("inf")))
    probes = [] if row.python_type is int else [(float("inf"), False, True), (float("nan"), False, True)]
    for bound, outward, is_open in ((bounds.low, -step, bounds.low_open), (bounds.high, step, bounds.high_open)):
        value = _RESOLVED[bound] if isinstance(bound, str) else bound
        if value is not None:
            is_limit = isinstance(bound, str) and bound.startswith("--")
            probes += [(value, not is_open, True), (value + outward, False, not is_limit)]
    return [probe for probe in probes if wire_low <= probe[0] <= wire_high]


def validation_disagreements(table: Table) -> list[str]:
    """The scheduler accepts a ranged field at each closed bound and refuses it a step past each, naming the
    field with the table's requirement (a step past a server limit may meet the size limits first:
    request_limits.py, which names the field and the flag)."""
    problems = []
    for row in table:
        if row.bounds is None:
            continue
        for value, accepted, exact in _probes(row):
            given = {5: value} if row.wire_type.startswith("map<") else value
            refusal = _refusal({**_BASE, row.name: given})
            text = ("biases " if row.wire_type.startswith("map<") else "") + row.requirement(_RESOLVED)
            if accepted and refusal is not None:
                problems.append(f"{row.name}={value}: refused ({refusal}), the table accepts it")
            elif not accepted and (refusal is None or not refusal.startswith(f"sampling.{row.name}: ") or (
                    exact and refusal != f"sampling.{row.name}: {text}")):
                problems.append(f"{row.name}={value}: {refusal!r}, the table's is {text!r}")
    return problems


CHECKS = [proto_disagreements, sdk_disagreements, cli_disagreements, gateway_disagreements, core_disagreements,
          validation_disagreements]


def _replaced(row_name: str, **changes: Any) -> Table:
    return tuple(dataclasses.replace(row, **changes) if row.name == row_name else row for row in SAMPLING_FIELDS)


_TYPICAL_P = SamplingField("typical_p", "float", 1.0, ValueRange(0.0, 1.0), "worker sampler", "locally typical",
                           openai_names=("typical_p",), cli_metavar="P")
DRIFTS = [
    (proto_disagreements, SAMPLING_FIELDS + (_TYPICAL_P,), "typical_p: not in generate.proto"),
    (proto_disagreements, _replaced("seed", wire_type="uint32"), "seed: generate.proto has uint64"),
    (proto_disagreements, SAMPLING_FIELDS[1:], "max_tokens: in generate.proto, not in the table"),
    (sdk_disagreements, SAMPLING_FIELDS + (_TYPICAL_P,), "typical_p: no SDK SamplingParams field"),
    (sdk_disagreements, SAMPLING_FIELDS[1:], "max_tokens: an SDK SamplingParams field, not in the table"),
    (cli_disagreements, _replaced("presence_penalty", cli_metavar="P"), "presence_penalty: no --presence-penalty P"),
    (cli_disagreements, SAMPLING_FIELDS + (_TYPICAL_P,), "typical_p: no --typical-p P flag"),
    (cli_disagreements, _replaced("seed", name="sampling_seed"), "seed: a CLI sampling keyword, not in the table"),
    (gateway_disagreements, _replaced("presence_penalty", openai_names=("presence",)),
     "presence_penalty: no gateway request field presence"),
    (gateway_disagreements, _replaced("top_k", openai_names=("top_p",)), "top_k: the gateway's top_p does not"),
    (gateway_disagreements, _replaced("seed", wire_type="int32"), "seed: CompletionRequest.seed takes 2147483648"),
    (gateway_disagreements, _replaced("min_p", openai_names=()), "min_p: CompletionRequest declares it"),
    (core_disagreements, _replaced("repetition_penalty", default=1.2), "repetition_penalty: the scheduler's default"),
    (core_disagreements, SAMPLING_FIELDS[1:], "max_tokens: a scheduler SamplingParams field, not in the table"),
    (validation_disagreements, _replaced("presence_penalty", bounds=ValueRange(-1.5, 1.5)),
     "presence_penalty=-1.51: None, the table's is 'must lie in [-1.5, 1.5]'"),
    (validation_disagreements, _replaced("top_p", bounds=ValueRange(0.0, 1.0)),
     "top_p=0.0: refused (sampling.top_p: must"),
    (validation_disagreements, _replaced("min_tokens", bounds=ValueRange(0, "--max-n")),
     "min_tokens=64: refused (sampling.min_tokens: must lie in [0, max_tokens] (max_tokens = 4))"),
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_each_place_agrees_with_the_table(check):
    assert check(SAMPLING_FIELDS) == []


@pytest.mark.parametrize("check, drifted, reported", DRIFTS, ids=[f"{c.__name__}-{i}" for i, (c, _, _) in
                                                                   enumerate(DRIFTS)])
def test_each_check_reports_a_place_that_drifted_from_the_table(check, drifted, reported):
    problems = check(drifted)
    assert any(problem.startswith(reported) for problem in problems), problems


def test_refusals_say_the_range_with_its_limits_and_the_fields_it_names():
    assert SAMPLING_FIELDS[0].requirement() == "must be at least 0"  # max_tokens: an integer, no upper bound
    best_of = next(row for row in SAMPLING_FIELDS if row.name == "best_of")
    assert best_of.requirement({"n": 3, "--max-n": 64}) == "must lie in [n, 64] (n = 3; --max-n)"
    assert ValueRange(0.0).requirement(is_integer=False) == "must be a finite number >= 0"
    assert ValueRange().requirement(is_integer=False) == "must be a finite number"
    assert ValueRange(0.0, 2.0, low_open=True).requirement(is_integer=False) == "must lie in (0, 2]"
    assert not ValueRange().contains(float("nan")) and not ValueRange(0.0).contains(float("inf"))
    assert ValueRange(0, "max_tokens").contains(4, {"max_tokens": 4})
    assert not ValueRange(0, "max_tokens").contains(5, {"max_tokens": 4})
