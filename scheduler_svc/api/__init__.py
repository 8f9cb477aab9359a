"""The gRPC edge: the Generate / GetStats / health servicer (grpc_server.py), API keys and TLS (access.py),
request validation into a `ValidatedRequest` and the size limits checked before any work (request_validation.py,
request_limits.py), and coalescing of a stream's buffered deltas into one message (delta_coalescing.py).

May import: every other part of the scheduler (core/, text/, groups/, engine.py, metrics/), protos/, grpc.
Nothing in the scheduler imports api/ but service.py.
"""
