"""`pagedserve bench`: benchmarks users run themselves, named, flagged and printed as vLLM's `vllm bench ...`.

`serve` (serve.py) drives a running OpenAI-compatible server over HTTP streaming, or ours over gRPC, at a
request rate and reports vLLM's online numbers (TTFT, TPOT, ITL, end-to-end latency percentiles, throughput,
goodput). `throughput` and `latency` (throughput.py, latency.py) run the offline engine: an `LLM` and the
private `pagedserve serve` it starts (offline_engine.py). cli.py registers the subcommands.
"""
