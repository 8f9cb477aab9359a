"""The offline API's progress bar: finished prompts, and the input and output token speeds so far, as vLLM's
("Processed prompts: ... est. speed input: X toks/s, output: Y toks/s").

Speeds are tokens of the finished requests over the wall time since the batch started, so they read the same
way as vLLM's bar and as `benchmarks/offline_throughput.py`'s totals.
"""

from __future__ import annotations

import time

from client.types import GenerationResult


class ThroughputBar:
    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, disable=not enabled,
                         postfix=self._speeds(0.0, 0.0))
        self._start = time.perf_counter()
        self._input_tokens = 0
        self._output_tokens = 0

    def finished(self, result: GenerationResult) -> None:
        self._input_tokens += result.prompt_tokens or 0
        self._output_tokens += sum(output.completion_tokens or 0 for output in result.outputs)
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(self._speeds(self._input_tokens / elapsed, self._output_tokens / elapsed),
                                  refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()

    @staticmethod
    def _speeds(input_speed: float, output_speed: float) -> str:
        return f"est. speed input: {input_speed:.2f} toks/s, output: {output_speed:.2f} toks/s"
