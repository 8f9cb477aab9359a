"""Ending a process that holds native extension state, without the interpreter's teardown.

Why: a worker imports torch and Triton, whose nanobind extensions print dozens of "leaked instance" lines
when the interpreter finalizes with their objects still alive (the model, compiled kernels). Those objects
live as long as the process by design, so the lines report nothing wrong but read like a fault at every
exit. Once the worker has said its last words (sent its results, closed its link), the only teardown left
is this: flush what it wrote, then leave through os._exit, which runs no finalizers.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_after_flush(code: int) -> NoReturn:
    """Flushes the log handlers and the standard streams, then ends the process with `code` at once."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream has nothing left to flush
            pass
    os._exit(code)
