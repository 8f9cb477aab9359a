"""LLM: offline batch inference with vLLM's surface, over a private `pagedserve serve` it starts and stops.

    from pagedserve import LLM, SamplingParams

    with LLM(model="path/to/model", max_model_len=2048, seed=0) as llm:
        results = llm.generate(["Hello, my name is", {"prompt_token_ids": [1, 2, 3]}],
                               SamplingParams(temperature=0.0, max_tokens=32))
        for result in results:                       # in prompt order, as vLLM's RequestOutput
            print(result.prompt, result.prompt_token_ids, result.outputs[0].text, result.metrics)

The server runs exactly the code that serves online (private_server.py says why a process). Ownership: an
LLM owns its server process and one blocking Client to it; each `generate` / `chat` / `beam_search` call runs
its requests on a private asyncio loop (one AsyncClient per call) so that every prompt is in flight at once.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from client.async_client import AsyncClient
from client.sampling_params import SamplingParams
from client.sync_client import Client
from client.types import GenerationResult
from pagedserve.beam_search import BeamSearchOutput, BeamSearchParams
from pagedserve.lora_request import LoRARequest, lora_module_flags, lora_names
from pagedserve.offline_progress import ThroughputBar
from pagedserve.offline_prompts import Conversation, Prompt, conversation_list, prompt_list, prompt_of
from pagedserve.private_server import PrivateServer, server_argv


class LLM:
    """Starts `pagedserve serve --model MODEL` with the given server options, as keywords named like its
    flags (`max_model_len=2048` is `--max-model-len 2048`, `tensor_parallel_size=2` is `-tp 2`, `seed=0` is
    `--seed 0`; `enable_prefix_caching=False` turns it off); `model=None` serves the embedded
    SmolLM2-135M-Instruct. Raises RuntimeError with the server's log if it exits or is not ready within
    `ready_timeout` seconds. LoRA: `enable_lora=True, lora_modules={name: path}` (or a list of "name=path",
    vLLM's JSON dicts or LoRARequests) serves those adapters; `generate(..., lora_request=LoRARequest(name, id,
    path))` selects one (lora_request.py)."""

    def __init__(self, model: str | None = None, *, ready_timeout: float = 600.0, **server_options: Any) -> None:
        self._lora_paths: dict[str, str] = {}
        if server_options.get("lora_modules"):
            server_options["lora_modules"] = lora_module_flags(server_options["lora_modules"])
            from service_runtime.lora_modules import lora_module

            self._lora_paths = {m.name: m.path for m in map(lora_module, server_options["lora_modules"])}
        self._server = PrivateServer(server_argv(model, server_options), server_options.get("api_key"))
        self.target = self._server.target
        self.log_path = self._server.log_path
        self._tokenizer_source = server_options.get("tokenizer") or model
        self._tokenizer = None
        # The server's own key and certificate (a self-signed one is its own root) let this object's clients in.
        self._access = dict(api_key=server_options.get("api_key"),
                            root_certificates=server_options.get("tls_cert_file"))
        self._client = Client(self.target, **self._access)
        try:
            self._server.wait_ready(self._client, ready_timeout)
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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[GenerationResult]:
        """Generates for every prompt at once (one prompt or a list of them, each in one of vLLM's forms: text,
        token ids, {"prompt": text} or {"prompt_token_ids": ids}); returns one result per prompt, in prompt
        order, with vLLM's RequestOutput fields (request_id, prompt, prompt_token_ids, outputs, finished,
        metrics). `sampling_params`: one for all, or one per prompt; None takes the server's defaults (the
        model's generation config, else vLLM's). A prompt dict with any other key (multi_modal_data, ...)
        raises ValueError naming it; a failed request raises the SDK's typed error. `lora_request`: the LoRA
        adapter of every prompt, or one per prompt (None: the base model), among those the LLM serves."""
        prompts = prompt_list(prompts)
        adapters = lora_names(lora_request, len(prompts), self._lora_paths)
        requests = [dict(prompt=prompt_of(prompt), lora_name=adapter) for prompt, adapter in zip(prompts, adapters)]
        return self._run_all(requests, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[GenerationResult]:
        """Like `generate`, for conversations (lists of {"role", "content"} messages, or one conversation)
        rendered by the model's chat template on the server; each result's `prompt` is the rendered text.
        The chat options are vLLM's `LLM.chat`'s (transformers' apply_chat_template's): `tools` are OpenAI's
        tool definitions, which the template lists; the output is not parsed for tool calls (as vLLM's)."""
        options = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       tools=tools, chat_template_kwargs=chat_template_kwargs)
        requests = [dict(messages=conversation, **options) for conversation in conversation_list(messages)]
        return self._run_all(requests, sampling_params, use_tqdm)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, *, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the best `params.beam_width` beams of each prompt, best first, each
        holding the prompt followed by its continuation (beam_search.py says how beams are scored)."""
        keywords = params.keywords()
        requests = [dict(prompt=prompt_of(prompt), **keywords) for prompt in prompt_list(prompts)]
        results = self._run_all(requests, None, use_tqdm)
        return [BeamSearchOutput.from_result(result) for result in results]

    def get_tokenizer(self):
        """The served model's tokenizer as transformers loads it (vLLM returns the same kind of object):
        `encode`, `decode`, `apply_chat_template`, `eos_token_id`, ... Loaded on first use (it imports
        transformers); the server tokenizes with its own torch-free copy, tested id for id against it."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from service_runtime.model_source import resolve_model

            path = resolve_model(self._tokenizer_source).path
            if os.path.isfile(path):  # a .gguf file: transformers reads the tokenizer from its metadata
                self._tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
            else:
                self._tokenizer = AutoTokenizer.from_pretrained(path)
        return self._tokenizer

    def shutdown(self) -> None:
        """Stops the server (SIGTERM, then kill after 30 s); later calls fail. Idempotent."""
        if hasattr(self, "_client"):
            self._client.close()
        self._server.stop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _log_tail(self) -> str:
        return self._server.log_tail()

    def _run_all(self, requests: list[dict], sampling_params, use_tqdm: bool) -> list[GenerationResult]:
        if not self._server.alive:
            raise RuntimeError("this LLM was shut down")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(requests)
        elif len(sampling_params) != len(requests):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(requests)} prompts")
        keyword_sets = [{**request, **params.keywords(), "return_prompt": True}
                        for request, params in zip(requests, sampling_params)]
        return _run_coroutine(self._generate_all(keyword_sets, use_tqdm))

    async def _generate_all(self, keyword_sets: list[dict], use_tqdm: bool) -> list[GenerationResult]:
        progress = ThroughputBar(len(keyword_sets), use_tqdm)
        async with AsyncClient(self.target, **self._access) as client:

            async def one(keywords: dict) -> GenerationResult:
                result = await client.generate(**keywords)
                progress.finished(result)
                return result

            try:
                return await asyncio.gather(*(one(keywords) for keywords in keyword_sets))
            finally:
                progress.close()


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
