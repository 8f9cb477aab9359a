"""The scheduler service: one CPU process, never torch, that owns every decision about requests.

Its parts, each a sub-package whose docstring says what it owns and what it may import (bottom to top):

- core/: the scheduling core (scheduler, step planner, block manager and pool, prefix cache, requests and
  their queue, the typed step output and outcome). Standard library only: the property tests and the
  simulation drive it alone, in milliseconds.
- text/: text <-> tokens (tokenizer and its loaders, chat templates, GGUF tokenizers, incremental
  detokenizer, stop strings, bad words) and the per-sequence output stream built from them.
- worker_io/: the link to the workers (ZeroMQ sockets, heartbeats, the plan codec between the core's typed
  plan and the wire schema, the plan log).
- groups/: what serves one client request: a single sequence, parallel sampling, beam search; and the paced
  queue each group's stream reads.
- api/: the gRPC edge (servicer, access control, request validation and size limits, delta coalescing).

Beside them: engine.py (the event loop: schedule, send, receive, update, publish), metrics/, config.py
(the one frozen config), service.py (wires the parts and runs the process), main.py (the entry point of
`python -m scheduler_svc`). Imports of protos/ and service_runtime/ are allowed; worker_svc, kernels,
gateway, client and pagedserve are not. tests/test_import_layers.py holds these rules.
"""
