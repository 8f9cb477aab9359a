"""tests/gpu/: what only a GPU can show (CUDA graphs, the grammar mask's copy stream, CUDA-event timing,
symmetric-memory all-reduces, the compiled Triton kernels, the served float32 path against transformers).

Every test collected here gets the `gpu` marker and, on a machine without CUDA or under Triton's interpreter
(tests/conftest.py turns it on by default, and it would run the kernels on CPU tensors), a skip that says
why: `make test` lists them as skipped, `make test-gpu` (TRITON_INTERPRET=0 pytest -m gpu tests/gpu) runs them.
docs/develop/gpu_tests.md says what each proves and how to run them on a lent GPU machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def why_not_here() -> str | None:
    """The reason these tests cannot run in this process, or None when they can."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (make test-gpu on a GPU machine)"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "needs compiled Triton kernels: run with TRITON_INTERPRET=0 (make test-gpu)"
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m gpu` deselects the items not marked yet
def pytest_collection_modifyitems(config, items):
    reason = why_not_here()
    for item in items:
        if HERE not in item.path.parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
