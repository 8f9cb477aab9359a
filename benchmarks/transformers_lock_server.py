"""The tutorial's baseline server: Hugging Face transformers `generate` behind one lock, over OpenAI's HTTP API.

The documents this project starts from serve a model with FastAPI around `model.generate`, and guard it with a
lock so that one request runs at a time (a second one waits for the first to finish). This is that server, as
the tutorial's experiment (benchmarks/vs_transformers_server.py) runs it against pagedserve on the same model:

    python benchmarks/transformers_lock_server.py [--model PATH] [--tokenizer PATH] [--device cuda]
        [--dtype bfloat16] [--load-format dummy] [--port 8100] [--served-model-name NAME]

It serves /v1/completions and /v1/chat/completions (streamed as server-sent events one token per chunk, or
whole), /v1/models, /health, and vLLM's /tokenize and /detokenize, with temperature, top_p, top_k, seed, max_tokens, ignore_eos, n=1 and
stream_options.include_usage. `--model` takes what `pagedserve serve` takes (a model directory, a .gguf file,
or none for the embedded SmolLM2); `--load-format dummy` builds random weights from the directory's
config.json. A field it does not know or cannot honour is a 400 in OpenAI's error shape naming the field.

Why a lock and a thread: `generate` blocks, so it runs in a worker thread (the event loop keeps accepting
connections, as the tutorial's does), and the lock makes the requests take turns. The lock is held for the whole
generation, seeding included, so a request's seed gives the same tokens whoever else is waiting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, StoppingCriteria  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from service_runtime.model_source import resolve_model  # noqa: E402

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}


@dataclass(frozen=True)
class LockServerConfig:
    """The server's whole configuration, parsed once from the command line."""

    model: str | None  # what `pagedserve serve --model` takes; None: the embedded default
    tokenizer: str | None  # a tokenizer directory or .gguf file other than the model's (vLLM's --tokenizer)
    load_format: str  # "auto": the files' weights; "dummy": random weights of config.json's shape
    device: str
    dtype: str  # a key of DTYPES
    host: str
    port: int
    served_model_name: str | None  # None: the resolved model's name


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field this server ignores would silently change the answer

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM's: 0 or -1 is no top-k
    seed: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    user: str | None = None


class CompletionBody(_Body):
    prompt: str
    max_tokens: int | None = Field(default=16, ge=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class _TokenQueue(BaseStreamer):
    """Receives `generate`'s tokens one step at a time (the first `put` is the prompt) and hands each to the event
    loop's queue; `end` puts None. Why not TextIteratorStreamer: it holds text back to word boundaries, so one
    chunk would not be one token, and the clients measure inter-token latency per chunk."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self._loop, self._queue, self._prompt_seen = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for token_id in value.reshape(-1).tolist():
            self._loop.call_soon_threadsafe(self._queue.put_nowait, token_id)

    def end(self) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, None)


class _Cancelled(StoppingCriteria):
    """Stops a generation whose client went away, so that the lock passes to the next request."""

    def __init__(self, event: threading.Event):
        self._event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self._event.is_set(), dtype=torch.bool, device=input_ids.device)


class LockedGenerator:
    """The model, its tokenizer and the one lock every generation holds. Owned by the app; `generate` runs in a
    worker thread and is the only place the model is called."""

    def __init__(self, config: LockServerConfig):
        resolved = resolve_model(config.model)
        self.name = config.served_model_name or resolved.name
        tokenizer_path = resolve_model(config.tokenizer).path if config.tokenizer else resolved.path
        self.tokenizer, self.model = _load(resolved.path, tokenizer_path, config)
        self.max_model_len = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self.lock = threading.Lock()

    def generate(self, prompt_ids: list[int], body: _Body, max_tokens: int, streamer: BaseStreamer | None,
                 cancelled: threading.Event) -> list[int]:
        sampling: dict[str, Any] = {"do_sample": False}
        if body.temperature > 0:
            sampling = {"do_sample": True, "temperature": body.temperature, "top_p": body.top_p,
                        "top_k": max(body.top_k, 0)}  # 0: no top-k (not the config's 50)
        if body.ignore_eos:
            sampling["min_new_tokens"] = max_tokens  # EOS is masked until max_tokens: vLLM's ignore_eos
        input_ids = torch.tensor([prompt_ids], device=self.model.device)
        with self.lock, torch.inference_mode():
            if body.seed is not None:
                torch.manual_seed(body.seed)
            output = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id, streamer=streamer,
                stopping_criteria=[_Cancelled(cancelled)], **sampling)
        return output[0, len(prompt_ids):].tolist()


def _split_gguf(path: str) -> tuple[str, str | None]:
    """(directory, gguf file name) of a .gguf file, as transformers takes it; (path, None) for a directory."""
    return (os.path.dirname(path), os.path.basename(path)) if os.path.isfile(path) else (path, None)


def _load(path: str, tokenizer_path: str, config: LockServerConfig):
    tokenizer_directory, tokenizer_gguf = _split_gguf(tokenizer_path)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_directory, gguf_file=tokenizer_gguf)
    directory, gguf_file = _split_gguf(path)
    dtype = DTYPES[config.dtype]
    if config.load_format == "dummy":
        with torch.device(config.device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=dtype).to(config.device)
    return tokenizer, model.eval()


def _error(message: str, param: str | None, status: int = 400) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": "BadRequestError", "param": param, "code": status}})


def build_app(generator: LockedGenerator) -> FastAPI:
    app = FastAPI(title="transformers behind a lock")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"] if part != "body") or None
        return _error(f"{param}: {first['msg']}", param)

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": generator.name, "object": "model", "owned_by": "transformers",
                                            "max_model_len": generator.max_model_len}]}

    @app.post("/tokenize")  # vLLM's routes: benchmark clients build prompts of exact lengths with them
    async def tokenize(body: TokenizeBody) -> dict:
        ids = generator.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
        return {"tokens": ids, "count": len(ids), "max_model_len": generator.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> dict:
        return {"prompt": generator.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        ids = generator.tokenizer(body.prompt)["input_ids"]
        return await _respond(generator, body, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):
        messages = [message.model_dump() for message in body.messages]
        try:
            text = generator.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except ValueError as error:  # the tokenizer has no chat template
            return _error(str(error), "messages")
        ids = generator.tokenizer(text, add_special_tokens=False)["input_ids"]
        return await _respond(generator, body, ids, body.max_completion_tokens or body.max_tokens, chat=True)

    return app


async def _respond(generator: LockedGenerator, body: _Body, prompt_ids: list[int], max_tokens: int | None,
                   chat: bool):
    if body.model is not None and body.model != generator.name:
        return _error(f"model {body.model!r} is not served here (it serves {generator.name!r})", "model", 404)
    room = generator.max_model_len - len(prompt_ids)
    max_tokens = max_tokens or room
    if max_tokens > room:
        return _error(f"max_tokens: {max_tokens} + {len(prompt_ids)} prompt tokens exceed the model's "
                      f"{generator.max_model_len}", "max_tokens")
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    cancelled = threading.Event()
    if not body.stream:
        try:
            output = await asyncio.to_thread(generator.generate, prompt_ids, body, max_tokens, None, cancelled)
        finally:
            cancelled.set()
        text = generator.tokenizer.decode(output, skip_special_tokens=True)
        finish = "length" if len(output) >= max_tokens else "stop"
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                  if chat else {"index": 0, "text": text, "finish_reason": finish})
        return {"id": response_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": generator.name, "choices": [choice],
                "usage": _usage(len(prompt_ids), len(output))}
    return StreamingResponse(_events(generator, body, prompt_ids, max_tokens, chat, response_id, cancelled),
                             media_type="text/event-stream")


async def _events(generator: LockedGenerator, body: _Body, prompt_ids: list[int], max_tokens: int, chat: bool,
                  response_id: str, cancelled: threading.Event):
    """One SSE chunk per generated token (text decoded from all output ids so far, less what was sent; a tail
    ending in U+FFFD waits for the rest of its character), then a chunk with finish_reason, the usage chunk if
    asked, and [DONE]. Closing the stream early sets `cancelled`, which ends the generation."""
    queue: asyncio.Queue = asyncio.Queue()
    streamer = _TokenQueue(asyncio.get_running_loop(), queue)
    worker = asyncio.ensure_future(
        asyncio.to_thread(generator.generate, prompt_ids, body, max_tokens, streamer, cancelled))
    head = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": generator.name}

    def chunk(text: str | None, finish: str | None) -> str:
        if chat:
            choice = {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish}
        return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

    output: list[int] = []
    sent = ""
    try:
        if chat:
            yield f"data: {json.dumps({**head, 'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
        while (token_id := await queue.get()) is not None:
            output.append(token_id)
            text = generator.tokenizer.decode(output, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue
            yield chunk(text[len(sent):], None)
            sent = text
        await worker  # raises what generate raised
        yield chunk(None, "length" if len(output) >= max_tokens else "stop")
        if (body.stream_options or {}).get("include_usage"):
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(len(prompt_ids), len(output))})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        cancelled.set()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def parse_config(argv: list[str] | None = None) -> LockServerConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory or .gguf file (default: the model's)")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                        help="dummy: random weights of the directory's config.json")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=(*DTYPES, "auto"), default="auto",
                        help="auto: bfloat16 on a GPU, float32 on the CPU (as pagedserve serve)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--served-model-name", default=None)
    args = parser.parse_args(argv)
    dtype = args.dtype if args.dtype != "auto" else ("float32" if args.device == "cpu" else "bfloat16")
    return LockServerConfig(model=args.model, tokenizer=args.tokenizer, load_format=args.load_format,
                            device=args.device, dtype=dtype, host=args.host, port=args.port,
                            served_model_name=args.served_model_name)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    config = parse_config(argv)
    app = build_app(LockedGenerator(config))
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
