"""`pagedserve bench`: benchmarks users run themselves, named and printed as vLLM's `vllm bench ...`.

`throughput` and `latency` (throughput.py, latency.py) run the offline engine: an `LLM` and the private
`pagedserve serve` it starts (offline_engine.py); `serve` drives a running server over HTTP or gRPC. cli.py
registers the subcommands under `pagedserve bench`.
"""
