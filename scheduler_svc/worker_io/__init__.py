"""The link to the workers: the ZeroMQ sockets and their IO thread (worker_link.py), heartbeats and worker
death (worker_health.py), translation between the core's typed plan / outcome and the wire schema
(plan_codec.py, the only module that knows both), and the plan log for replay.

May import: core/, protos/, the standard library, zmq, asyncio. Not text/, groups/ or api/: the worker never
sees text.
"""
