"""What the SDK hands back: plain frozen dataclasses, so callers never touch protobuf messages.

Each type is built from its wire message here, in one place; the sync and async clients share these
conversions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from client.request_metrics import RequestMetrics
from protos.pagedserve.v1 import generate_pb2

_FINISH_REASONS = {
    generate_pb2.FINISH_REASON_UNSPECIFIED: None,
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True)
class Logprob:
    """A token's logprob under log_softmax of the raw logits, its rank (1 = best; ties share a rank) and its
    text decoded alone ("" when the server has no tokenizer)."""

    token_id: int
    logprob: float
    rank: int
    decoded_token: str

    @classmethod
    def from_message(cls, message: generate_pb2.Logprob) -> Logprob:
        return cls(message.token_id, message.logprob, message.rank, message.decoded_token)


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's logprobs (sampling keyword logprobs / prompt_logprobs): the token itself and the top
    alternatives, best first."""

    token: Logprob
    top: tuple[Logprob, ...]

    @classmethod
    def from_message(cls, message: generate_pb2.TokenLogprobs) -> TokenLogprobs:
        return cls(Logprob.from_message(message.token), tuple(Logprob.from_message(m) for m in message.top))


@dataclass(frozen=True)
class GenerateChunk:
    """One message of a generation stream: the text and token ids produced since the previous chunk.

    Why the usage fields are optional: the server sends the token counts once, on the last chunk, together
    with the finish reason ("stop": EOS, a stop string or a stop token id; "length": max_tokens or the
    model's length; "abort": the server gave up on the request). Every earlier chunk has all three None.
    `text` may be empty while a multi-byte character or a possible stop string is still incomplete.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    # Which of the request's n sequences this chunk belongs to (0 when n == 1); each sequence has its own
    # last chunk, which also carries the sequence's cumulative logprob.
    index: int = 0
    cumulative_logprob: float | None = None
    # The logprob of each of `token_ids` (log_softmax of the raw logits); empty where the server does not
    # track them (beam search results).
    logprobs: tuple[float, ...] = ()
    # With the logprobs keyword: one per token id (rank and top alternatives). With prompt_logprobs: on a
    # sequence's first chunk, one per prompt token from the second on.
    token_logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    # With the return_prompt keyword, on a sequence's first chunk: the prompt as the model saw it (a chat as
    # rendered; "" for token ids) and its token ids. None otherwise.
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None

    @classmethod
    def from_response(cls, response: generate_pb2.GenerateResponse) -> GenerateChunk:
        has_usage = response.HasField("usage")
        return cls(
            request_id=response.request_id,
            text=response.text,
            token_ids=tuple(response.token_ids),
            # A reason newer than this SDK still ends the stream; "abort" is the closest honest name for it.
            finish_reason=_FINISH_REASONS.get(response.finish_reason, "abort"),
            prompt_tokens=response.usage.prompt_tokens if has_usage else None,
            completion_tokens=response.usage.completion_tokens if has_usage else None,
            index=response.index,
            cumulative_logprob=response.cumulative_logprob if has_usage else None,
            logprobs=tuple(response.logprobs),
            token_logprobs=tuple(TokenLogprobs.from_message(m) for m in response.token_logprobs),
            prompt_logprobs=tuple(TokenLogprobs.from_message(m) for m in response.prompt_logprobs),
            prompt=response.prompt if response.prompt_token_ids else None,
            prompt_token_ids=tuple(response.prompt_token_ids) if response.prompt_token_ids else None,
        )


@dataclass(frozen=True)
class CompletionOutput:
    """One of a request's n returned sequences (vLLM's name), assembled from its chunks."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    completion_tokens: int | None
    cumulative_logprob: float | None
    # One per token id when the server tracked them all, else empty.
    logprobs: tuple[float, ...] = ()
    # With the logprobs keyword: one per token id. With prompt_logprobs: one per prompt token, the first None
    # (as vLLM's); empty otherwise.
    token_logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()


@dataclass(frozen=True)
class GenerationResult:
    """A whole generation: the concatenation of a stream's chunks.

    The top-level fields describe sequence 0 (the only one when n == 1; the best one for beam search and
    best_of); `outputs` holds all n sequences in index order. `finish_reason` and the token counts come from a
    sequence's last chunk; they are None only if the server closed the stream without one, which a
    conforming server never does.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    outputs: tuple[CompletionOutput, ...] = ()
    # With the return_prompt keyword (the offline LLM always asks): the prompt as the model saw it (a chat as
    # its template rendered it; None for a token-id prompt, as vLLM's) and its token ids.
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    # When it was sent, got its first and last token, and ended, as the client saw it (Client.generate sets it).
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        """Every sequence ended (vLLM's RequestOutput.finished); always true for a whole generation."""
        return bool(self.outputs) and all(output.finish_reason is not None for output in self.outputs)

    @classmethod
    def from_chunks(cls, chunks: Iterable[GenerateChunk], metrics: RequestMetrics | None = None) -> GenerationResult:
        texts: dict[int, list[str]] = {}
        token_ids: dict[int, list[int]] = {}
        logprobs: dict[int, list[float]] = {}
        ranked: dict[int, list[TokenLogprobs]] = {}
        prompt_logprobs: dict[int, tuple[TokenLogprobs | None, ...]] = {}
        last: dict[int, GenerateChunk] = {}
        request_id, prompt_tokens, prompt, prompt_token_ids = "", None, None, None
        for chunk in chunks:
            if chunk.prompt_token_ids is not None:
                prompt, prompt_token_ids = chunk.prompt or None, chunk.prompt_token_ids
            texts.setdefault(chunk.index, []).append(chunk.text)
            token_ids.setdefault(chunk.index, []).extend(chunk.token_ids)
            logprobs.setdefault(chunk.index, []).extend(chunk.logprobs)
            ranked.setdefault(chunk.index, []).extend(chunk.token_logprobs)
            if chunk.prompt_logprobs:
                prompt_logprobs[chunk.index] = (None, *chunk.prompt_logprobs)
            last[chunk.index] = chunk
            request_id = chunk.request_id
            if chunk.prompt_tokens is not None:
                prompt_tokens = chunk.prompt_tokens
        outputs = tuple(
            CompletionOutput(
                index=index,
                text="".join(texts[index]),
                token_ids=tuple(token_ids[index]),
                finish_reason=last[index].finish_reason,
                completion_tokens=last[index].completion_tokens,
                cumulative_logprob=last[index].cumulative_logprob,
                logprobs=tuple(logprobs[index]) if len(logprobs[index]) == len(token_ids[index]) else (),
                token_logprobs=tuple(ranked[index]) if len(ranked[index]) == len(token_ids[index]) else (),
                prompt_logprobs=prompt_logprobs.get(index, ()),
            )
            for index in sorted(texts)
        )
        first = outputs[0] if outputs else None
        return cls(
            request_id=request_id,
            text=first.text if first else "",
            token_ids=first.token_ids if first else (),
            finish_reason=first.finish_reason if first else None,
            prompt_tokens=prompt_tokens,
            completion_tokens=first.completion_tokens if first else None,
            outputs=outputs,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            metrics=metrics,
        )


@dataclass(frozen=True)
class LoraAdapterInfo:
    """A LoRA adapter the server serves: the name requests use (`lora_name=`), and the model it was trained on
    (None: the served model)."""

    name: str
    base_model_name: str | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What the server serves (mirrors ModelInfoResponse). `has_tokenizer` False: only token-id prompts work;
    `has_chat_template` False: chat messages are refused. `default_sampling`: what a request's unset sampling
    fields take on this server (only those its generation config sets, e.g. {"temperature": 0.6, "top_p":
    0.9}); `generation_config`: where they came from ("auto", "vllm" or a directory); `version`: the server's
    pagedserve version."""

    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    num_swap_blocks: int
    eos_token_ids: tuple[int, ...]
    has_tokenizer: bool
    has_chat_template: bool
    default_sampling: dict[str, float | int] = dataclasses.field(default_factory=dict)
    generation_config: str = ""
    version: str = ""
    batch_invariant: bool = False  # the server runs --batch-invariant
    quantization: str = ""  # the linear layers' method, vLLM's --quantization names ("": unquantized)
    kv_cache_dtype: str = "auto"  # what the KV cache stores: "auto" (the model's dtype) or "fp8_e4m3"
    # The LoRA adapters served (--lora-modules): requests name one by `lora_name=`.
    lora_adapters: tuple[LoraAdapterInfo, ...] = ()

    @classmethod
    def from_response(cls, response: generate_pb2.ModelInfoResponse) -> ModelInfo:
        special = {
            "eos_token_ids": tuple(response.eos_token_ids),
            "lora_adapters": tuple(LoraAdapterInfo(a.name, a.base_model_name or None) for a in response.lora_adapters),
            "default_sampling": {field.name: _float32_shortest(value) if isinstance(value, float) else value
                                 for field, value in response.default_sampling.ListFields()},
        }
        return cls(**{
            field.name: special[field.name] if field.name in special else getattr(response, field.name)
            for field in dataclasses.fields(cls)
        })


def _float32_shortest(value: float) -> float:
    """A float field as its file said it (0.9, not 0.8999999761581421): the wire holds 32 bits, 7 digits."""
    return float(f"{value:.7g}")


@dataclass(frozen=True)
class LatencyHistogram:
    """A fixed-bucket histogram (mirrors the LatencyHistogram message; seconds, or a count for the token and
    parameter histograms): `counts[i]` observations fell in (upper_bounds[i-1], upper_bounds[i]]; the last
    count, one past `upper_bounds`, is the +Inf bucket."""

    upper_bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int

    @classmethod
    def from_message(cls, message: generate_pb2.LatencyHistogram) -> LatencyHistogram:
        return cls(tuple(message.upper_bounds), tuple(message.counts), message.sum, message.count)


@dataclass(frozen=True)
class ServerStats:
    """Scheduler counters at one moment (mirrors GetStatsResponse): queue lengths, KV and swap blocks,
    preemptions, steps and finished requests since the server started; prompt and generated token totals,
    finished requests by reason, and histograms per request (latencies from admission, phase times, sizes)
    and per step (scheduled tokens). The field comments of GetStatsResponse say what each measures."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_swap_blocks: int
    num_free_swap_blocks: int
    num_steps: int
    num_finished_requests: int
    num_swapped_out_blocks: int
    prefix_cache_hit_rate: float
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    time_to_first_token: LatencyHistogram
    time_per_output_token: LatencyHistogram
    e2e_request_latency: LatencyHistogram
    num_finished_stop: int
    num_finished_length: int
    num_finished_abort: int
    inter_token_latency: LatencyHistogram
    request_queue_time: LatencyHistogram
    request_prefill_time: LatencyHistogram
    request_decode_time: LatencyHistogram
    request_inference_time: LatencyHistogram
    request_prompt_tokens: LatencyHistogram
    request_generation_tokens: LatencyHistogram
    request_params_n: LatencyHistogram
    request_params_max_tokens: LatencyHistogram
    iteration_tokens: LatencyHistogram
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # Data parallel (`serve -dp N`): each engine's own stats (the fields above are their sums) and the front's
    # router policy; empty from a lone scheduler.
    engines: tuple[EngineStats, ...] = ()
    router_policy: str = ""

    @classmethod
    def from_response(cls, response: generate_pb2.GetStatsResponse) -> ServerStats:
        values = {}
        for field in dataclasses.fields(cls):
            value = getattr(response, field.name)
            if field.name == "engines":
                value = tuple(EngineStats(entry.engine, cls.from_response(entry.stats), entry.routed_requests,
                                          entry.in_flight_requests) for entry in value)
            elif isinstance(value, generate_pb2.LatencyHistogram):
                value = LatencyHistogram.from_message(value)
            elif not isinstance(value, (int, float, str)):  # a repeated field
                value = tuple(value)
            values[field.name] = value
        return cls(**values)


@dataclass(frozen=True)
class EngineStats:
    """One data-parallel engine's stats, and the requests the front routed to it since the front started (and
    how many of them are still streaming); mirrors the EngineStats message."""

    engine: int
    stats: ServerStats
    routed_requests: int
    in_flight_requests: int
