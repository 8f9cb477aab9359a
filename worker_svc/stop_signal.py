"""How a standalone worker takes SIGTERM: it leaves when its scheduler tells it to.

Why: `docker compose stop` signals the worker before or together with the scheduler (compose stops a
service's dependents first, the rest at once). A worker that died at once would break the scheduler's drain:
the requests in flight fail, and the scheduler logs a worker failure with a traceback and exits 1. So the
first SIGTERM is noted in one line and the worker serves on until the scheduler, draining, sends its
shutdown (exit 0) or goes away (exit 1 within 3 of its heartbeats); a second SIGTERM ends it at once. A
worker that a launcher started (`serve`, the Ray executor: --exit-with-parent) keeps the default: its
launcher stops the scheduler first.
"""

from __future__ import annotations

import os
import signal
import time


def leave_with_the_scheduler_on_sigterm() -> None:
    """Installs the handler above for SIGTERM (main thread only, as Python's signal handlers are)."""

    def on_sigterm(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM: the default, an immediate end
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        # os.write, not logging: a handler may run while the main thread holds the logging lock.
        os.write(2, f"{stamp} worker INFO SIGTERM: serving until the scheduler shuts this worker down "
                    f"(a second SIGTERM exits now)\n".encode())

    signal.signal(signal.SIGTERM, on_sigterm)
