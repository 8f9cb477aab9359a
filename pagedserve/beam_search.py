"""`LLM.beam_search`'s types, with vLLM's names: BeamSearchParams in, one BeamSearchOutput per prompt out.

Why its own types and not SamplingParams: vLLM gives beam search its own parameters and result shape
(sequences that hold the prompt, best first), and code moving over reads them by those names. Underneath it is
the server's beam search (SamplingParams.beam_width), which scores beams as Hugging Face does: cumulative
logprob / generated length ** length_penalty (vLLM divides by the whole sequence's length, prompt included,
so with length_penalty != 0 the two may rank differently; with 0 they agree).
"""

from __future__ import annotations

from dataclasses import dataclass

from client.types import GenerationResult


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    # Beam search here is greedy over raw logprobs: only 0 is served (vLLM scales logprobs by it).
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def keywords(self) -> dict:
        """The SDK's sampling keywords; ValueError naming a value the server's beam search does not take."""
        if self.temperature != 0.0:
            raise ValueError("BeamSearchParams.temperature: beam search is greedy here; only 0 is supported")
        return dict(beam_width=self.beam_width, n=self.beam_width, max_tokens=self.max_tokens,
                    ignore_eos=self.ignore_eos or None, length_penalty=self.length_penalty,
                    include_stop_str_in_output=self.include_stop_str_in_output or None, temperature=0.0)


@dataclass(frozen=True)
class BeamSearchSequence:
    """One finished beam. As vLLM's: `tokens` and `text` hold the prompt followed by the generated part (a
    token-id prompt contributes no text)."""

    tokens: tuple[int, ...]
    text: str
    cum_logprob: float
    finish_reason: str | None


@dataclass(frozen=True)
class BeamSearchOutput:
    """The best beams of one prompt, best first (at most beam_width)."""

    sequences: tuple[BeamSearchSequence, ...]

    @classmethod
    def from_result(cls, result: GenerationResult) -> BeamSearchOutput:
        prompt_ids, prompt_text = result.prompt_token_ids or (), result.prompt or ""
        return cls(tuple(
            BeamSearchSequence(tokens=(*prompt_ids, *output.token_ids), text=prompt_text + output.text,
                               cum_logprob=output.cumulative_logprob or 0.0, finish_reason=output.finish_reason)
            for output in result.outputs
        ))
