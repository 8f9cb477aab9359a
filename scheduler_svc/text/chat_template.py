"""Chat templates compiled as transformers renders them: a sandboxed Jinja environment with transformers'
extensions, filters and globals (`{% generation %}`, `tojson` without HTML escaping, `raise_exception`,
`strftime_now`).

Templates come from model repos, so they are untrusted code: the sandbox cannot mutate its inputs.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` and render its body unchanged.

    transformers uses this tag to mark assistant tokens for training masks; some templates contain it, and
    they would not even parse without the tag. Serving has no use for the mask.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt; transformers overrides it thus.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers renders them in.

    Templates come from model repos, so they are untrusted code: a sandbox that cannot mutate its inputs.
    """
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(source)
