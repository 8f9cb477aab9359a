"""The services report a version even when run from a source tree that was never pip-installed (the GPU
machines run the checkout with PYTHONPATH): the scheduler used to die at import there."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import service_runtime.package_version as package_version


def test_the_installed_version_or_unknown_from_a_bare_source_tree(monkeypatch):
    assert package_version.pagedserve_version() == version("pagedserve")

    def not_installed(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(package_version, "version", not_installed)
    assert package_version.pagedserve_version() == "unknown"
