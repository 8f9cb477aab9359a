"""Child processes of `pagedserve serve` die with their parent, so no orphan outlives a killed launcher."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def exit_with_parent() -> None:
    """Asks Linux to send this process SIGTERM when its parent exits (a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the parent already died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
