"""The scheduling core: which requests run each step, how many tokens each computes, which blocks hold their
KV, who is preempted, and what the worker reported back.

Owns: `Scheduler` (and its `StepPlanner`, `SchedulerState`, limits), `BlockManager` over a `BlockPool` with
the `PrefixCache`, `Request` and its `RequestQueue`, `SamplingParams`, the typed `SchedulerOutput` (the plan)
and `StepOutcome` (the result), `ValidatedRequest`.

May import: the standard library only. No gRPC, ZeroMQ, asyncio, protobuf, tokenizers or torch, so the
property tests (hypothesis) and the thousand-step simulations drive it alone.
"""
