"""`pagedserve bench serve`: vLLM's online serving benchmark (`vllm bench serve`) against a running server.

It builds the workload first (serve_datasets.py), sends one test request, then sends every request at the
arrival times of arrivals.py (at most --max-concurrency in flight), each through a backend of
request_funcs.py that times the stream as it arrives; serve_metrics.py turns the outcomes into vLLM's
figures and serve_summary.py prints them and writes the JSON record.

Works against any OpenAI-compatible server over HTTP (ours, vLLM, a transformers server) and, with
`--backend grpc`, against ours over gRPC (the host/port are then the gRPC API's, default port 50051).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from client import Client
from client.errors import PagedServeError
from pagedserve.bench.arrivals import send_offsets
from pagedserve.bench.client_processes import send_from_processes
from pagedserve.bench.http_client import JsonHttpClient, JsonHttpError
from pagedserve.bench.prompt_tokenizer import PromptTokens, grpc_prompt_tokens, http_prompt_tokens
from pagedserve.bench.prompt_tokenizer import local_prompt_tokens
from pagedserve.bench.request_funcs import BACKENDS, DEFAULT_ENDPOINTS
from pagedserve.bench.request_outcome import RequestInput, RequestOutcome
from pagedserve.bench.request_sender import auth_headers, make_backend, send_all
from pagedserve.bench.multi_turn import (Conversation, PrefillCounters, add_multi_turn_arguments, grpc_prefill_counters,
                                         metrics_prefill_counters, prefill_record, sample_conversations,
                                         send_conversations)
from pagedserve.bench.serve_datasets import SampleRequest, add_dataset_arguments, sample_requests
from pagedserve.bench.serve_metrics import PERCENTILE_METRICS, calculate_metrics, parse_goodput
from pagedserve.bench.serve_summary import RunSettings, result_record, summary_lines

HELP = "online serving benchmark against a running server (vLLM's `vllm bench serve`)"
DEFAULT_GRPC_PORT = 50051
DEFAULT_HTTP_PORT = 8000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default=None, choices=BACKENDS,
                        help="openai: /v1/completions; openai-chat: /v1/chat/completions; grpc: our gRPC API "
                             "(default: openai-chat if --endpoint is a chat endpoint, else openai)")
    parser.add_argument("--base-url", default=None,
                        help="the server's root URL (http://host:port; for grpc host:port), else --host/--port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=None, help="default 8000 (HTTP), 50051 (grpc)")
    parser.add_argument("--endpoint", default=None, help="API path (default: the backend's)")
    parser.add_argument("--model", default=None, help="the model name sent (default: the server's first model)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name sent in requests when it differs from --model (which names the tokenizer)")
    parser.add_argument("--label", default=None, help="prefix of the result file name (default: the backend)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer to build and count prompts with: a directory or hub id (default: the "
                             "model's if transformers finds it locally, else the server's /tokenize)")
    parser.add_argument("--trust-remote-code", action="store_true", help="for transformers' AutoTokenizer")
    add_dataset_arguments(parser)
    add_multi_turn_arguments(parser)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (a Poisson process with --burstiness 1); inf: all at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="shape of the gamma-distributed gaps between requests: 1 Poisson, <1 burstier")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--num-client-processes", type=int, default=1,
                        help="send the measured run from this many client processes (the same schedule, split "
                             "request by request; each its own connection), so that one client process's CPU "
                             "does not cap a fast server (client_processes.py); not with multi-turn")
    parser.add_argument("--ignore-eos", action="store_true", help="generate max_tokens even past EOS")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default greedy)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrival times")
    parser.add_argument("--save-result", action="store_true", help="write the JSON record")
    parser.add_argument("--result-dir", default=None, help="directory of the JSON record (implies --save-result)")
    parser.add_argument("--result-filename", default=None,
                        help="its file name (default: BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json)")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                        help="comma-separated metrics to report percentiles of: ttft, tpot, itl, e2el")
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                        help="SLOs a request must meet to count in goodput: ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--num-warmups", type=int, default=0,
                        help="requests (copies of the first) sent before the measured run, not counted")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY)")


@dataclass(frozen=True)
class ServeTarget:
    """Where requests go and how they are scored, from the flags that need more than argparse."""

    backend: str
    base_url: str  # http://host:port, or host:port for grpc
    endpoint: str  # "" for grpc
    api_key: str | None
    percentile_metrics: tuple[str, ...]
    percentiles: tuple[float, ...]
    goodput: dict[str, float]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeTarget:
        """Raises ValueError naming the flag."""
        backend = args.backend or ("openai-chat" if args.endpoint and "chat" in args.endpoint else "openai")
        port = args.port or (DEFAULT_GRPC_PORT if backend == "grpc" else DEFAULT_HTTP_PORT)
        if backend == "grpc":
            base_url = (args.base_url or f"{args.host}:{port}").removeprefix("grpc://").removeprefix("http://")
        else:
            base_url = (args.base_url or f"http://{args.host}:{port}").rstrip("/")
        metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
        unknown = [m for m in metrics if m not in PERCENTILE_METRICS]
        if unknown:
            raise ValueError(f"--percentile-metrics: unknown {', '.join(unknown)} "
                             f"(known: {', '.join(PERCENTILE_METRICS)})")
        try:
            percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
        except ValueError:
            raise ValueError(f"--metric-percentiles {args.metric_percentiles!r}: comma-separated numbers") from None
        if not all(0 < p <= 100 for p in percentiles):
            raise ValueError(f"--metric-percentiles {args.metric_percentiles!r}: each must be in (0, 100]")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if args.num_client_processes < 1:
            raise ValueError(f"--num-client-processes must be at least 1, not {args.num_client_processes}")
        if args.num_client_processes > 1 and args.dataset_name == "multi-turn":
            raise ValueError("--num-client-processes: multi-turn conversations are sent from one process")
        if args.max_concurrency is not None and args.max_concurrency < args.num_client_processes:
            raise ValueError(f"--max-concurrency {args.max_concurrency} is below --num-client-processes "
                             f"{args.num_client_processes}: each process needs at least one request in flight")
        if args.request_rate <= 0 or args.burstiness <= 0:
            raise ValueError("--request-rate and --burstiness must be positive")
        return cls(backend=backend, base_url=base_url,
                   endpoint="" if backend == "grpc" else (args.endpoint or DEFAULT_ENDPOINTS[backend]),
                   api_key=args.api_key or os.environ.get("OPENAI_API_KEY"), percentile_metrics=metrics,
                   percentiles=percentiles, goodput=parse_goodput(args.goodput or []))


def run(args: argparse.Namespace) -> int:
    try:
        target = ServeTarget.from_args(args)
    except ValueError as error:
        print(f"pagedserve bench serve: error: {error}", file=sys.stderr)
        return 2
    conversations = None
    try:
        model, tokens = _model_and_tokens(args, target)
        if target.backend == "openai-chat" and tokens.tokenizer is None:
            raise ValueError(f"openai-chat sends text, and {tokens.source}: use --backend openai")
        if args.dataset_name == "multi-turn":
            conversations = sample_conversations(args, tokens)
            requests = [SampleRequest(user, c.user_len, c.output_len) for c in conversations for user in c.user_turns]
        else:
            requests = sample_requests(args, tokens)
    except (ValueError, OSError, JsonHttpError, RuntimeError, PagedServeError) as error:
        print(f"pagedserve bench serve: error: {error}", file=sys.stderr)
        return 1
    print(f"Model: {model}; tokenizer: {tokens.source}; {len(requests)} requests ({args.dataset_name})")
    settings = RunSettings(backend=target.backend, label=args.label or target.backend, model_id=model,
                           tokenizer_id=args.tokenizer or model, num_prompts=len(requests),
                           request_rate=args.request_rate, burstiness=args.burstiness,
                           max_concurrency=args.max_concurrency, percentile_metrics=target.percentile_metrics,
                           goodput=target.goodput)
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    sampling = {name: value for name, value in sampling.items() if value is not None}
    request_model = args.served_model_name or model
    inputs = [RequestInput(request_model, r.prompt, r.prompt_len, r.expected_output_len, args.ignore_eos, sampling)
              for r in requests]
    starts = len(inputs) if conversations is None else len(conversations)  # multi-turn: conversations start
    offsets = send_offsets(starts, args.request_rate, args.burstiness, np.random.default_rng(args.seed))
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    try:
        outcomes, duration, prefill, client_cpu = asyncio.run(_benchmark(args, target, inputs, offsets,
                                                                           conversations))
    except RuntimeError as error:
        print(f"pagedserve bench serve: error: {error}", file=sys.stderr)
        return 1
    metrics = calculate_metrics(outcomes, duration, tokens.tokenizer, target.percentiles, target.goodput)
    failures = [o.error for o in outcomes if not o.success]
    if failures:
        print("Failed requests during benchmark run detected (capping to 10):")
        for index, error in enumerate(failures[:10]):
            print(f"Error {index}: {error}")
    print("\n".join(summary_lines(metrics, settings, duration)))
    print(f"Client CPU over the run: {sum(client_cpu):.2f} s in {len(client_cpu)} process(es), "
          f"{1e3 * sum(client_cpu) / max(metrics.completed, 1):.2f} ms per completed request")
    if args.save_result or args.result_dir or args.result_filename:
        path = _result_path(args, target.backend, model, date)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = result_record(metrics, settings, duration, date, outcomes)
        record.update(num_client_processes=len(client_cpu), client_cpu_s=sum(client_cpu),
                      client_cpu_s_per_process=client_cpu)
        if conversations is not None:
            record["multi_turn"] = {name: getattr(args, f"multi_turn_{name}") for name in
                                    ("num_conversations", "num_turns", "prefix_len", "input_len", "output_len")}
            record["multi_turn"]["max_active_conversations"] = args.max_active_conversations
            record["server_prefill"] = prefill
        path.write_text(json.dumps(record))
        print(f"Result written to {path}")
    return 0


def _model_and_tokens(args, target: ServeTarget) -> tuple[str, PromptTokens]:
    """The model name to send and the tokens to build prompts from (prompt_tokenizer.py's order)."""
    base_url, api_key = target.base_url, target.api_key
    if target.backend == "grpc":
        sync_client = Client(base_url, api_key=api_key)
        info = sync_client.model_info()
        model = args.model or info.model_name
        server_tokens = lambda: grpc_prompt_tokens(sync_client, info)  # noqa: E731
    else:
        headers = auth_headers(api_key)
        model = args.model or _first_served_model(base_url, headers)
        server_tokens = lambda: http_prompt_tokens(base_url, args.served_model_name or model, headers)  # noqa: E731
    if args.tokenizer is not None:
        tokens = local_prompt_tokens(args.tokenizer, args.trust_remote_code, local_files_only=False)
        if tokens is None:
            raise ValueError(f"--tokenizer {args.tokenizer}: transformers cannot load it and it is no model "
                             f"directory with a config.json")
        return model, tokens
    tokens = local_prompt_tokens(model, args.trust_remote_code, local_files_only=True) or server_tokens()
    if tokens is None:
        raise ValueError(f"no tokenizer for {model!r}: transformers has none locally and {base_url}/tokenize "
                         f"does not answer; pass --tokenizer")
    return model, tokens


def _first_served_model(base_url: str, headers: dict[str, str]) -> str:
    http = JsonHttpClient(base_url, headers, timeout=30.0)
    try:
        models = http.get("/v1/models").get("data") or []
    finally:
        http.close()
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def _benchmark(args, target: ServeTarget, inputs: list[RequestInput], offsets: list[float],
                     conversations: list[Conversation] | None
                     ) -> tuple[list[RequestOutcome], float, dict | None, list[float]]:
    """The test request, the warm-ups and the measured run: `inputs` at `offsets`, or the `conversations`
    (their first turns' user messages alone are the test and warm-up prompts: no conversation's prefix gets
    cached before it starts). With conversations, also the server's prefill counts over the run. Last, the CPU
    seconds each client process spent in the measured run (every thread, gRPC's included)."""
    backend_spec = {"backend": target.backend, "base_url": target.base_url, "endpoint": target.endpoint,
                    "api_key": target.api_key}
    backend = make_backend(backend_spec, args.max_concurrency)
    try:
        print("Starting initial single prompt test run...")
        test = await backend(inputs[0])
        if not test.success:
            raise RuntimeError(f"Initial test run failed - check the benchmark arguments. Error: {test.error}")
        print("Initial test run completed.")
        if args.num_warmups > 0:
            print(f"Warming up with {args.num_warmups} requests...")
            await send_all(backend, [inputs[0]] * args.num_warmups, [0.0] * args.num_warmups,
                            args.max_concurrency, disable_tqdm=True)
            print("Warmup run completed.")
        print("Starting main benchmark run...")
        distribution = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {args.request_rate}")
        print(f"Burstiness factor: {args.burstiness} ({distribution})")
        print(f"Maximum request concurrency: {args.max_concurrency}")
        if conversations is None and args.num_client_processes > 1:
            print(f"Client processes: {args.num_client_processes}")
            outcomes, duration, client_cpu = await asyncio.to_thread(
                send_from_processes, backend_spec, inputs, offsets, args.max_concurrency, args.num_client_processes)
            return outcomes, duration, None, client_cpu
        cpu_before = time.process_time()
        if conversations is None:
            outcomes, duration = await send_all(backend, inputs, offsets, args.max_concurrency, args.disable_tqdm)
            return outcomes, duration, None, [time.process_time() - cpu_before]
        print(f"Conversations: {len(conversations)}, at most {args.max_active_conversations or 'all'} at once")
        before = await asyncio.to_thread(_prefill_counters, target)
        outcomes, duration = await send_conversations(backend, conversations, inputs[0],
                                                      args.max_active_conversations, offsets)
        client_cpu = [time.process_time() - cpu_before]
        return (outcomes, duration, prefill_record(before, await asyncio.to_thread(_prefill_counters, target)),
                client_cpu)
    finally:
        await backend.close()


def _prefill_counters(target: ServeTarget) -> dict[str, PrefillCounters]:
    """The server's prompt and prefix-cache counters per engine: GetStats over gRPC, else its /metrics."""
    if target.backend == "grpc":
        with Client(target.base_url, api_key=target.api_key) as client:
            return grpc_prefill_counters(client)
    with urllib.request.urlopen(urllib.request.Request(target.base_url + "/metrics", headers=auth_headers(target.api_key)),
                                timeout=30) as response:
        return metrics_prefill_counters(response.read().decode())


def _result_path(args, backend: str, model: str, date: str) -> Path:
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    base_model = model.rstrip("/").split("/")[-1]
    name = args.result_filename or f"{args.label or backend}-{rate}qps{concurrency}-{base_model}-{date}.json"
    return Path(args.result_dir or ".") / name
