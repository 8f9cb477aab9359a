"""The OpenAI-compatible HTTP gateway: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

It is a client of the public gRPC API and nothing more: every generation is one `Generate` stream through
the Python SDK's AsyncClient, /metrics renders `GetStats`, /health asks the gRPC health service. It holds no
model, tokenizer or request state of its own beyond the streams it is relaying, so any number of gateways
can front one scheduler and a gateway restart loses nothing.

Layout: config.py (flags), app.py (routes, auth, error handlers), server.py (uvicorn lifecycle),
backend.py (the AsyncClient to the scheduler), protocol.py (OpenAI request bodies), sampling.py (OpenAI fields -> SDK keywords), completions.py and
chat_completions.py (the two generation endpoints), choices.py (assembling choices and logprobs from
stream chunks), streaming.py (SSE and client-disconnect handling), errors.py (OpenAI's error shape),
metrics.py (Prometheus exposition), vllm_metrics.py (its vLLM-named families).
"""
