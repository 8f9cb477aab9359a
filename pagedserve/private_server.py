"""The private `pagedserve serve` process behind an offline `LLM`: its command line, start, readiness and stop.

Why a separate process and not the engine in-process: the engine is the scheduler and worker processes (the
scheduler never imports torch; the worker owns the device), so the offline path runs exactly the code that
serves online. The server listens on a free loopback port with no HTTP gateway and dies with its owner (or
the interpreter) at the latest; its log is kept on disk only when it failed, for the post-mortem.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping
from typing import Any

from client.sync_client import Client
from pagedserve.free_port import free_port
from service_runtime.api_key_source import API_KEY_ENV, child_environment

_READY_POLL_S = 1.0
_STOP_TIMEOUT_S = 30.0
# Options the private server sets itself: where it listens, and that it serves no HTTP.
_RESERVED_OPTIONS = frozenset({"host", "port", "grpc_host", "grpc_port", "enable_http", "help"})


class PrivateServer:
    """Owns one `pagedserve serve` child process on a free loopback port (`target`). `api_key`: the key the
    server requires, handed over in its environment (never its argv, which `ps` shows)."""

    def __init__(self, argv: list[str], api_key: str | None = None) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="pagedserve-llm-", suffix=".log", delete=False)
        self.log_path = self._log.name
        port = free_port()
        self.target = f"127.0.0.1:{port}"
        self._process = subprocess.Popen(
            [sys.executable, "-m", "pagedserve", "serve", "--grpc-host", "127.0.0.1", "--grpc-port", str(port),
             "--no-http", *argv],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=child_environment({API_KEY_ENV: api_key}),
        )
        self._finalizer = weakref.finalize(self, _stop_server, self._process, self._log, self.log_path)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def wait_ready(self, client: Client, timeout: float) -> None:
        """Returns once the server is SERVING; RuntimeError with its log if it exits or is not ready in time."""
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"pagedserve serve exited with code {self._process.returncode}:\n{self.log_tail()}")
            try:
                client.wait_ready(timeout=min(_READY_POLL_S, max(deadline - time.monotonic(), 0.01)))
                return
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"pagedserve serve was not ready in {timeout:g} s:\n{self.log_tail()}") from None

    def log_tail(self) -> str:
        with open(self.log_path, errors="replace") as log:
            return log.read()[-4000:]

    def stop(self) -> None:
        """SIGTERM, then kill after 30 s. Idempotent."""
        self._finalizer()


def server_argv(model: str | None, options: Mapping[str, Any]) -> list[str]:
    """`pagedserve serve` flags for LLM's keywords, checked against serve's own parser (so a misspelt or
    unknown option fails here, naming the known ones, rather than in the child). A keyword is a flag's
    destination (`enable_prefix_caching=False`) or, for a switch, the switch's name (`enforce_eager=True`, as
    vLLM's LLM takes it). `api_key` is left out: it goes through the environment (PrivateServer)."""
    from pagedserve.serve_flags import serve_parser  # lazy: importing pagedserve loads no service config

    serve = serve_parser()
    actions = {action.dest: action for action in serve._actions if action.option_strings}
    switches = {option.lstrip("-").replace("-", "_"): option for action in serve._actions
                if action.option_strings and action.nargs == 0 for option in action.option_strings
                if option.startswith("--") and not option.startswith("--no-")}
    argv = [] if model is None else ["--model", str(model)]
    for name, value in options.items():
        action = actions.get(name)
        if name in switches and action is None and name not in _RESERVED_OPTIONS:
            if value:
                argv.append(switches[name])
            continue
        if action is None or name in _RESERVED_OPTIONS:
            known = ", ".join(sorted((set(actions) | set(switches)) - _RESERVED_OPTIONS - {"model"}))
            raise TypeError(f"unknown server option {name!r}; known: {known}")
        if name == "api_key":
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            if value is not None and bool(value) != action.default:
                argv.append(flag if value else _negative_flag(action))
        elif action.nargs == 0 and not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if value:  # a refused switch (trust_remote_code=True): the server says why
                argv.append(flag)
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if bool(value) != action.default:  # the flag flips the default; the default needs no flag
                argv.append(flag)
        elif action.nargs == "+" and isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)] if value else []
        elif value is not None:
            argv += [flag, _flag_text(value)]
    return argv


def _flag_text(value: Any) -> str:
    """A flag's value as its command line writes it: a dict as JSON, a value the flag's parser built (such as
    `bench`'s parsed --speculative-config) by its own `to_json`, anything else by str."""
    if isinstance(value, dict):
        return json.dumps(value)
    to_json = getattr(value, "to_json", None)
    return to_json() if callable(to_json) else str(value)


def _negative_flag(action: argparse.BooleanOptionalAction) -> str:
    return next(option for option in action.option_strings if option.startswith("--no-"))


def _stop_server(process: subprocess.Popen, log, log_path: str) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    log.close()
    if process.returncode == 0:
        os.unlink(log_path)  # kept when the server failed, for the post-mortem
