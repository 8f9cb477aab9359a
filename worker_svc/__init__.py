"""The worker service: one process per GPU (or the CPU) that owns the paged KV cache and the swap pool, runs
the model's forward pass with paged attention, and samples.

Its parts: models/ (one file per architecture, the registry, weight loading), layers/ (what the models share),
sampling/ (the sampler, its inputs, logits processors, prompt logprobs); beside them the step executor
(worker.py) and the process's loop around it (serving_loop.py), the tensor-parallel group (tensor_parallel.py,
tensor_parallel_fit.py), the persistent batch and its per-row entries, CUDA-graph decode, the KV cache and its sizing,
the ZeroMQ link to the scheduler (scheduler_link.py), config.py and main.py (`python -m worker_svc`).

May import: kernels/, protos/, service_runtime/; never scheduler_svc, gateway, client or pagedserve: the
worker knows the scheduler only through the wire schema. tests/test_import_layers.py holds these rules.
"""
