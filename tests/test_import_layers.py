"""The floors of the code base hold: every import arrow runs down (docs/architecture.md, "Packages").

Read from the source (every import statement, those inside functions too), so a lazy import that runs back
up fails here as surely as one at the top of a module. Each rule names the floor it protects; a violation
lists the importing file and the imported module.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = ("client", "gateway", "kernels", "pagedserve", "protos", "scheduler_svc", "service_runtime",
               "tests", "worker_svc", "benchmarks", "scripts")


@cache
def imports_of(package: str) -> tuple[tuple[str, str], ...]:
    """(file, imported module) for every absolute import in the package's Python files (generated code aside)."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            found += [(str(path.relative_to(ROOT)), module) for module in modules]
    return tuple(found)


def violations(package: str, forbidden: tuple[str, ...], within: str | None = None) -> list[str]:
    """Imports from `package` (or its sub-package / module `within`) of a module under any `forbidden` prefix."""
    prefix = (within or package).replace(".", "/")
    return [f"{path} imports {module}" for path, module in imports_of(package)
            if (path.startswith(prefix + "/") or path == prefix + ".py")
            and any(module == name or module.startswith(name + ".") for name in forbidden)]


def others(*allowed: str) -> tuple[str, ...]:
    return tuple(name for name in FIRST_PARTY if name not in allowed)


# What each top-level package may import of the first-party ones (beside itself); anything else runs up.
PACKAGE_FLOORS = {
    "protos": others("protos"),
    "service_runtime": others("service_runtime"),
    "kernels": others("kernels"),
    "client": others("client", "protos"),
    "scheduler_svc": others("scheduler_svc", "protos", "service_runtime"),
    "worker_svc": others("worker_svc", "kernels", "protos", "service_runtime"),
    "gateway": others("gateway", "client", "protos", "service_runtime"),
    "pagedserve": ("tests", "benchmarks", "scripts"),
    "benchmarks": ("tests", "scripts"),
    "scripts": ("tests", "benchmarks"),
}

SCHEDULER = "scheduler_svc."
WIRE_AND_LOOP = ("grpc", "grpc_health", "zmq", "asyncio", "protos", "torch", "transformers", "numpy")
# Inside the scheduler: each part and what it must not import (its own floor and those below it are fine).
SCHEDULER_PARTS = {
    "core": (*WIRE_AND_LOOP, "tokenizers", "jinja2", "gguf",
             *(SCHEDULER + part for part in ("text", "worker_io", "groups", "api", "engine", "service", "metrics"))),
    "text": (*WIRE_AND_LOOP, *(SCHEDULER + part for part in ("worker_io", "groups", "api", "engine", "service"))),
    "worker_io": ("grpc", "torch", *(SCHEDULER + part for part in ("text", "groups", "api", "engine", "service"))),
    "groups": ("grpc", "zmq", "protos", "torch", *(SCHEDULER + part for part in ("worker_io", "api", "engine", "service"))),
    "engine": ("grpc", "zmq", "torch", SCHEDULER + "api", SCHEDULER + "service"),
    "api": ("zmq", "torch", SCHEDULER + "service", SCHEDULER + "worker_io"),
}

WORKER = "worker_svc."
WORKER_PARTS = {
    "layers": (WORKER + "models", WORKER + "sampling", WORKER + "worker", WORKER + "persistent_batch"),
    "models": (WORKER + "sampling", WORKER + "worker", WORKER + "persistent_batch", WORKER + "scheduler_link"),
    "sampling": (WORKER + "models", WORKER + "layers", WORKER + "worker", WORKER + "scheduler_link"),
}


@pytest.mark.parametrize("package", sorted(PACKAGE_FLOORS))
def test_package_imports_only_the_floors_below_it(package):
    assert violations(package, PACKAGE_FLOORS[package]) == []


def test_nothing_but_the_tests_imports_the_test_suite():
    assert [v for package in PACKAGE_FLOORS for v in violations(package, ("tests",))] == []


def test_the_scheduler_never_imports_torch_or_transformers():
    assert violations("scheduler_svc", ("torch", "transformers", "triton")) == []


@pytest.mark.parametrize("part", sorted(SCHEDULER_PARTS))
def test_scheduler_part_imports_only_what_lies_below_it(part):
    assert violations("scheduler_svc", SCHEDULER_PARTS[part], within=SCHEDULER + part) == []


def test_scheduler_core_uses_the_standard_library_alone():
    """The core's property tests and simulations run it with nothing else: every import is stdlib or core."""
    import sys

    outside = [f"{path} imports {module}" for path, module in imports_of("scheduler_svc")
               if path.startswith("scheduler_svc/core/")
               and module.split(".")[0] not in sys.stdlib_module_names
               and not module.startswith(SCHEDULER + "core")]
    assert outside == []


@pytest.mark.parametrize("part", sorted(WORKER_PARTS))
def test_worker_part_imports_only_what_lies_below_it(part):
    assert violations("worker_svc", WORKER_PARTS[part], within=WORKER + part) == []


def test_the_rules_see_a_violation(tmp_path, monkeypatch):
    """The checker itself: a core module that imported grpc, and a service that imported the CLI, are caught."""
    for relative, source in (("scheduler_svc/core/bad.py", "def f():\n    import grpc\n"),
                             ("worker_svc/bad.py", "from pagedserve.cli import main\n")):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(source)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    imports_of.cache_clear()
    try:
        assert violations("scheduler_svc", SCHEDULER_PARTS["core"], within=SCHEDULER + "core") == [
            "scheduler_svc/core/bad.py imports grpc"]
        assert violations("worker_svc", PACKAGE_FLOORS["worker_svc"]) == ["worker_svc/bad.py imports pagedserve.cli"]
    finally:
        imports_of.cache_clear()


def import_graph(package: str) -> dict[str, set[str]]:
    """{module: the package's modules it imports} for every module of `package`, from every import statement
    (those inside functions too: the circle this guards against, cli -> bench -> LLM -> private_server ->
    cli, closed through an import inside a function). `from pkg import name` counts as an import of the
    module pkg.name where there is one."""
    modules = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                named = {f"{node.module}.{alias.name}" for alias in node.names}
                imported |= {module if module in modules else node.module for module in named}
        graph[name] = {module for module in imported if module in modules and module != name}
    return graph


def first_import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (a depth-first search that keeps its path)."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        for imported in sorted(graph[module]):
            if (cycle := visit(imported, [*path, module])) is not None:
                return cycle
        done.add(module)
        return None

    for module in sorted(graph):
        if (cycle := visit(module, [])) is not None:
            return cycle
    return None


def test_pagedserve_has_no_import_cycle():
    cycle = first_import_cycle(import_graph("pagedserve"))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_names_a_cycle_closed_inside_a_function(tmp_path, monkeypatch):
    (tmp_path / "pagedserve" / "bench").mkdir(parents=True)
    for relative, source in (("pagedserve/__init__.py", ""), ("pagedserve/bench/__init__.py", ""),
                             ("pagedserve/cli.py", "from pagedserve.bench import latency\n"),
                             ("pagedserve/bench/latency.py", "from pagedserve.llm import LLM\n"),
                             ("pagedserve/llm.py", "def argv():\n    from pagedserve.cli import build_parser\n")):
        (tmp_path / relative).write_text(source)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert first_import_cycle(import_graph("pagedserve")) == [
        "pagedserve.bench.latency", "pagedserve.llm", "pagedserve.cli", "pagedserve.bench.latency"]
