"""A warning for every Triton kernel compiled after the worker reported ready.

Why: a compile takes a large fraction of a second or more on the host, and the step that meets a new kernel
variant waits for it, with every stream in the batch (docs/benchmarks.md, "Online serving": compiles inside a
measured run after the warm-up pass). warm_up_kernels and the decode graphs are meant to
compile every variant before `ready`; a variant they missed is a bug of theirs, and this names it (the
kernel, its launch options and the specialization of each argument) so that it can be added or
de-specialized. Installed once serving starts; Triton calls the hook only on an in-memory cache miss, so it
costs nothing per launch.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def warn_on_compiles_while_serving() -> bool:
    """Installs the hook; False where this Triton has no hook for it (then nothing is watched)."""
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return False

    def on_compile(*, repr: str, compile: dict | None = None, **_: object) -> bool:  # noqa: A002 (Triton's keywords)
        specialization = (compile or {}).get("configs")  # each argument's divisibility/alignment attributes
        logger.warning("Triton compiles a kernel variant while serving (the warm-up missed it): %s%s",
                       " ".join(repr.split()), f" attributes {specialization}" if specialization else "")
        return False  # compile it

    runtime.jit_cache_hook = on_compile
    return True
