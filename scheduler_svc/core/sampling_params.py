"""Per-request sampling parameters as the scheduler holds them.

Parsed and validated once, at the gRPC edge (`request_validation.py`), from the wire message; immutable after
that, so the scheduler, the stop checks and the plan builder can share one object without copying. Names and
defaults follow vLLM's `SamplingParams`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = -1  # -1 = off
    # Always set once admitted: the scheduler draws one for requests that gave none, so a request samples
    # the same tokens after a preemption as it would have without.
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Parallel sampling: best_of sequences generated, the n with the highest cumulative logprob returned.
    n: int = 1
    best_of: int | None = None  # None: n
    # Beam search when > 1 (greedy); n <= beam_width results returned.
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0  # over output tokens; 0 = off
    frequency_penalty: float = 0.0  # over output tokens; 0 = off
    repetition_penalty: float = 1.0  # over prompt and output tokens; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    bad_words: tuple[str, ...] = ()
    # The bad words as token-id sequences (`bad_words.py`), resolved at the edge where the tokenizer is.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0  # EOS / stop ids masked and stop strings unchecked until this many tokens
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top alternatives per generated token; None = none
    prompt_logprobs: int | None = None  # the same for prompt tokens; None = none
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Constrained decoding: the llguidance grammar built and validated at the edge from the request's
    # structured_outputs (api/structured_outputs.py); "" = unconstrained. The workers keep the matcher state.
    structured_grammar: str = ""
    # The grammar applies from the token after the first output token equal to this id (a reasoning model's
    # end of thought, structured_outputs.reasoning_end); None: from the first token.
    structured_grammar_after_token_id: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_sequences(self) -> int:
        """How many sequences are generated for the request (beam search aside)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1
