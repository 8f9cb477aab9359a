"""LLM: offline batch inference with vLLM's surface, over a private `pagedserve serve` it starts and stops.

    from pagedserve import LLM, SamplingParams

    with LLM(model="path/to/model", max_model_len=2048) as llm:
        results = llm.generate(["Hello, my name is", "The capital of France is"],
                               SamplingParams(temperature=0.0, max_tokens=32))
        for result in results:                       # in prompt order
            print(result.outputs[0].text)

Why a server process and not the engine in-process: the engine is the scheduler and worker processes
(the scheduler never imports torch; the worker owns the device), so the offline path runs exactly the code
that serves online, and batches every prompt the same way (continuous batching over all of them at once).
The server listens on a free loopback port with no HTTP gateway; it dies with this object (or the
interpreter) at the latest.

Ownership: an LLM owns its server process and one blocking Client to it; each `generate` / `chat` call runs
its requests on a private asyncio loop (one AsyncClient per call) so that every prompt is in flight at once.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from client.async_client import AsyncClient
from client.sampling_params import SamplingParams
from client.sync_client import Client
from client.types import GenerationResult
from pagedserve.free_port import free_port

# vLLM's prompt forms: text, token ids, {"prompt": text} (TextPrompt) or {"prompt_token_ids": ids} (TokensPrompt).
Prompt = str | Sequence[int] | Mapping[str, Any]
Conversation = Sequence[Mapping[str, str]]
_READY_POLL_S = 1.0
_STOP_TIMEOUT_S = 30.0


class LLM:
    """Starts `pagedserve serve --model MODEL` with the given server options, as keywords named like its
    flags (`max_model_len=2048` is `--max-model-len 2048`; `enable_prefix_caching=False` is
    `--no-prefix-caching`); `model=None` serves the embedded SmolLM2-135M-Instruct. Raises RuntimeError
    with the server's log if it exits or is not ready within `ready_timeout` seconds."""

    def __init__(self, model: str | None = None, *, ready_timeout: float = 600.0, **server_options: Any) -> None:
        argv = server_argv(model, server_options)
        self._log = tempfile.NamedTemporaryFile(prefix="pagedserve-llm-", suffix=".log", delete=False)
        self.log_path = self._log.name
        port = free_port()
        self.target = f"127.0.0.1:{port}"
        self._process = subprocess.Popen(
            [sys.executable, "-m", "pagedserve", "serve", "--host", "127.0.0.1", "--port", str(port), "--no-http",
             *argv],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        self._finalizer = weakref.finalize(self, _stop_server, self._process, self._log, self.log_path)
        # The server's own key and certificate (a self-signed one is its own root) let this object's clients in.
        self._access = dict(api_key=server_options.get("api_key"),
                            root_certificates=server_options.get("tls_cert_file"))
        self._client = Client(self.target, **self._access)
        try:
            self._wait_ready(ready_timeout)
            self.model_info = self._client.model_info()
        except BaseException:
            self.shutdown()
            raise

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[GenerationResult]:
        """Generates for every prompt at once (one prompt or a list of them, each in one of vLLM's forms: text,
        token ids, {"prompt": text} or {"prompt_token_ids": ids}); returns one GenerationResult per prompt, in
        prompt order. `sampling_params`: one for all, or one per prompt; None takes the server's defaults. A
        prompt dict with any other key (multi_modal_data, ...) raises ValueError naming it; a failed request
        raises the SDK's typed error."""
        if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, Sequence) and prompts
                                                   and isinstance(prompts[0], int)):
            prompts = [prompts]
        requests = [dict(prompt=prompt_of(prompt)) for prompt in prompts]
        return self._run_all(requests, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[GenerationResult]:
        """Like `generate`, for conversations (lists of {"role", "content"} messages, or one conversation)
        rendered by the model's chat template on the server."""
        if messages and isinstance(messages[0], Mapping):
            messages = [messages]
        requests = [dict(messages=conversation) for conversation in messages]
        return self._run_all(requests, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        """Stops the server (SIGTERM, then kill after 30 s); later calls fail. Idempotent."""
        if hasattr(self, "_client"):
            self._client.close()
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _run_all(self, requests: list[dict], sampling_params, use_tqdm: bool) -> list[GenerationResult]:
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was shut down")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(requests)
        elif len(sampling_params) != len(requests):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(requests)} prompts")
        keyword_sets = [{**request, **params.keywords()} for request, params in zip(requests, sampling_params)]
        return _run_coroutine(self._generate_all(keyword_sets, use_tqdm))

    async def _generate_all(self, keyword_sets: list[dict], use_tqdm: bool) -> list[GenerationResult]:
        from tqdm.auto import tqdm

        progress = tqdm(total=len(keyword_sets), desc="Generating", unit="prompt", disable=not use_tqdm)
        async with AsyncClient(self.target, **self._access) as client:

            async def one(keywords: dict) -> GenerationResult:
                result = await client.generate(**keywords)
                progress.update(1)
                return result

            try:
                return await asyncio.gather(*(one(keywords) for keywords in keyword_sets))
            finally:
                progress.close()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"pagedserve serve exited with code {self._process.returncode}:\n{self._log_tail()}")
            try:
                self._client.wait_ready(timeout=min(_READY_POLL_S, max(deadline - time.monotonic(), 0.01)))
                return
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"pagedserve serve was not ready in {timeout:g} s:\n{self._log_tail()}") from None

    def _log_tail(self) -> str:
        with open(self.log_path, errors="replace") as log:
            return log.read()[-4000:]


def prompt_of(prompt: Prompt) -> str | list[int]:
    """The text or token ids of one prompt in any of vLLM's forms; ValueError naming what is not supported."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        unsupported = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
        if unsupported:
            raise ValueError(f"prompt keys {unsupported} are not supported (a prompt dict holds 'prompt' or "
                             "'prompt_token_ids')")
        if len(prompt) != 1:
            raise ValueError("a prompt dict holds exactly one of 'prompt' (text) and 'prompt_token_ids'")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError("'prompt' in a prompt dict is text; token ids go in 'prompt_token_ids'")
            return prompt["prompt"]
        return prompt_of(list(prompt["prompt_token_ids"]))
    if isinstance(prompt, Sequence) and all(isinstance(token, int) for token in prompt):
        return list(prompt)
    raise ValueError(f"a prompt is text, token ids or a prompt dict, not {type(prompt).__name__}")


def server_argv(model: str | None, options: Mapping[str, Any]) -> list[str]:
    """`pagedserve serve` flags for LLM's keywords, checked against the real parser (so a misspelt or
    unknown option fails here, naming the known ones, rather than in the child)."""
    from pagedserve.cli import build_parser

    serve = _serve_parser(build_parser())
    actions = {action.dest: action for action in serve._actions if action.option_strings}
    reserved = {"host", "port", "http_port", "enable_http", "help"}
    argv = [] if model is None else ["--model", str(model)]
    for name, value in options.items():
        action = actions.get(name)
        if action is None or name in reserved:
            known = ", ".join(sorted(set(actions) - reserved - {"model"}))
            raise TypeError(f"unknown server option {name!r}; known: {known}")
        flag = action.option_strings[0]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if bool(value) != action.default:  # the flag flips the default; the default needs no flag
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["serve"]
    raise RuntimeError("pagedserve's parser has no serve command")


def _run_coroutine(coroutine):
    """Runs on a private loop: here if this thread has none running, else (a notebook) on a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = asyncio.run(coroutine)
        except BaseException as error:  # re-raised in the caller's thread
            outcome["error"] = error

    helper = threading.Thread(target=run, name="pagedserve-llm")
    helper.start()
    helper.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _stop_server(process: subprocess.Popen, log, log_path: str) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    log.close()
    if process.returncode == 0:
        os.unlink(log_path)  # kept when the server failed, for the post-mortem
