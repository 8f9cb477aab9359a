"""OpenAI's and vLLM's constrained-decoding request fields -> the SDK's `structured_outputs` keyword.

Accepted, on /v1/completions and /v1/chat/completions alike (vLLM's names and meanings):
- `response_format`: {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}; {"type": "text"} asks for nothing;
- `structured_outputs`: {json | regex | choice | grammar | json_object, disable_any_whitespace} (vLLM's
  StructuredOutputsParams as an extra body field);
- the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
At most one constraint per request: two (say response_format and guided_regex) are a 400 naming both.
`guided_whitespace_pattern` is refused (llguidance takes only flexible or no whitespace: disable_any_whitespace),
as is a `guided_decoding_backend` other than llguidance's names. The shapes are checked here; the constraint
itself (a valid schema, a regex that compiles) is the scheduler's to judge, which refuses with a 400 naming
`structured_outputs.<kind>`.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import invalid_request, unsupported
from gateway.protocol import SamplingFields

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# vLLM's backend names that mean what we run (its "auto" picks one; "guidance" is llguidance).
_OUR_BACKENDS = (None, "auto", "guidance", "llguidance")


def structured_outputs_keyword(body: SamplingFields) -> dict[str, Any] | None:
    """The SDK's structured_outputs dict of the body's one constraint, or None when it has none."""
    if body.guided_whitespace_pattern is not None:
        raise unsupported("guided_whitespace_pattern", "a custom whitespace pattern is not supported; "
                          "use structured_outputs.disable_any_whitespace for none")
    if body.guided_decoding_backend not in _OUR_BACKENDS:
        raise unsupported("guided_decoding_backend", "the server's constraint engine is llguidance")
    found: dict[str, dict[str, Any]] = {}
    from_format = _response_format(body.response_format)
    if from_format is not None:
        found["response_format"] = from_format
    if body.structured_outputs is not None:
        found.update(_structured_outputs_field(body.structured_outputs))
    for field, kind in _GUIDED.items():
        value = getattr(body, field)
        if value is not None:
            found[field] = {kind: _checked(field, kind, value)}
    if len(found) > 1:
        names = sorted(found)
        raise invalid_request(f"{' and '.join(names)}: give one output constraint per request, not several",
                              names[0])
    return next(iter(found.values()), None)


def _response_format(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if set(value) != {"type", "json_schema"} or not isinstance(spec, dict):
            raise invalid_request("response_format: json_schema needs a \"json_schema\" object "
                                  "({\"name\", \"schema\", \"strict\", \"description\"})", "response_format")
        extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
        if extra:
            raise invalid_request(f"response_format.json_schema: unknown field(s) {', '.join(extra)}",
                                  "response_format")
        schema = spec.get("schema", {})  # OpenAI: no schema means any JSON
        return {"json": _checked("response_format.json_schema.schema", "json", schema)}
    raise unsupported("response_format", "the type must be text, json_object or json_schema "
                      "(with no other keys beside json_schema)")


def _structured_outputs_field(value: Any) -> dict[str, dict[str, Any]]:
    """{"structured_outputs.<kind>": keyword} for each kind given (more than one is the caller's 400)."""
    if not isinstance(value, dict):
        raise invalid_request("structured_outputs: must be an object", "structured_outputs")
    unknown = sorted(set(value) - {*_KINDS, "disable_any_whitespace"})
    if unknown:
        raise unsupported(f"structured_outputs.{unknown[0]}", "not supported (supported: json, regex, choice, "
                          "grammar, json_object, disable_any_whitespace)")
    whitespace = value.get("disable_any_whitespace")
    if whitespace is not None and not isinstance(whitespace, bool):
        raise invalid_request("structured_outputs.disable_any_whitespace: must be a boolean",
                              "structured_outputs.disable_any_whitespace")
    given = {}
    for kind in _KINDS:
        if value.get(kind) not in (None, False):
            field = f"structured_outputs.{kind}"
            given[field] = {kind: _checked(field, kind, value[kind]), "disable_any_whitespace": bool(whitespace)}
    return given


def _checked(field: str, kind: str, value: Any) -> Any:
    """The value in the SDK's form: a schema as JSON text, a choice as a list of strings."""
    if kind == "json":
        if isinstance(value, str):
            return value  # JSON text: the scheduler parses it and names the field if it is not JSON
        if not isinstance(value, (dict, bool)):
            raise invalid_request(f"{field}: a JSON schema must be an object (or its JSON text)", field)
        return json.dumps(value)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(choice, str) for choice in value):
            raise invalid_request(f"{field}: must be a list of strings", field)
        return value
    if kind == "json_object":
        if value is not True:
            raise invalid_request(f"{field}: must be true", field)
        return True
    if not isinstance(value, str):
        raise invalid_request(f"{field}: must be a string", field)
    return value
