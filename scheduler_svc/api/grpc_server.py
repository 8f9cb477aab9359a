"""The public gRPC API (pagedserve.v1.Generation) of the scheduler service.

Handlers are thin: refuse with RESOURCE_EXHAUSTED when `max_queued_requests` sequences already wait for a
step (before any token, and before the cost of tokenizing, so a flood is cheap to turn away), validate
(refusing bad input with INVALID_ARGUMENT naming the field; a large prompt is encoded, and a structured-output
constraint's grammar built, on a worker thread so the loop keeps relaying other streams), submit to the
engine, say so in the stream's initial metadata (`pagedserve-accepted`: a queued stream is visibly alive,
and an HTTP gateway may start its streamed 200 then, since every validation refusal has already been sent),
and relay the engine's deltas as stream messages. Request bytes that do not parse (not protobuf, or
a string field that is not UTF-8) get INVALID_ARGUMENT from the handler, not UNKNOWN from gRPC's deserializer
(`add_generation_service`), and so does a request over --max-message-bytes (`grpc_receive_limit` says how).
A stream that ends early for any reason (client cancel, disconnect, deadline) aborts its request in the
engine, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from dataclasses import dataclass, field

import grpc

from protos.pagedserve.v1 import generate_pb2, generate_pb2_grpc
from scheduler_svc.api.delta_coalescing import coalesce, take_ready
from scheduler_svc.api.lora_registry import LoraRefused, LoraRegistry
from scheduler_svc.api.prompt_encoding import OFF_LOOP_PROMPT_CHARS, prompt_chars
from scheduler_svc.api.request_limits import RequestLimitError
from scheduler_svc.api.request_validation import ServingLimits, validate_request
from scheduler_svc.api.tokenization import detokenize, tokenize
from scheduler_svc.core.request import FinishReason
from scheduler_svc.core.token_logprobs import TokenLogprob
from scheduler_svc.core.validated_request import InvalidRequestError
from scheduler_svc.engine import Engine, RequestFailedError
from scheduler_svc.generation_defaults import GenerationDefaults
from scheduler_svc.groups.request_group import StreamEnd
from scheduler_svc.metrics import fill_stats_response
from scheduler_svc.text.output_stream import OutputDelta
from scheduler_svc.text.tokenizer import Tokenizer
from service_runtime.package_version import pagedserve_version

_FINISH_REASONS = {
    None: generate_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generate_pb2.FINISH_REASON_ABORT,
}
_MAX_REQUEST_ID_LENGTH = 256
# Initial metadata sent once a request is validated and queued (the SDK's client/async_client.py reads it).
ACCEPTED_METADATA = (("pagedserve-accepted", "1"),)
_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"]
SERVICE_NAME = _SERVICE.full_name


@dataclass(frozen=True)
class ServedModel:
    """What ModelInfo reports; fixed once the workers are connected."""

    name: str
    limits: ServingLimits
    block_size: int
    num_kv_blocks: int
    num_swap_blocks: int
    eos_token_ids: tuple[int, ...]
    max_queued_requests: int | None = None  # None: no bound
    # What requests' unset sampling fields take (--generation-config), applied before validation.
    generation_defaults: GenerationDefaults = GenerationDefaults()
    batch_invariant: bool = False  # the workers run --batch-invariant
    quantization: str = ""  # the workers' linear layers' method ("" unquantized; vLLM's --quantization names)
    kv_cache_dtype: str = "auto"  # what the KV pool stores ("auto": the model's dtype; "fp8_e4m3")
    # Multi-LoRA: the adapters served now (--lora-modules, and those loaded and unloaded at run time). The one
    # mutable part of the model: the registry changes, the field never does.
    loras: LoraRegistry = field(default_factory=LoraRegistry)


class MalformedRequest:
    """What a request's bytes decode to when they are not a valid message of the method's request type."""

    reason = "not a valid message (malformed protobuf, or a string field that is not UTF-8)"


class OversizedRequest(MalformedRequest):
    """A request over --max-message-bytes: it can never succeed, so INVALID_ARGUMENT (not gRPC's own
    RESOURCE_EXHAUSTED, which says "not now" and which clients retry)."""

    def __init__(self, num_bytes: int, max_message_bytes: int) -> None:
        self.reason = (f"{num_bytes:,} bytes, over the {max_message_bytes:,}-byte message limit "
                       "(the scheduler's --max-message-bytes)")


def grpc_receive_limit(max_message_bytes: int) -> int:
    """The gRPC server's own receive limit: twice --max-message-bytes, so a request over the limit but not
    over twice it reaches our decoder, which answers INVALID_ARGUMENT naming the limit. gRPC refuses anything
    larger itself with RESOURCE_EXHAUSTED "Received message larger than max" (the SDK maps that wording to
    InvalidRequestError and does not retry it); the ceiling stays so a huge message is never decoded."""
    return 2 * max_message_bytes


def add_generation_service(servicer: "GenerationServicer", server: grpc.aio.Server,
                           max_message_bytes: int | None = None) -> None:
    """Registers the Generation service like the generated `add_GenerationServicer_to_server`, but with
    request decoders that never raise: a malformed request reaches its handler as a `MalformedRequest`, one
    over `max_message_bytes` as an `OversizedRequest`."""
    handlers = {}
    for method in _SERVICE.methods:
        request_class = getattr(generate_pb2, method.input_type.name)
        response_class = getattr(generate_pb2, method.output_type.name)
        make_handler = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                        else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = make_handler(getattr(servicer, method.name),
                                             request_deserializer=_decoder(request_class, max_message_bytes),
                                             response_serializer=response_class.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _decoder(request_class, max_message_bytes: int | None):
    def decode(data: bytes):
        if max_message_bytes is not None and len(data) > max_message_bytes:
            return OversizedRequest(len(data), max_message_bytes)
        try:
            return request_class.FromString(data)
        except Exception:  # protobuf's DecodeError, or invalid UTF-8 in a string field
            return MalformedRequest()
    return decode


async def _refuse_malformed(request, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, MalformedRequest):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {request.reason}")


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: Tokenizer | None):
        self._tokenizer = tokenizer
        self._engine: Engine | None = None
        self._model: ServedModel | None = None
        self._refusal = "the server is starting: the workers are not ready yet"

    def start_serving(self, engine: Engine, model: ServedModel) -> None:
        self._engine, self._model = engine, model
        self._refusal = ""

    def stop_accepting(self, reason: str) -> None:
        self._refusal = reason

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        engine, model = self._engine, self._model
        await _refuse_malformed(request, context)
        if self._refusal or engine is None or model is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._refusal)
        if len(request.request_id) > _MAX_REQUEST_ID_LENGTH:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: at most {_MAX_REQUEST_ID_LENGTH} characters")
        # A resumed stream was admitted once already (client/stream_resume.py): its scheduler's successor takes it
        # back whatever its queue holds, since a refusal now would fail it mid-stream.
        if (model.max_queued_requests is not None and not request.HasField("resume")
                and engine.num_queued() >= model.max_queued_requests):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{model.max_queued_requests} sequences are already queued; retry later")
        request_id = request.request_id or uuid.uuid4().hex
        if engine.is_in_flight(request_id):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: a request with this id is in flight")
        try:
            adapter = model.loras.selection(request.lora_name)
        except LoraRefused as refusal:
            await context.abort(refusal.code, str(refusal))
        if model.generation_defaults.values:  # --generation-config: unset sampling fields take the defaults
            request.sampling.CopyFrom(model.generation_defaults.apply(request.sampling))
        try:
            # A large prompt's encoding and a constraint's grammar build run on a thread: other streams go on.
            if (prompt_chars(request.text, request.chat) > OFF_LOOP_PROMPT_CHARS
                    or request.sampling.HasField("structured_outputs")):
                validated = await asyncio.to_thread(validate_request, request, self._tokenizer, model.limits)
            else:
                validated = validate_request(request, self._tokenizer, model.limits)
        except (InvalidRequestError, RequestLimitError) as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if adapter is not None:
            validated = dataclasses.replace(validated, lora_name=adapter.name, lora_path=adapter.path,
                                            lora_generation=adapter.generation)
        queue, seed = engine.submit(request_id, validated, request.priority)
        # A resumed stream's client already had the first message: the prompt is not echoed again.
        echo = request.return_prompt and validated.resume is None
        prompt = _PromptEcho(request, validated.prompt_token_ids, self._tokenizer) if echo else None
        first_seed = seed  # reported on the stream's first message, then None
        ended = False
        try:
            await context.send_initial_metadata(ACCEPTED_METADATA)
            while not ended:
                for item in coalesce(take_ready(queue, await queue.get())):
                    if isinstance(item, StreamEnd):
                        ended = True
                    elif isinstance(item, InvalidRequestError):
                        ended = True
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))
                    elif isinstance(item, RequestFailedError):
                        ended = True
                        await context.abort(grpc.StatusCode.INTERNAL, str(item))
                    elif isinstance(item, BaseException):
                        ended = True
                        await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine stopped: {item}")
                    else:
                        response = _response(request_id, item, self._tokenizer)
                        if prompt is not None:
                            prompt.fill_first(response)
                        if first_seed is not None:
                            response.seed, first_seed = first_seed, None
                        yield response
        finally:
            if not ended:  # cancelled, disconnected or past its deadline
                engine.abort(request_id)

    async def Abort(self, request: generate_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        await _refuse_malformed(request, context)
        if self._engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the workers are not ready yet")
        return generate_pb2.AbortResponse(aborted=self._engine.abort(request.request_id, notify=True))

    async def ModelInfo(self, request: generate_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext):
        await _refuse_malformed(request, context)
        model = self._model
        if model is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the workers are not ready yet")
        tokenizer = self._tokenizer
        return generate_pb2.ModelInfoResponse(
            model_name=model.name,
            max_model_len=model.limits.max_model_len,
            vocab_size=model.limits.vocab_size,
            block_size=model.block_size,
            num_kv_blocks=model.num_kv_blocks,
            num_swap_blocks=model.num_swap_blocks,
            eos_token_ids=list(model.eos_token_ids),
            has_tokenizer=tokenizer is not None,
            has_chat_template=tokenizer is not None and tokenizer.has_chat_template,
            default_sampling=model.generation_defaults.as_sampling_params(),
            generation_config=model.generation_defaults.source,
            version=pagedserve_version(),
            batch_invariant=model.batch_invariant,
            quantization=model.quantization,
            kv_cache_dtype=model.kv_cache_dtype,
            lora_adapters=[generate_pb2.LoraAdapterInfo(name=module.name, base_model_name=module.base_model_name or "")
                           for module in model.loras.modules],
        )

    async def LoadLoraAdapter(self, request: generate_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext):
        """vLLM's /v1/load_lora_adapter: the adapter is read and checked here; the workers load it into a GPU slot
        when a request first needs it (the plan's lora_loads)."""
        await _refuse_malformed(request, context)
        model = await self._serving_model(context)
        try:
            model.loras.load(request.lora_name, request.lora_path)
        except LoraRefused as refusal:
            await context.abort(refusal.code, str(refusal))
        return generate_pb2.LoadLoraAdapterResponse()

    async def UnloadLoraAdapter(self, request: generate_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext):
        """vLLM's /v1/unload_lora_adapter: new requests for it get NOT_FOUND, those in flight finish."""
        await _refuse_malformed(request, context)
        model = await self._serving_model(context)
        try:
            model.loras.unload(request.lora_name)
        except LoraRefused as refusal:
            await context.abort(refusal.code, str(refusal))
        return generate_pb2.UnloadLoraAdapterResponse()

    async def _serving_model(self, context: grpc.aio.ServicerContext) -> ServedModel:
        if self._model is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the workers are not ready yet")
        return self._model

    async def Tokenize(self, request: generate_pb2.TokenizeRequest, context: grpc.aio.ServicerContext):
        return await self._tokenizer_call(request, context, tokenize)

    async def Detokenize(self, request: generate_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext):
        return await self._tokenizer_call(request, context, detokenize)

    async def _tokenizer_call(self, request, context: grpc.aio.ServicerContext, handler):
        """Runs a tokenization.py handler once the model's limits are known; its refusals are INVALID_ARGUMENT."""
        await _refuse_malformed(request, context)
        model = self._model
        if model is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the workers are not ready yet")
        try:
            return await handler(request, self._tokenizer, model.limits)
        except (InvalidRequestError, RequestLimitError) as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

    async def GetStats(self, request: generate_pb2.GetStatsRequest, context: grpc.aio.ServicerContext):
        await _refuse_malformed(request, context)
        if self._engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the workers are not ready yet")
        stats = self._engine.stats()
        response = generate_pb2.GetStatsResponse(**stats.__dict__)
        fill_stats_response(response, self._engine.serving_metrics())  # metrics: token totals, latency histograms
        return response


def _response(request_id: str, delta: OutputDelta, tokenizer: Tokenizer | None) -> generate_pb2.GenerateResponse:
    response = generate_pb2.GenerateResponse(
        request_id=request_id,
        text=delta.text,
        token_ids=delta.token_ids,
        finish_reason=_FINISH_REASONS[delta.finish_reason],
        index=delta.index,
        logprobs=delta.logprobs,  # per-token logprobs (OpenAI gateway's logprobs)
        token_logprobs=[_token_logprobs(entry, tokenizer) for entry in delta.token_logprobs],
        prompt_logprobs=[_token_logprobs(entry, tokenizer) for entry in delta.prompt_logprobs],
    )
    if delta.finish_reason is not None:
        response.usage.prompt_tokens = delta.prompt_tokens
        response.usage.completion_tokens = delta.completion_tokens
        response.cumulative_logprob = delta.cumulative_logprob
    return response


class _PromptEcho:
    """return_prompt: the prompt goes out once per sequence, on that sequence's first message.

    The text is the prompt as the model saw it: a text prompt as sent, a chat as its template rendered it (the
    ids decoded with special tokens kept, so exactly the tokens the model read), and empty for token ids.
    """

    def __init__(self, request: generate_pb2.GenerateRequest, token_ids: list[int], tokenizer: Tokenizer | None):
        kind = request.WhichOneof("prompt")
        if kind == "text":
            self._text = request.text
        elif kind == "chat" and tokenizer is not None:
            self._text = tokenizer.decode(token_ids, skip_special_tokens=False)
        else:
            self._text = ""
        self._token_ids = token_ids
        self._sent: set[int] = set()

    def fill_first(self, response: generate_pb2.GenerateResponse) -> None:
        if response.index not in self._sent:
            self._sent.add(response.index)
            response.prompt = self._text
            response.prompt_token_ids.extend(self._token_ids)


def _token_logprobs(entry: TokenLogprob, tokenizer: Tokenizer | None) -> generate_pb2.TokenLogprobs:
    """The public message of one token's logprobs; each token's text is decoded alone, as vLLM does."""

    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else ""

    return generate_pb2.TokenLogprobs(
        token=generate_pb2.Logprob(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank,
                                   decoded_token=text(entry.token_id)),
        # The top list holds every token better than each of its entries: ranks follow from it (ties share one).
        top=[generate_pb2.Logprob(token_id=token_id, logprob=logprob, decoded_token=text(token_id),
                                  rank=1 + sum(other > logprob for _, other in entry.top))
             for token_id, logprob in entry.top],
    )
