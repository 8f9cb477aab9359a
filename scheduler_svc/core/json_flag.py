"""The value of a flag that takes vLLM's JSON-object form (--speculative-config, --structured-outputs-config).

Why one place: each such flag's argparse type first needs the same two refusals (not JSON, not an object), in
the same words, before reading its own keys. Standard library only: the core imports it.
"""

from __future__ import annotations

import argparse
import json


def json_object_flag(text: str) -> dict:
    """The JSON object `text` holds, or argparse's error saying why not."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return options
