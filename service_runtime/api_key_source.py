"""Where a service's API key comes from: its --api-key flag, else the environment.

Why the environment: a command line is world-readable (`ps`, /proc/PID/cmdline), so `pagedserve serve` hands
its key to the scheduler and gateway it starts in their environment, never in their argv; a user may do the
same (vLLM reads VLLM_API_KEY). Each service's config parser reads them once (api_key_from); launchers build
their children's environment here (child_environment), and warn when a bind past loopback has no key
(open_bind_warning).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping

API_KEY_ENV = "PAGEDSERVE_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"
# The scheduler's key as the gateway sends it (its --grpc-api-key).
GRPC_API_KEY_ENV = "PAGEDSERVE_GRPC_API_KEY"


def api_key_from(flag_value: str | None, environ: Mapping[str, str]) -> str | None:
    """--api-key if given (an empty one: no key), else $PAGEDSERVE_API_KEY, else $VLLM_API_KEY."""
    if flag_value is not None:
        return flag_value or None
    return environ.get(API_KEY_ENV) or environ.get(VLLM_API_KEY_ENV) or None


def grpc_api_key_from(flag_value: str | None, environ: Mapping[str, str]) -> str | None:
    """--grpc-api-key if given, else $PAGEDSERVE_GRPC_API_KEY."""
    if flag_value is not None:
        return flag_value or None
    return environ.get(GRPC_API_KEY_ENV) or None


def child_environment(keys: Mapping[str, str | None]) -> dict[str, str]:
    """This process's environment for a child process, with exactly the given key variables (None: left out):
    a key variable this process was started with is not inherited by a child that should not have it."""
    env = {name: value for name, value in os.environ.items()
           if name not in (API_KEY_ENV, VLLM_API_KEY_ENV, GRPC_API_KEY_ENV)}
    env.update({name: value for name, value in keys.items() if value})
    return env


def open_bind_warning(binds: Mapping[str, str], api_key: str | None) -> str | None:
    """One line to print at start when a server is bound past loopback (`binds`: flag -> its host) with no API
    key, else None. A warning, not a refusal (the Docker entry point refuses, docker/entrypoint.sh): on a
    trusted network or behind a proxy that authenticates, an open bind can be what was meant; but it must
    never be silent, since anyone who reaches the port can then generate."""
    if api_key:
        return None
    open_flags = [f"{flag} {host or repr(host)}" for flag, host in binds.items() if not _is_loopback(host)]
    if not open_flags:
        return None
    return (f"pagedserve: WARNING: serving beyond loopback ({', '.join(open_flags)}) without an API key: anyone "
            f"who reaches the port can use it; set one with --api-key or ${API_KEY_ENV}")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name (or empty: every interface): it may resolve past loopback
        return False
