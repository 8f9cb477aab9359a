"""A model the worker refuses while loading it: its exception and the exit code that tells the launcher so.

Why a code of its own: most refusals are found from config.json before any child starts
(pagedserve/serve_checks.py resolve_servable_model), but some only while the worker reads the checkpoint (a
tensor the model has no parameter for, a shape that does not match, a missing one). Such a worker would fail
the same way at every start, so it is not a crash to recover from: it leaves with one line (no traceback)
and LOAD_REFUSED_EXIT_CODE, and the launcher stops the stack without restarting it or spending
--max-worker-restarts. 78 is sysexits.h's EX_CONFIG ("configuration error"), which no Python failure
(1), signal (128 + n) or injected fault (70, EX_SOFTWARE) exits with.
"""

from __future__ import annotations

LOAD_REFUSED_EXIT_CODE = 78


class LoadRefused(ValueError):
    """The model or checkpoint cannot be served as it is (its message says why, in one line). A ValueError,
    as the checks that find it raise: callers that catch those keep working."""
