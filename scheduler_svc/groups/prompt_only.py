"""A request with max_tokens 0: its prompt is computed for its logprobs, and nothing is sampled.

What lm-evaluation-harness's log-likelihoods ask for (`/v1/completions` with `echo`, `logprobs` and
`max_tokens: 0`), and what vLLM answers: the prompt alone, its prompt logprobs, finish reason "length" and no
completion token. Why a group of its own and not a SingleSequence whose one token is dropped (what the gateway
did before, and vLLM's server does): that token's logits and draw are work for nothing, and it is counted as a
generated token (metrics, the engine's token counters) that no client ever sees.

How: the root is a prefill-only request (request.py), computing the prompt but its last token, so the worker
never samples it (it samples a row only when its computed tokens reach its known tokens). Those positions'
logits score every prompt token from the second on, all the prompt logprobs there are. When the scheduler
reports the root done, the group finishes it (LENGTH, counted) and sends each of the n sequences its final
message: no token, the prompt's logprobs. A one-token prompt has nothing to compute (its first token has no
logprob): it ends at `start`, never reaching the scheduler.
"""

from __future__ import annotations

from scheduler_svc.core.request import FinishReason, Request
from scheduler_svc.core.step_outcome import StepOutcome
from scheduler_svc.groups.request_group import RequestGroup
from scheduler_svc.text.output_stream import OutputDelta


class PromptOnly(RequestGroup):
    def start(self) -> None:
        if self.root.num_prompt_tokens == 1:
            self._send_ends()
            return
        self.root.prefill_only = True
        self._add(self.root)

    def on_step(self, request: Request, outcome: StepOutcome) -> None:
        self.context.scheduler.finish_request(request.request_id, FinishReason.LENGTH)
        self._drop(request.request_id)
        self._send_ends()

    def _unfinished_indices(self) -> list[int]:
        return list(range(self.root.sampling_params.n))

    def _send_ends(self) -> None:
        for index in self._unfinished_indices():
            self.queue.put_nowait(OutputDelta(
                text="", token_ids=(), finish_reason=FinishReason.LENGTH, prompt_tokens=self.root.num_prompt_tokens,
                completion_tokens=0, index=index, prompt_logprobs=self._prompt_logprobs.tokens,
            ))
        self._end()
