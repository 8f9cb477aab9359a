"""Service flags declared once: each field of a service's frozen config dataclass carries its flag (names,
help, choices, switch kind), and the argparse arguments, the config built from parsed flags and the argv a
launcher hands a child process are all derived from that one declaration.

Why: a flag written in four places (the parser, the config field, the function copying one into the other,
and the launcher that spells it again for the child) drifts: a new flag that the launcher forgets is
silently dropped by `pagedserve serve`. vLLM's EngineArgs is the model: a field's help, default, type and
choices written once, its flags generated from it. Standard library only: every service imports this.

A field's flag (`flag(...)` in the dataclass) says:
- `names`: the flag and its aliases, the first the canonical one (forwarded to children);
- `switch`: None for `--flag VALUE` (the type comes from the field's annotation or `parse`), "on"
  (store_true), "off" (store_false: the field defaults to True) or "both" (`--flag`/`--no-flag`);
- `shared`: whether `pagedserve serve` takes the flag under the same name (False: the launcher sets the
  value itself, from its own flags or its environment, or the child keeps the default);
- `forwarded`: False for a value that never goes on a child's command line (an API key: `ps` shows argv);
- `hidden`: a test-only flag, absent from --help but parsed and forwarded like any other.

Checks that span fields stay in each config's `__post_init__`; resolving what a flag names (a key from the
environment, a template from a file) stays in each config's `*_config_from_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

_FLAG = "flag"
_FIELD_DEFAULT = object()  # a flag whose parsed default is its field's default
SWITCH_KINDS = (None, "on", "off", "both")


@dataclass(frozen=True)
class Flag:
    """One field's command-line flag (see the module docstring for each part)."""

    names: tuple[str, ...]
    help: str | None = None
    choices: tuple | None = None
    switch: str | None = None
    # argparse's type for `--flag VALUE`; None: int, float or str from the field's annotation.
    parse: Callable[[str], Any] | None = None
    # How a value is written on a child's argv (json.dumps for a mapping).
    show: Callable[[Any], str] = str
    # The parsed default when it differs from the field's: None where the config picks the value later.
    parsed_default: Any = _FIELD_DEFAULT
    # A store_true switch's default: on when this environment variable is set and not "0" (vLLM's switches).
    env_switch: str | None = None
    # A `--flag VALUE`'s default from this environment variable when it is set (vLLM's VLLM_CPU_* knobs); argparse
    # parses it as it would the flag's value.
    env_default: str | None = None
    # A "both" switch's older spellings of --no-flag, and their help.
    negations: tuple[str, ...] = ()
    negation_help: str | None = None
    metavar: str | None = None
    # argparse's nargs for a list-valued `--flag V [V ...]` ("+"); each value is parsed by `parse` and written
    # back by `show`; the field holds a tuple.
    nargs: str | None = None
    hidden: bool = False
    shared: bool = True
    forwarded: bool = True

    def __post_init__(self) -> None:
        if self.switch not in SWITCH_KINDS:
            raise ValueError(f"{self.names[0]}: switch must be one of {SWITCH_KINDS}, not {self.switch!r}")


def flag(*names: str, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING,
         **options: Any) -> Any:
    """A dataclass field with its flag and default: `port: int = flag("--port", default=8000, help="HTTP port")`."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={_FLAG: Flag(names=names, **options)})


def shared_flag_field(default: Any, declared: Flag) -> Any:
    """A field whose flag is declared elsewhere because two services take it (worker_link_flags.py): added
    once to a parser that holds both services' flags."""
    return dataclasses.field(default=default, metadata={_FLAG: declared})


def flag_of(field: dataclasses.Field) -> Flag | None:
    return field.metadata.get(_FLAG)


def flagged_fields(config_class: type, *, shared_only: bool = False) -> list[tuple[dataclasses.Field, Flag]]:
    """(field, flag) of every field of `config_class` that has a flag, in declaration order."""
    found = [(field, flag_of(field)) for field in dataclasses.fields(config_class) if flag_of(field) is not None]
    return [(field, declared) for field, declared in found if declared.shared or not shared_only]


def field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def parsed_default(field: dataclasses.Field, declared: Flag, environ: Mapping[str, str]) -> Any:
    """What the parser gives the field when its flag is not on the command line."""
    if declared.env_switch is not None:
        return environ.get(declared.env_switch, "0") not in ("", "0")
    if declared.env_default is not None and declared.env_default in environ:
        return environ[declared.env_default]
    if declared.parsed_default is not _FIELD_DEFAULT:
        return declared.parsed_default
    return field_default(field)


def add_config_arguments(parser: argparse.ArgumentParser, config_class: type, *, shared_only: bool = False) -> None:
    """Adds the flag of every field of `config_class` (only those `serve` shares, with `shared_only`). A flag
    the parser already has from the same declaration (--heartbeat-interval, which the scheduler and the
    worker both take) is added once; any other clash is argparse's error."""
    hints = typing.get_type_hints(config_class)
    for field, declared in flagged_fields(config_class, shared_only=shared_only):
        existing = parser._option_string_actions.get(declared.names[0])  # argparse has no public lookup
        if existing is not None and existing.dest == field.name and existing.help == _help(declared):
            continue
        options: dict[str, Any] = {"dest": field.name, "help": _help(declared)}
        if declared.metavar is not None:
            options["metavar"] = declared.metavar
        if declared.nargs is not None:
            options["nargs"] = declared.nargs
        default = parsed_default(field, declared, os.environ)
        if declared.switch == "on":
            parser.add_argument(*declared.names, action="store_true", default=default, **options)
        elif declared.switch == "off":
            parser.add_argument(*declared.names, action="store_false", **options)
        elif declared.switch == "both":
            parser.add_argument(*declared.names, action=argparse.BooleanOptionalAction, default=default, **options)
            if declared.negations:
                parser.add_argument(*declared.negations, dest=field.name, action="store_false",
                                    help=argparse.SUPPRESS if declared.hidden else declared.negation_help)
        else:
            value_type = declared.parse or _value_type(hints[field.name], declared.names[0])
            if declared.choices is not None:
                options["choices"] = declared.choices
            parser.add_argument(*declared.names, type=value_type, default=default, **options)


def flag_values(config_class: type, args: argparse.Namespace, *, shared_only: bool = False) -> dict[str, Any]:
    """{field: parsed value} of every flagged field of `config_class`; a flag this parser did not take (a
    rank in a namespace of `serve`'s) gives the field's default."""
    return {field.name: getattr(args, field.name, field_default(field))
            for field, _ in flagged_fields(config_class, shared_only=shared_only)}


def config_argv(config_class: type, values: Mapping[str, Any], *, keep_defaults: Collection[str] = ()) -> list[str]:
    """The argv that gives a child process `values` (field -> value, from a config or a parsed namespace):
    each forwarded flag whose value differs from what the child would take anyway, by its canonical name.
    `keep_defaults`: fields written even at their default (a rank's `--rank 0` beside its world size)."""
    argv: list[str] = []
    for field, declared in flagged_fields(config_class):
        if field.name not in values or not declared.forwarded:
            continue
        value = values[field.name]
        defaults = (field_default(field), parsed_default(field, declared, {}))
        if field.name not in keep_defaults and any(value == default for default in defaults):
            continue
        argv += _flag_argv(declared, value)
    return argv


def _flag_argv(declared: Flag, value: Any) -> list[str]:
    name = declared.names[0]
    if declared.switch == "on":
        return [name] if value else []
    if declared.switch == "off":
        return [] if value else [name]
    if declared.switch == "both":
        return [name if value else "--no-" + name.removeprefix("--")]
    if declared.nargs is not None:
        return [name, *map(declared.show, value)] if value else []
    return [] if value is None else [name, declared.show(value)]


def _help(declared: Flag) -> str | None:
    return argparse.SUPPRESS if declared.hidden else declared.help


def _value_type(annotation: Any, name: str) -> Callable[[str], Any]:
    """int, float or str from `int`, `float | None`, ...; another type needs the flag's `parse`."""
    members = set(typing.get_args(annotation)) if isinstance(annotation, types.UnionType) else {annotation}
    members.discard(type(None))
    if len(members) == 1 and (only := members.pop()) in (int, float, str):
        return only
    raise TypeError(f"{name}: give `parse` for a field of type {annotation!r}")
