"""Beam search as a request group: beams are scheduler requests that fork and are freed through the block
manager's reference counts.

The scoring and stopping follow Hugging Face transformers' `generate(num_beams=W, do_sample=False)` so the
best sequence is the same: each round, every running beam's top candidates (log_softmax of the raw logits,
returned by the worker for beam rows) are scored as beam score + logprob; the best K = max(2, 1 + #EOS) * W
are kept; those among the first W that end (EOS, or the length limit) become finished hypotheses scored
`sum_logprobs / generated_length ** length_penalty` (the best W kept); the best W that do not end run on.
A surviving beam chosen once continues in place (the engine appends the chosen token); chosen again, it is
forked (the child shares every block, copy-on-write for the partial one); not chosen, it is freed. The search
ends when no running beam can beat the worst of W finished hypotheses (HF's heuristic), when all W are
finished and early_stopping is set, or when every candidate ended.

Beams advance in lockstep: a round is decided only once every running beam has its candidates (a preempted
beam may take longer); beams that are ready wait, holding their blocks, with nothing to compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.core.request import FinishReason, Request
from scheduler_svc.core.step_outcome import StepOutcome
from scheduler_svc.groups.request_group import RequestGroup
from scheduler_svc.text.output_stream import OutputDelta


@dataclass
class _Beam:
    member_id: str
    score: float  # sum of the generated tokens' logprobs
    tokens: list[int]  # generated so far


@dataclass(frozen=True)
class _Hypothesis:
    score: float  # length-penalized
    cumulative_logprob: float
    tokens: tuple[int, ...]
    ended_by_eos: bool


class BeamSearch(RequestGroup):
    def start(self) -> None:
        params = self.root.sampling_params
        self._width = params.beam_width
        self._num_results = params.n
        self._eos = () if params.ignore_eos else tuple(self.root.eos_token_ids)
        self._num_candidates = max(2, 1 + len(self._eos)) * self._width
        self._length_penalty = params.length_penalty
        self._early_stopping = params.early_stopping
        self._max_new_tokens = params.max_tokens
        self._running = [_Beam(self.root.request_id, 0.0, [])]
        self._finished: list[_Hypothesis] = []
        self._improvement_possible = True
        self._candidates: dict[str, list[tuple[int, float]]] = {}
        self._next_member = 0
        self.root.num_beam_candidates = self._num_candidates
        self._add(self.root)

    def _unfinished_indices(self) -> list[int]:
        return list(range(self._num_results))

    def on_step(self, request: Request, outcome: StepOutcome) -> None:
        candidates = outcome.beam_candidates.get(request.request_id)
        if candidates is None:
            return  # a chunk of the prompt, not yet its end
        # The model's context limit ends a beam like max_tokens does.
        self._max_new_tokens = min(self._max_new_tokens,
                                   self.context.scheduler.limits.max_model_len - request.num_prompt_tokens)
        self._candidates[request.request_id] = candidates
        if all(beam.member_id in self._candidates for beam in self._running):
            self._decide_round()

    def _decide_round(self) -> None:
        generated = len(self._running[0].tokens)
        scored = [
            (beam.score + logprob, rank, beam_index, token)
            for beam_index, beam in enumerate(self._running)
            for rank, (token, logprob) in enumerate(self._candidates[beam.member_id][: self._num_candidates])
        ]
        scored.sort(key=lambda c: (-c[0], c[2], c[1]))
        top = scored[: self._num_candidates]
        ends = [token in self._eos or generated + 1 >= self._max_new_tokens for _, _, _, token in top]
        self._candidates.clear()

        full = len(self._finished) == self._width
        if self._improvement_possible and not (full and self._early_stopping):
            new = [
                _Hypothesis(score / (generated + 1) ** self._length_penalty, score,
                            tuple(self._running[beam_index].tokens + [token]), token in self._eos)
                for rank, ((score, _, beam_index, token), end) in enumerate(zip(top, ends))
                if end and rank < self._width
            ]
            self._finished = sorted(self._finished + new, key=lambda h: -h.score)[: self._width]

        survivors = [c for c, end in zip(top, ends) if not end][: self._width]
        if len(self._finished) == self._width and survivors:
            best_possible = survivors[0][0] / (generated + 1) ** self._length_penalty
            if best_possible <= min(h.score for h in self._finished):
                self._improvement_possible = False
        done = (not self._improvement_possible or not survivors or all(ends)
                or (len(self._finished) == self._width and self._early_stopping))
        if done:
            for beam in self._running:
                self._release(beam.member_id)
            self._running = []
            self._send_results()
            self._end()
            return
        self._advance_beams(survivors)

    def _advance_beams(self, survivors: list[tuple[float, int, int, int]]) -> None:
        scheduler = self.context.scheduler
        parents = self._running
        used: set[int] = set()
        next_running: list[_Beam] = []
        appended: list[tuple[_Beam, int]] = []
        for score, _, beam_index, token in survivors:
            parent = parents[beam_index]
            if beam_index not in used:
                used.add(beam_index)
                appended.append((parent, token))
                next_running.append(_Beam(parent.member_id, score, parent.tokens + [token]))
                continue
            source = scheduler.get_request(parent.member_id)
            self._next_member += 1
            child = Request(
                request_id=f"{self.request_id}#beam{self._next_member}",
                prompt_token_ids=list(source.prompt_token_ids),
                sampling_params=source.sampling_params,
                eos_token_ids=source.eos_token_ids,
                output_token_ids=list(source.output_token_ids) + [token],
                priority=source.priority,
                num_beam_candidates=self._num_candidates,
                lora_name=source.lora_name,
                lora_path=source.lora_path,
                lora_generation=source.lora_generation,
            )
            # Forks come before the parent's own append: the child shares what the parent has computed.
            self._add(child, parent.member_id, num_shared_tokens=source.num_computed_tokens)
            next_running.append(_Beam(child.request_id, score, parent.tokens + [token]))
        for parent, token in appended:
            scheduler.append_token(parent.member_id, token)
        for beam_index, parent in enumerate(parents):
            if beam_index not in used:
                self._release(parent.member_id)
        self._running = next_running

    def _send_results(self) -> None:
        tokenizer = self.context.tokenizer
        for index, hypothesis in enumerate(self._finished[: self._num_results]):
            text_tokens = list(hypothesis.tokens[:-1] if hypothesis.ended_by_eos else hypothesis.tokens)
            self.queue.put_nowait(OutputDelta(
                text=tokenizer.decode(text_tokens) if tokenizer is not None else "",
                token_ids=hypothesis.tokens,
                finish_reason=FinishReason.STOP if hypothesis.ended_by_eos else FinishReason.LENGTH,
                prompt_tokens=self.root.num_prompt_tokens,
                completion_tokens=len(hypothesis.tokens),
                index=index,
                cumulative_logprob=hypothesis.cumulative_logprob,
            ))



