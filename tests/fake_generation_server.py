"""An in-process stand-in for the scheduler service, for the SDK's unit tests: the Generation service and
the health service on a loopback port, recording every request and choosing behaviour by prompt text."""

from __future__ import annotations

import asyncio
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.pagedserve.v1 import generate_pb2, generate_pb2_grpc

SERVICE_NAME = "pagedserve.v1.Generation"
NORMAL_CHUNKS = [("Hel", [1]), ("lo", [2]), ("", [3]), (" world", [4, 5])]
MODEL_INFO = generate_pb2.ModelInfoResponse(
    model_name="fake-model", max_model_len=2048, vocab_size=32000, block_size=16, num_kv_blocks=100,
    num_swap_blocks=50, eos_token_ids=[2, 7], has_tokenizer=True, has_chat_template=False, quantization="awq",
    kv_cache_dtype="fp8_e4m3",
)
# Every counter set to its field's position (1, 2, ...), a repeated one to [position, position + 1]; every histogram
# to one observation in its first bucket. A lone scheduler leaves the data-parallel front's fields empty.
DATA_PARALLEL_FIELDS = ("engines", "router_policy")
STATS = generate_pb2.GetStatsResponse(**{
    field.name: (generate_pb2.LatencyHistogram(upper_bounds=[0.5, 1.0], counts=[1, 0, 0], sum=0.25, count=1)
                 if field.message_type is not None
                 else [index + 1, index + 2] if field.is_repeated else index + 1)
    for index, field in enumerate(generate_pb2.GetStatsResponse.DESCRIPTOR.fields)
    if field.name not in DATA_PARALLEL_FIELDS
})

RUNTIME_LORA_OFF = "loading and unloading LoRA adapters at run time needs --allow-runtime-lora-updating"


class FakeGeneration(generate_pb2_grpc.GenerationServicer):
    """Prompt text -> behaviour: "invalid" / "overloaded" / "oversized" / "over the limit" / "unavailable" fail; "unavailable twice" fails
    UNAVAILABLE on its first two attempts, then streams normally; "dies after a chunk" sends one chunk, then
    fails UNAVAILABLE; "endless" streams until cancelled and then sets `cancelled`; "gated" sends one chunk,
    waits for `gate`, then finishes; a chat streams `script` when it is set (one token per piece: the model's
    text, scripted by the test; finishing with "length" if `script_ends_by_length`); anything else streams
    NORMAL_CHUNKS and finishes with "stop". LoadLoraAdapter / UnloadLoraAdapter are refused as without
    --allow-runtime-lora-updating."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests: list[generate_pb2.GenerateRequest] = []
        self.cancelled = threading.Event()
        self.gate = threading.Event()
        self.script: list[str] | None = None
        self.script_ends_by_length = False  # the script's last piece finishes with "length" (max_tokens)
        self.unreachable = False  # every Generate fails UNAVAILABLE at once, as a call to an exited process does

    async def Generate(self, request, context):
        self.requests.append(request)
        if self.unreachable:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        request_id = request.request_id or "fake-1"
        if request.text == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature: must be >= 0, got -0.5")
        if request.text == "overloaded":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests waiting")
        if request.text == "oversized":  # what gRPC answers a message over the server's size limit
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "Received message larger than max (9437184 vs. 8388608)")
        if request.text == "over the limit":  # what the scheduler answers a message over --max-message-bytes
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request: 5,242,880 bytes, over the 4,194,304-byte "
                                "message limit (the scheduler's --max-message-bytes)")
        attempt = sum(getattr(earlier, "text", None) == request.text for earlier in self.requests)
        if request.text == "unavailable" or (request.text == "unavailable twice" and attempt <= 2):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is starting")
        if request.text == "dies after a chunk":
            yield generate_pb2.GenerateResponse(request_id=request_id, text="once", token_ids=[1])
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine stopped: worker rank 0 disconnected")
        if request.text == "endless":
            try:
                for token_id in range(10**9):
                    yield generate_pb2.GenerateResponse(request_id=request_id, text="x", token_ids=[token_id])
                    await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        chunks = NORMAL_CHUNKS
        prompt_only = request.sampling.HasField("max_tokens") and request.sampling.max_tokens == 0
        if prompt_only:  # the scheduler's max_tokens 0: one message, no token, finish reason "length"
            chunks = [("", [])]
        if self.script is not None and request.HasField("chat"):
            chunks = [(piece, [index + 10]) for index, piece in enumerate(self.script)]
        if request.text == "gated":
            yield generate_pb2.GenerateResponse(request_id=request_id, text="first", token_ids=[1])
            await asyncio.to_thread(self.gate.wait, 10)
            chunks = [(" second", [2])]
        for index, (text, token_ids) in enumerate(chunks):
            response = generate_pb2.GenerateResponse(request_id=request_id, text=text, token_ids=token_ids)
            if index == 0 and request.return_prompt:  # the prompt as the model saw it: 7 ids, as usage says
                response.prompt, response.prompt_token_ids[:] = request.text, list(range(7))
            if index == 0 and request.sampling.HasField("prompt_logprobs"):  # ids 1..6: "t<id>", logprob -id
                response.prompt_logprobs.extend(_prompt_logprobs(request.sampling.prompt_logprobs))
            if index == len(chunks) - 1:
                by_length = prompt_only or (self.script_ends_by_length and self.script is not None)
                response.finish_reason = (generate_pb2.FINISH_REASON_LENGTH if by_length
                                          else generate_pb2.FINISH_REASON_STOP)
                response.usage.prompt_tokens = 7
                response.usage.completion_tokens = 0 if prompt_only else 5
            yield response

    async def ModelInfo(self, request, context):
        return MODEL_INFO

    async def GetStats(self, request, context):
        return STATS

    async def Tokenize(self, request, context):
        """Records the request; ids 1..n for a text of n words (or [9] for a chat)."""
        self.requests.append(request)
        ids = list(range(1, len(request.text.split()) + 1)) if request.HasField("text") else [9]
        return generate_pb2.TokenizeResponse(token_ids=ids, max_model_len=MODEL_INFO.max_model_len,
                                             token_strs=[f"t{i}" for i in ids] if request.return_token_strs else [])

    async def Detokenize(self, request, context):
        self.requests.append(request)
        if any(token_id >= MODEL_INFO.vocab_size for token_id in request.token_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token_ids: ids must lie in [0, 32000)")
        return generate_pb2.DetokenizeResponse(text=" ".join(f"t{i}" for i in request.token_ids))

    async def LoadLoraAdapter(self, request, context):
        """Refused as by a scheduler started without --allow-runtime-lora-updating."""
        self.requests.append(request)
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, RUNTIME_LORA_OFF)

    async def UnloadLoraAdapter(self, request, context):
        self.requests.append(request)
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, RUNTIME_LORA_OFF)


def _prompt_logprobs(top: int) -> list[generate_pb2.TokenLogprobs]:
    """Prompt ids 1..6, each decoded "t<id>" with logprob -id and rank id, and `top` alternatives "a0", "a1"..."""
    return [generate_pb2.TokenLogprobs(
        token=generate_pb2.Logprob(token_id=i, logprob=-i, rank=i, decoded_token=f"t{i}"),
        top=[generate_pb2.Logprob(token_id=100 + k, logprob=-0.5 - k, rank=k + 1, decoded_token=f"a{k}")
             for k in range(top)]) for i in range(1, 7)]


class FakeServer:
    """A grpc.aio server on its own event-loop thread, so blocking clients and tests can drive it."""

    def __init__(self, port: int = 0, options: tuple = ()) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.generation = FakeGeneration()
        self.port = self._run(self._start(port, options))
        self.target = f"127.0.0.1:{self.port}"

    def reset(self) -> FakeGeneration:
        self.generation.reset()
        self.set_health(health_pb2.HealthCheckResponse.SERVING)
        return self.generation

    def set_health(self, status) -> None:
        self._run(self._set_health(status))

    def stop(self) -> None:
        self._run(self._server.stop(None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(10)

    async def _start(self, port: int, options: tuple) -> int:
        self._server = grpc.aio.server(options=options)
        self._health = health.aio.HealthServicer()
        generate_pb2_grpc.add_GenerationServicer_to_server(self.generation, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        await self._server.start()
        return port

    async def _set_health(self, status) -> None:
        await self._health.set("", status)
        await self._health.set(SERVICE_NAME, status)
