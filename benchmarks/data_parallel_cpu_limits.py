"""What limits `-dp 2` without GPUs: CPU time per relayed stream message in the data-parallel front, in the
`bench serve` client and in each engine's scheduler, with stand-in engines that stream at a GPU's pace.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/data_parallel_cpu_limits.py [--api-server-count 1 2]
        [--num-client-processes 1] [--engines 2] [--num-prompts 512] [--step-ms 7] [--out result.json]

Each engine is pagedserve/testing/instant_engine.py (the real scheduler service: gRPC API, validation,
scheduler, engine loop, stream pacing, detokenizing; an instant stand-in worker that takes `--step-ms` per
step, as a GPU would). In front of them the real front (`python -m scheduler_svc.data_parallel`, prefix
policy, the shape's word tokenizer so it keys prompt heads as it does on the GPU run), with
`--api-server-count` processes on one port; the real client (`pagedserve bench serve --backend grpc`, random
512 in / 256 out, EOS ignored, --request-rate inf), as benchmarks/data_parallel_gpu.py runs it. `--direct`:
the client straight to one engine (no front), the `-dp 1` path.

Measured per process: utime + stime from /proc/PID/stat (every thread, gRPC's included) over the measured run
(from bench serve's "Starting main benchmark run" to its result header); the client's is what bench serve
reports of its own processes over the run (`client_cpu_s`: process CPU time, every thread, start-up left out). Messages = every stream message that carried tokens
(bench serve's `itls` + 1 per request), the count the front relays (each stream's final message is one of them
or one more). Reported per process: CPU s, % of one core over the run, CPU us per message, ms per request, and
its ceiling with a core for each of its processes: messages and requests over the busiest process's CPU s (the
busiest limits; for one process, messages / CPU s and requests / CPU s). Why CPU time and not
throughput: this machine has 2 shared cores for 4+ busy processes, so wall-clock rates here measure the
contention; CPU per message is what each process costs and carries over to a bigger host (scaled by its
cores' speed). Several settings run in one call (each `--api-server-count` value), each on fresh processes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.id_word_tokenizer import write_id_word_tokenizer  # noqa: E402
from benchmarks.model_shapes import SHAPES, write_config_dir  # noqa: E402
from pagedserve.free_port import free_port  # noqa: E402
from pagedserve.health_probe import grpc_serving  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
GPU_MEASURED = {"dp1_peak_request_throughput": 116.1, "dp2_peak_request_throughput": 157.7}


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@contextmanager
def started(argv: list[str], log: Path, target: str, name: str):
    """A process serving gRPC health on `target`; SIGTERM on exit."""
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        deadline = time.monotonic() + 120
        while not grpc_serving(target):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def front_pids(front: subprocess.Popen) -> list[int]:
    """The front's processes: itself and the serving processes it started (--api-server-count > 1)."""
    children = Path(f"/proc/{front.pid}/task/{front.pid}/children")
    return [front.pid, *(int(pid) for pid in children.read_text().split())]


def bench(target: str, args, num_prompts: int, result: Path, watched: dict[str, list[int]]) -> tuple[dict, dict]:
    """One `bench serve` run; the CPU seconds each watched group's processes (and the client's) spent in its
    measured run, process by process."""
    argv = [sys.executable, "-m", "pagedserve", "bench", "serve", "--backend", "grpc", "--base-url", target,
            "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--num-prompts", str(num_prompts), "--request-rate", "inf", "--ignore-eos",
            "--seed", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name]
    if args.num_client_processes > 1:
        argv += ["--num-client-processes", str(args.num_client_processes)]
    process = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    before: dict[str, list[float]] = {}
    after: dict[str, list[float]] = {}
    lines = []

    def snapshot() -> dict[str, list[float]]:
        return {name: [_cpu_or_zero(pid) for pid in group] for name, group in watched.items()}

    for line in process.stdout:
        lines.append(line)
        if "Starting main benchmark run" in line:
            before = snapshot()
        elif "Serving Benchmark Result" in line:
            after = snapshot()
    if process.wait() != 0 or not before or not after:
        raise RuntimeError("bench serve failed:\n" + "".join(lines[-40:]))
    record = json.loads(result.read_text())
    cpu = {name: [end - begin for begin, end in zip(before[name], after[name])] for name in after}
    return record, {**cpu, "client": record["client_cpu_s_per_process"]}


def _cpu_or_zero(pid: int) -> float:
    try:
        return cpu_seconds(pid)
    except OSError:  # exited meanwhile
        return 0.0


def figures(record: dict, cpu: dict[str, float]) -> dict:
    completed = record["completed"]
    messages = sum(len(itl) + 1 for itl, length in zip(record["itls"], record["output_lens"]) if length)
    out = {"completed": completed, "failed": record["failed"], "messages": messages,
           "messages_per_request": messages / max(completed, 1), "duration_s": record["duration"],
           "request_throughput_here": record["request_throughput"], "processes": {}}
    for name, per_process in cpu.items():
        seconds, busiest = sum(per_process), max(per_process)
        out["processes"][name] = {
            "cpu_s": round(seconds, 3), "cpu_s_per_process": [round(s, 3) for s in per_process],
            "core_share": round(seconds / record["duration"], 3),
            "cpu_us_per_message": round(1e6 * seconds / messages, 2),
            "cpu_ms_per_request": round(1e3 * seconds / completed, 3),
            # With a core for each process, the busiest one limits: its share of the run at full speed.
            "ceiling_messages_per_s": round(messages / busiest) if busiest else None,
            "ceiling_requests_per_s": round(completed / busiest, 1) if busiest else None,
        }
    return out


def measure(model_dir: Path, work: Path, args, api_server_count: int | None) -> dict:
    """One setting on fresh processes: `api_server_count` front processes, or none (the client to engine 0)."""
    with ExitStack() as stack:
        engine_targets = []
        watched: dict[str, list[int]] = {}
        for index in range(1 if api_server_count is None else args.engines):
            port = free_port()
            target = f"127.0.0.1:{port}"
            engine = stack.enter_context(started(
                [sys.executable, "-m", "pagedserve.testing.instant_engine", "--model", str(model_dir),
                 "--grpc-port", str(port), "--step-ms", str(args.step_ms), "--stream-messages-per-step",
                 str(args.stream_messages_per_step)], work / f"engine{index}-{port}.log",
                target, f"engine {index}"))
            engine_targets.append(target)
            watched[f"engine {index}"] = [engine.pid]
        target = engine_targets[0]
        if api_server_count is not None:
            port = free_port()
            target = f"127.0.0.1:{port}"
            front = stack.enter_context(started(
                [sys.executable, "-m", "scheduler_svc.data_parallel", "--grpc-port", str(port), "--model",
                 str(model_dir), "--router-policy", args.router_policy,
                 *(["--api-server-count", str(api_server_count)] if api_server_count > 1 else []),
                 "--engine-targets", *engine_targets], work / f"front-{port}.log", target, "front"))
            time.sleep(1.0)  # every front process serving (each polls the engines before it turns SERVING)
            watched["front"] = front_pids(front)
        name = "direct" if api_server_count is None else f"front{api_server_count}"
        bench(target, args, min(args.num_prompts, 128), work / f"{name}_warmup.json", watched)
        record, cpu = bench(target, args, args.num_prompts, work / f"{name}.json", watched)
    result = figures(record, cpu)
    result["api_server_count"] = api_server_count
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES), help="its vocabulary's tokenizer")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--api-server-count", type=int, nargs="+", default=[1],
                        help="front processes per setting (one setting each)")
    parser.add_argument("--direct", action="store_true", help="also a setting with no front (client -> one engine)")
    parser.add_argument("--num-client-processes", type=int, default=1, help="bench serve's client processes")
    parser.add_argument("--router-policy", default="prefix")
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=7.0, help="the stand-in engines' time per step")
    parser.add_argument("--stream-messages-per-step", type=int, default=16,
                        help="the engines' stream pacing, as the scheduler's flag (its default: 16)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    report = {"what": __doc__.splitlines()[0], "host": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(), "shape": args.shape,
              "engines": args.engines, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "step_ms": args.step_ms,
              "stream_messages_per_step": args.stream_messages_per_step, "router_policy": args.router_policy,
              "num_client_processes": args.num_client_processes, "gpu_measured": GPU_MEASURED, "settings": []}
    with tempfile.TemporaryDirectory() as work:
        model_dir = write_config_dir(args.shape, Path(work) / args.shape)
        write_id_word_tokenizer(model_dir, SHAPES[args.shape]["vocab_size"])
        for count in ([None] if args.direct else []) + list(args.api_server_count):
            result = measure(model_dir, Path(work), args, count)
            report["settings"].append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
