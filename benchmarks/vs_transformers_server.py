"""The tutorial's experiment, one command: transformers behind a lock against pagedserve, on the same model.

    python benchmarks/vs_transformers_server.py                       # CPU, the embedded SmolLM2-135M
    python benchmarks/vs_transformers_server.py --shape qwen2.5-1.5b  # GPU, random weights of that shape

For each server in turn, (a) benchmarks/transformers_lock_server.py and (b) `pagedserve serve` (same model,
device and dtype), it starts the server, waits until it answers, and measures:
  (i)   output speed against output length: chat requests of --output-lens tokens (EOS ignored) from 1 and from
        3 client threads started together; output tokens/s = all the threads' completion tokens over the wall
        time from the first send to the last answer;
  (ii)  the same question from 3 threads at once, --rounds times, with the tutorial's sampling (temperature
        0.01, top_p 1, top_k 1, seed 42, max_tokens --answer-max-tokens), and as a control from 1 thread
        --rounds times: how many distinct answers each server gave;
  (iii) `pagedserve bench serve` (random prompts, EOS ignored) at each of --request-rates, where this checkout
        has that command (else one printed line says it was skipped).
It writes vs_transformers_server.json (every figure, the answers, the bench JSONs' summaries) and
vs_transformers_server.png (output tok/s against output length, one line per server and thread count) into
--result-dir (default $OUT, else the current directory).

Why one server at a time: on a GPU pagedserve's KV pool takes --gpu-memory-utilization of the card, and on a
CPU the two would share the cores; each server gets the whole machine while it is measured. Why the standard
library's HTTP client: it is on every machine (the GPU machine has no openai package), and the tutorial's
client threads were plain blocking HTTP calls too.

With --shape both servers load random weights of a benchmarks/model_shapes.py shape (--load-format dummy)
and a word tokenizer of the shape's vocabulary (benchmarks/id_word_tokenizer.py), given as --tokenizer.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's packages, wherever it runs from

from benchmarks.id_word_tokenizer import write_id_word_tokenizer  # noqa: E402
from benchmarks.model_shapes import SHAPES, write_config_dir  # noqa: E402
from pagedserve.free_port import free_port  # noqa: E402
from pagedserve.health_probe import http_ok  # noqa: E402
from pagedserve.testing.server_harness import launched_server  # noqa: E402
from service_runtime.model_source import resolve_model  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent  # `python -m pagedserve bench` runs this checkout's code
SERVERS = ("transformers_lock", "pagedserve")
QUESTION = "Explain in detail how a large language model generates text, one token at a time."
# The tutorial's sampling parameters for the same-question test.
TUTORIAL_SAMPLING = {"temperature": 0.01, "top_p": 1.0, "top_k": 1, "seed": 42}
CPU_DEFAULTS = {"output_lens": "16,32,64", "rounds": 3, "answer_max_tokens": 64, "request_rates": "1,inf",
                "bench_num_prompts": 8, "bench_input_len": 32, "bench_output_len": 32}
# A CPU KV cache of 0.5 GiB holds 11,000 tokens of SmolLM2-135M: plenty for 3 threads, small beside the lock
# server's memory on a shared machine.
CPU_ENGINE_FLAGS = "--cpu-kv-cache-space 0.5 --swap-space 0.1"
GPU_DEFAULTS = {"output_lens": "16,32,64,128,256,512,1024", "rounds": 20, "answer_max_tokens": 128,
                "request_rates": "1,inf", "bench_num_prompts": 16, "bench_input_len": 512, "bench_output_len": 256}


def post_json(base_url: str, path: str, body: dict, timeout: float) -> dict:
    url = urllib.parse.urlsplit(base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    if response.status != 200:
        raise RuntimeError(f"POST {path} -> {response.status}: {data[:500]!r}")
    return json.loads(data)


def chat(base_url: str, model: str, max_tokens: int, timeout: float, **sampling) -> tuple[str, int]:
    """One non-streamed chat request with QUESTION: (answer text, completion tokens)."""
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens,
            **sampling}
    reply = post_json(base_url, "/v1/chat/completions", body, timeout)
    return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]


def together(num_threads: int, call) -> tuple[list, float]:
    """Runs `call(thread_index)` on `num_threads` threads released at once; (results, wall seconds)."""
    barrier = threading.Barrier(num_threads + 1)
    results: list = [None] * num_threads

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = call(index)
        except Exception as error:  # reported in the results, and raised below
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results, elapsed


def sweep_output_lengths(base_url: str, model: str, output_lens: list[int], thread_counts: list[int],
                         timeout: float) -> list[dict]:
    """(i): for each output length and thread count, every thread sends one greedy request, EOS ignored."""
    rows = []
    for output_len in output_lens:
        for threads in thread_counts:
            def one(_: int) -> tuple[int, float]:
                start = time.perf_counter()
                _, tokens = chat(base_url, model, output_len, timeout, temperature=0.0, ignore_eos=True)
                return tokens, time.perf_counter() - start

            results, elapsed = together(threads, one)
            tokens = sum(t for t, _ in results)
            rows.append({"output_len": output_len, "threads": threads, "output_tokens": tokens,
                         "duration_s": elapsed, "output_tokens_per_s": tokens / elapsed,
                         "request_latencies_s": [s for _, s in results]})
            print(f"  {output_len:5d} tokens x {threads} threads: {tokens / elapsed:8.1f} output tok/s", flush=True)
    return rows


def same_question(base_url: str, model: str, rounds: int, threads: int, max_tokens: int, timeout: float) -> dict:
    """(ii): the same question with the tutorial's sampling from `threads` threads at once, `rounds` times, and
    from one thread `rounds` times (the control). Answers are kept once each, with how often each came back."""
    def ask(_: int) -> str:
        return chat(base_url, model, max_tokens, timeout, **TUTORIAL_SAMPLING)[0]

    concurrent = [together(threads, ask)[0] for _ in range(rounds)]
    single = [ask(0) for _ in range(rounds)]
    answers = sorted(set(a for row in concurrent for a in row) | set(single))
    index = {answer: i for i, answer in enumerate(answers)}
    return {
        "rounds": rounds, "threads": threads, "max_tokens": max_tokens, "sampling": TUTORIAL_SAMPLING,
        "distinct_answers_concurrent": len({a for row in concurrent for a in row}),
        "distinct_answers_per_round": [len(set(row)) for row in concurrent],
        "distinct_answers_single_thread": len(set(single)),
        "concurrent_answer_ids": [[index[a] for a in row] for row in concurrent],
        "single_thread_answer_ids": [index[a] for a in single],
        "answers": answers,
    }


BENCH_SUMMARY_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput",
                      "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
                      "mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms",
                      "mean_e2el_ms", "p99_e2el_ms", "request_goodput")
# Issue 19's SLO: a request is "good" when its TTFT is under 500 ms and its TPOT under 50 ms.
GOODPUT_SLO = ("ttft:500", "tpot:50")


def bench_serve_help() -> str | None:
    """`pagedserve bench serve --help` as this checkout runs it; None where it has no `bench` command."""
    done = subprocess.run([sys.executable, "-m", "pagedserve", "bench", "serve", "--help"],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    return done.stdout if done.returncode == 0 else None


def bench_serve(base_url: str, model: str, tokenizer: str, server: str, args, result_dir: Path,
                help_text: str) -> list[dict]:
    """(iii): `pagedserve bench serve` at each request rate, as a subprocess; its JSON summaries."""
    runs = []
    for rate in args.request_rates.split(","):
        filename = f"bench_serve_{server}_rate_{rate}.json"
        command = [sys.executable, "-m", "pagedserve", "bench", "serve", "--backend", "openai",
                   "--base-url", base_url, "--model", model, "--dataset-name", "random",
                   "--random-input-len", str(args.bench_input_len), "--random-output-len", str(args.bench_output_len),
                   "--num-prompts", str(args.bench_num_prompts), "--request-rate", rate, "--ignore-eos",
                   "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
                   "--goodput", *GOODPUT_SLO,
                   "--save-result", "--result-dir", str(result_dir), "--result-filename", filename]
        if "--tokenizer" in help_text and os.path.isdir(tokenizer):  # else: the server's /tokenize
            command += ["--tokenizer", tokenizer]
        print("  $", " ".join(command[1:]), flush=True)
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.bench_timeout, cwd=REPO_ROOT)
        if done.returncode != 0:
            runs.append({"request_rate": rate, "error": f"exit {done.returncode}: {done.stderr[-2000:]}"})
            print(f"  bench serve failed at rate {rate}: {done.stderr[-2000:]}", flush=True)
            continue
        result = json.loads((result_dir / filename).read_text())
        runs.append({"request_rate": rate, "result_file": filename,
                     **{key: result.get(key) for key in BENCH_SUMMARY_KEYS}})
        print(f"  rate {rate}: {result.get('request_throughput', 0):.2f} req/s, "
              f"{result.get('output_throughput', 0):.1f} output tok/s, TTFT p99 {result.get('p99_ttft_ms')} ms, "
              f"TPOT p99 {result.get('p99_tpot_ms')} ms", flush=True)
    return runs


@contextlib.contextmanager
def lock_server(work: Path, model_flags: list[str], name: str, ready_timeout: float, env: dict[str, str]):
    """benchmarks/transformers_lock_server.py on a free port: yields its base URL, stops it after."""
    port = free_port()
    log_path = work / "transformers_lock_server.log"
    script = Path(__file__).resolve().parent / "transformers_lock_server.py"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, str(script), *model_flags, "--served-model-name", name,
                                    "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **env})
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while not http_ok(f"{base_url}/health"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"transformers server did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield base_url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def pagedserve_server(work: Path, model_flags: list[str], name: str, engine_flags: list[str], ready_timeout: float,
                      env: dict[str, str]):
    """`pagedserve serve` with its HTTP gateway: yields the gateway's URL, stops it (SIGTERM) after."""
    with launched_server(work, *model_flags, "--served-model-name", name, *engine_flags, http=True,
                         ready_timeout=ready_timeout, env=env) as server:
        yield server.http_url
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=60)


def measure(server: str, base_url: str, name: str, tokenizer: str, args, result_dir: Path) -> dict:
    print(f"{server} at {base_url}", flush=True)
    output_lens = [int(n) for n in args.output_lens.split(",")]
    threads = [int(n) for n in args.threads.split(",")]
    # Warm-up, unmeasured: the first requests pay one-time costs (allocator growth, lazy imports, the engine's
    # first batches of each size), once from one thread and once from the most threads.
    for count in sorted({1, max(threads)}):
        together(count, lambda _: chat(base_url, name, min(output_lens), args.request_timeout, temperature=0.0,
                                       ignore_eos=True))
    figures = {"sweep": sweep_output_lengths(base_url, name, output_lens, threads, args.request_timeout)}
    figures["same_question"] = same_question(base_url, name, args.rounds, max(threads), args.answer_max_tokens,
                                             args.request_timeout)
    answers = figures["same_question"]
    print(f"  same question: {answers['distinct_answers_concurrent']} distinct answers from {answers['threads']} "
          f"threads x {args.rounds} rounds, {answers['distinct_answers_single_thread']} from 1 thread", flush=True)
    help_text = bench_serve_help()
    if help_text is None:
        print("  bench serve: skipped (this checkout has no `pagedserve bench serve`)", flush=True)
        figures["bench_serve"] = {"skipped": "this checkout has no `pagedserve bench serve`"}
    else:
        figures["bench_serve"] = bench_serve(base_url, name, tokenizer, server, args, result_dir, help_text)
    return figures


def draw(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for server in SERVERS:
        rows = summary["servers"][server]["sweep"]
        for threads in sorted({row["threads"] for row in rows}):
            mine = [row for row in rows if row["threads"] == threads]
            ax.plot([row["output_len"] for row in mine], [row["output_tokens_per_s"] for row in mine],
                    marker="o", linestyle="-" if server == "pagedserve" else "--",
                    label=f"{server}, {threads} thread{'s' if threads > 1 else ''}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("output length (tokens, EOS ignored)")
    ax.set_ylabel("output tokens / s (all threads)")
    ax.set_title(f"{summary['model']} on {summary['device']} ({summary['dtype']})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory or .gguf file (default: the model's)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random weights of this shape")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda with --shape, else cpu)")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--output-lens", default=None, help="comma-separated output lengths of sweep (i)")
    parser.add_argument("--threads", default="1,3", help="client thread counts of (i); the largest is (ii)'s")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the same-question test (ii)")
    parser.add_argument("--answer-max-tokens", type=int, default=None, help="max_tokens of (ii) (at most 1000)")
    parser.add_argument("--request-rates", default=None, help="comma-separated bench serve rates of (iii)")
    parser.add_argument("--bench-num-prompts", type=int, default=None)
    parser.add_argument("--bench-input-len", type=int, default=None)
    parser.add_argument("--bench-output-len", type=int, default=None)
    parser.add_argument("--bench-timeout", type=float, default=3600.0, help="seconds for one bench serve run")
    parser.add_argument("--request-timeout", type=float, default=1800.0, help="seconds for one HTTP request")
    parser.add_argument("--engine-flags", default=None,
                        help=f"extra `pagedserve serve` flags (CPU default: {CPU_ENGINE_FLAGS!r})")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds for a server to start")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="OMP_NUM_THREADS of both servers (CPU: 1 keeps a shared machine's cores from "
                             "being oversubscribed; default: torch's own choice)")
    parser.add_argument("--result-dir", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    if args.shape and args.model:
        parser.error("--model and --shape: give one (a shape is random weights of a model's size)")
    args.device = args.device or ("cuda" if args.shape else "cpu")
    if args.dtype == "auto":
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    for key, value in (GPU_DEFAULTS if args.device != "cpu" else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.engine_flags is None:
        args.engine_flags = CPU_ENGINE_FLAGS if args.device == "cpu" else ""
    if not 1 <= args.answer_max_tokens <= 1000:
        parser.error("--answer-max-tokens: between 1 and 1000, as in the tutorial")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result_dir = Path(args.result_dir).resolve()
    result_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vs_transformers_"))
    if args.shape:
        # The tokenizer in a directory of its own: beside the shape's config.json, transformers would read it
        # as the config's model type's tokenizer class (id_word_tokenizer.py).
        tokenizer_path = str(write_id_word_tokenizer(work / "tokenizer", SHAPES[args.shape]["vocab_size"]))
        model_path = str(write_config_dir(args.shape, work / args.shape))
        name, model_flags = args.shape, ["--model", model_path, "--load-format", "dummy"]
    else:
        resolved = resolve_model(args.model)
        model_path, name = resolved.path, resolved.name
        tokenizer_path = resolve_model(args.tokenizer).path if args.tokenizer else model_path
        model_flags = ["--model", model_path]
    if tokenizer_path != model_path:
        model_flags += ["--tokenizer", tokenizer_path]
    device_flags = ["--device", args.device, "--dtype", args.dtype]
    summary = {"model": name, "shape": args.shape, "device": args.device, "dtype": args.dtype,
               "question": QUESTION, "date": time.strftime("%Y%m%d-%H%M%S"),
               "arguments": {k: v for k, v in vars(args).items() if k != "result_dir"}, "servers": {}}
    started = time.perf_counter()
    json_path = result_dir / "vs_transformers_server.json"
    # The same torch thread count in both servers' processes (OMP_NUM_THREADS), when asked.
    env = {} if args.torch_threads is None else {"OMP_NUM_THREADS": str(args.torch_threads)}
    servers = {"transformers_lock": lambda: lock_server(work, model_flags + device_flags, name, args.ready_timeout,
                                                        env),
               "pagedserve": lambda: pagedserve_server(work, model_flags + device_flags, name,
                                                       args.engine_flags.split(), args.ready_timeout, env)}
    for server, start in servers.items():
        with start() as url:
            summary["servers"][server] = measure(server, url, name, tokenizer_path, args, result_dir)
        summary["duration_s"] = time.perf_counter() - started
        json_path.write_text(json.dumps(summary, indent=2))  # after each server: a late failure keeps the first
    draw(summary, result_dir / "vs_transformers_server.png")
    print(f"wrote {result_dir / 'vs_transformers_server.json'} and vs_transformers_server.png "
          f"in {summary['duration_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
