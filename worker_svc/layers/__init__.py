"""The layers that model files share: norms, rotary embedding, attention over the paged KV cache, MLPs.

Why apart from models/: a new architecture is mostly a new arrangement of these (DESIGN.md: "everything shared
in the shared layers"), and numerics that must follow transformers (cast order, rotary tables, attention
rounding) are written once. Each layer computes through the kernels' ops (torch reference or Triton), chosen
by the worker, never by the layer.

May import: torch, kernels/, worker_svc/model_config.py, worker_svc/tensor_parallel.py; never models/ or the
rest of the worker.
"""
