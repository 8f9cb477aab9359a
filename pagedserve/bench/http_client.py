"""The httpx module the benchmark speaks HTTP with.

Why a module for one import: some environments (this project's CPU image) carry httpx's API under the
distribution name `httpx2`; every other one, the GPU machines included, has `httpx`. Both are the same API.
"""

from __future__ import annotations

try:
    import httpx
except ImportError:  # pragma: no cover (depends on the environment)
    import httpx2 as httpx  # type: ignore[no-redef]

__all__ = ["httpx"]
