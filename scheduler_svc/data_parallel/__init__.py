"""Data parallel (`pagedserve serve --data-parallel-size N`): N engines, each a scheduler with its own worker
ranks on an internal port, behind one front (front_service.py) that serves the public gRPC API and routes each
request to one engine (router.py) by its prompt's first prefix-cache block (prefix_key.py).

Run as `python -m scheduler_svc.data_parallel` (the launcher starts it; docs/scale_out.md). Why inside
scheduler_svc: the front reuses the scheduler's prompt encoding and block keys, and imports nothing above it.
"""
