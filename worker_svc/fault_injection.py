"""Faults on demand for the reliability tests: a model runner that fails, crashes or dawdles when told to.

Why a wrapper: the faults the tests need (a forward pass that raises, a worker killed by one request's token, a
slow prefill) all happen where the model runs, but a serving worker must carry no hook for them. The worker
wraps its runner in a `FaultInjectingRunner` only when a hidden test flag asks for a fault
(`--fail-at-step`, `--crash-on-token-id`, `--crash-at-output-token`, `--prefill-seconds-per-token`); otherwise
the step calls the runner itself. The wrapper checks before each forward pass, then delegates everything.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from worker_svc.config import WorkerConfig
from worker_svc.model_runner import ModelRunner, StepOutput
from worker_svc.persistent_batch import PersistentBatch, StepInputs

# The exit code of a hard crash (as the scheduler's own crash code): what a segfaulting kernel looks like.
_CRASH_EXIT_CODE = 70


class InjectedFault(RuntimeError):
    """The failure `--fail-at-step` asks for: tests prove what a forward pass that raises does to the service."""


def wants_faults(config: WorkerConfig) -> bool:
    return (config.fail_at_step is not None or config.crash_on_token_id is not None
            or bool(config.prefill_seconds_per_token))


class FaultInjectingRunner:
    def __init__(self, runner: ModelRunner, config: WorkerConfig):
        self._runner = runner
        self._config = config
        self.num_forward_passes = 0  # counts towards config.fail_at_step
        self._checked_generation: dict[int, int] = {}  # row -> the generation of its request checked at arrival

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def execute(self, batch: PersistentBatch, inputs: StepInputs,
                previous_sampled: torch.Tensor | None) -> StepOutput:
        config = self._config
        if config.crash_on_token_id is not None:
            self._crash_on_poison(batch, inputs)
        if config.prefill_seconds_per_token:  # a slow prefill on demand
            time.sleep(config.prefill_seconds_per_token * (len(inputs.input_ids) - inputs.num_decode_seqs))
        self.num_forward_passes += 1
        if self.num_forward_passes == config.fail_at_step:
            raise InjectedFault(f"forward pass {self.num_forward_passes} failed on purpose (--fail-at-step)")
        return self._runner.execute(batch, inputs, previous_sampled)

    def _crash_on_poison(self, batch: PersistentBatch, inputs: StepInputs) -> None:
        """Exits at once: when a request arrives whose tokens hold the crash token (a poison request); with
        `crash_at_output_token`, instead when a row whose prompt holds it is about to sample that output
        token (a poison request that crashes mid-decode, at the same point after every recompute)."""
        config = self._config
        if config.crash_at_output_token is not None:
            if self._samples_poisoned_output(batch, inputs.sample_rows):
                os._exit(_CRASH_EXIT_CODE)
            return
        for row in inputs.rows.tolist():
            generation = int(batch.generation[row])
            if self._checked_generation.get(row) == generation:
                continue
            self._checked_generation[row] = generation
            if np.any(batch.token_ids[row, : batch.num_tokens[row]] == config.crash_on_token_id):
                os._exit(_CRASH_EXIT_CODE)

    def _samples_poisoned_output(self, batch: PersistentBatch, sample_rows: np.ndarray) -> bool:
        """Whether a row about to sample holds the crash token in its prompt and would sample its
        `crash_at_output_token`-th output token (its known tokens, pending ones included, count one less)."""
        config = self._config
        for row in sample_rows.tolist():
            num_prompt = int(batch.num_prompt_tokens[row])
            if (batch.num_tokens[row] - num_prompt + 1 == config.crash_at_output_token
                    and config.crash_on_token_id in batch.token_ids[row, :num_prompt]):
                return True
        return False
