"""Models the worker serves: one file per architecture (llama.py), the registry that maps a checkpoint's
architecture to its class (registry.py), and loading (model_loader.py: build on the meta device, then read the
weights with weight_loader.py from safetensors or GGUF).

May import: torch, kernels/, worker_svc/layers/ and worker_svc/model_config.py; never the worker's serving
loop, batch or sampler. Importing this package imports no model: import the module you need.
"""
