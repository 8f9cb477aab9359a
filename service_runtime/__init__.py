"""The bottom floor: what more than one service process needs, and nothing that knows a service.

- model_source.py: where a model's files are (a directory, a .gguf file, a hub id resolved once).
- step_timer.py: how long each phase of a step takes, logged by the scheduler and the worker alike.
- service_process.py: what every service process does first (log lines named for it, die with its launcher)
  and the standalone entry point each service's `__main__` runs.
- worker_link_flags.py: the flags both ends of the scheduler <-> worker link must agree on.

May import: the standard library and third-party packages only; never a service (scheduler_svc, worker_svc,
gateway), the SDK (client) or the launcher (pagedserve). tests/test_import_layers.py checks it.
"""
