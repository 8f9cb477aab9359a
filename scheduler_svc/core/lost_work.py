"""What one request had in the steps a lost worker took with it (`Scheduler.recover_from_worker_loss`).

Why a record of its own: the engine decides from it which requests a worker loss is blamed on (a poison
request crashes its worker at the same point again; see scheduler_svc/worker_loss_suspects.py), and that needs
more than who held a row: how far each request may have got on the lost worker, and whether it had just joined.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LostWork:
    request_id: str
    # Output tokens whose results came back before the loss (the request resumes from them).
    num_output_tokens: int
    # Output tokens it was to sample in the lost steps: the worker may have died computing any of them.
    num_lost_samples: int
    # It started on the lost worker in those steps (a NewRequestData: its first admission, or a recompute).
    joined: bool
