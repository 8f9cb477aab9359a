"""The version every service reports (gRPC ModelInfo.version, HTTP /version): the installed `pagedserve`
distribution's, or "unknown" when the services run from a source tree that was never installed (a checkout
on a GPU machine with PYTHONPATH set, a container layer without the package metadata)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def pagedserve_version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "unknown"
