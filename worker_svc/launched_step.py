"""A step launched on the device whose sampled tokens the host has not read yet (the worker's overlap record)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from protos.pagedserve.v1 import worker_pb2
from worker_svc.model_runner import DeviceSample
from worker_svc.persistent_batch import PendingTokens


@dataclass
class LaunchedStep:
    """A step queued on the device whose sampled tokens have not been read back (see `Worker.launch`).

    Why a record rather than a blocking call: the worker launches step N+1 before it waits for step N, so
    the GPU always has the next step queued while the host reads results and builds inputs. It holds what
    `finish` needs: the result built so far, the rows that sample, their pending tokens in the batch, and the
    draw on its way to the host (`DeviceSample`: the sampled ids on the device, inputs of the next step).
    """

    result: worker_pb2.StepResult
    behind_another: bool = False  # launched while another step was in flight
    kind: str = "decode"
    timed_as: str = "decode"  # the kind, and whether rows are constrained (the step timers' split)
    sampled_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # The draw's entries, one per row of its logits: sampled_rows itself, unless a row has drafts (then that
    # row 1 + d times, and draw_offsets says each entry's position after the row's last known token).
    draw_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    draw_offsets: np.ndarray | None = None
    request_ids: list[str] = field(default_factory=list)  # of sampled_rows, at launch
    num_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pending: PendingTokens | None = None
    sampled: DeviceSample | None = None
    started: torch.cuda.Event | None = None  # before the step's first device work, when timed (device_busy.py)
    # Launched behind another step with constrained rows: the mask and draw, run by `Worker.complete`.
    deferred_sample: Callable[[], None] | None = None
    masks: Future | None = None  # the deferred draw's grammar masks, filling (`Worker.begin_masks`)
    # Speculative decoding with a draft model: how many draft tokens its plan asks per sampled row (0: none),
    # proposed in `Worker.finish` once the rows' tokens are written.
    propose_draft_tokens: int = 0

    @property
    def draw_pending(self) -> bool:
        """Whether its deferred draw is not on the device yet (`Worker.complete` puts it there)."""
        return self.deferred_sample is not None

    def ready(self) -> bool:
        """Whether the step's tokens are on the host (or it sampled none)."""
        return self.sampled is None or self.sampled.ready()

    def sampled_tokens(self, sampled: np.ndarray, num_accepted: np.ndarray | None = None,
                       accepted_logprobs: np.ndarray | None = None) -> worker_pb2.SampledTokens:
        """The sampled rows' result from the draw's host copy (`DeviceSample.wait`; with drafts, each row's
        taken entry), as parallel lists: whole-column numpy, no loop over the rows. `num_accepted`: each row's
        kept drafts, in a step where some row had drafts; `accepted_logprobs`: theirs, row after row."""
        k = (sampled.shape[1] - 3) // 2
        num_top = np.clip(self.num_logprobs, 0, k)
        top = np.arange(k) < num_top[:, None]  # each row's first num_top columns, row after row
        return worker_pb2.SampledTokens(
            request_ids=self.request_ids, token_ids=sampled[:, 0].astype(np.int64).tolist(),
            logprobs=sampled[:, 1].tolist(),
            ranks=np.where(self.num_logprobs >= 0, sampled[:, 2], 0).astype(np.int64).tolist(),
            num_top=num_top.tolist(), top_token_ids=sampled[:, 3 : 3 + k][top].astype(np.int64).tolist(),
            top_logprobs=sampled[:, 3 + k :][top].tolist(),
            num_accepted_drafts=[] if num_accepted is None else num_accepted.tolist(),
            accepted_draft_logprobs=[] if accepted_logprobs is None else accepted_logprobs.tolist())
