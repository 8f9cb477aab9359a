"""`pagedserve bench`: benchmarks a user runs from the command line, in the shape of `vllm bench`.

`serve` (serve.py) drives a running OpenAI-compatible server over HTTP streaming, or ours over gRPC, at a
request rate and reports vLLM's online numbers (TTFT, TPOT, ITL, end-to-end latency percentiles, throughput,
goodput). cli.py registers the subcommands under `pagedserve bench`.
"""
