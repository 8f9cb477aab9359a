"""Where the online path loses throughput against the offline engine, in one command on a lent GPU.

    python benchmarks/online_gap.py --shape qwen2.5-1.5b [--result-dir DIR]

Issue 19 asks `bench serve --request-rate inf` against our gateway to reach 85% of `bench throughput` on the
same workload. This runs, on one server (the flags of online_serving.py), after a warm-up pass:
  1. `bench serve` over HTTP (the gateway), and over gRPC (the same scheduler, no gateway), at rate inf;
  2. for each, the CPU seconds every process spent (scheduler, worker, gateway, the bench client) next to the
     run's wall time: a process near one CPU-second per second is the pipeline's bottleneck;
then `bench throughput` (offline) for the reference, and the scheduler's and worker's step timers of both
servers (where a step's time goes). Everything lands in --result-dir (default $OUT) as online_gap_SHAPE.json,
the bench JSONs keeping their per-request lists.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.id_word_tokenizer import write_id_word_tokenizer  # noqa: E402
from benchmarks.model_shapes import SHAPES, write_config_dir  # noqa: E402
from benchmarks.online_serving import ENGINE_FLAGS, STALL_MARKS, add_workload_arguments, server_log_lines  # noqa: E402
from pagedserve.testing.server_harness import running_server  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
_TICKS = os.sysconf("SC_CLK_TCK")
PY_SPY = shutil.which("py-spy") or "py-spy"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def role(pid: int) -> str:
    """scheduler, worker, gateway (or the command) from the process's command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    for word in (b"scheduler", b"worker", b"gateway"):
        if word in argv or any(word in arg for arg in argv[:4]):
            return word.decode()
    return b" ".join(argv[:4]).decode(errors="replace")


def timed_bench(children: list[int], *argv: str, profile_dir: Path | None = None) -> dict:
    """Runs `pagedserve bench ARGV` and returns its wall time and each process's CPU seconds meanwhile.
    With `profile_dir`, py-spy samples the bench client and every server process into speedscope files, idle samples kept there."""
    before = {pid: cpu_seconds(pid) for pid in children}
    command = [sys.executable, "-m", "pagedserve", "bench", *argv]
    spies = []
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
        command = [PY_SPY, "record", "-r", "250", "--idle", "-f", "speedscope", "-o", str(profile_dir / "bench_client.json"), "--", *command]
        spies = [subprocess.Popen([PY_SPY, "record", "-r", "250", "--idle", "-f", "speedscope", "-p", str(pid), "-o",
                                   str(profile_dir / f"{role(pid)}.json")]) for pid in children]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO_ROOT)
    _, status, usage = os.wait4(process.pid, 0)
    for spy in spies:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"bench {argv[0]} failed with {status}")
    cpu = {f"{role(pid)}:{pid}": round(cpu_seconds(pid) - before[pid], 2) for pid in children}
    cpu["bench_client"] = round(usage.ru_utime + usage.ru_stime, 2)
    return {"wall_s": round(wall, 2), "cpu_s": cpu,
            "cpu_share": {name: round(seconds / wall, 3) for name, seconds in cpu.items()}}


def serve_args(backend: str, base_url: str, args, name: str, result_dir: Path, num_prompts: int) -> list[str]:
    return ["serve", "--backend", backend, "--base-url", base_url, "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(num_prompts), "--request-rate", "inf", "--ignore-eos", "--seed", "0",
            "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{name}.json"]


def headline(record: dict) -> dict:
    return {key: record[key] for key in ("duration", "request_throughput", "output_throughput", "median_ttft_ms",
                                          "p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "mean_itl_ms")}


def step_timers(server_log: str) -> list[str]:
    """Where a step's time went (the step timers the services log at shutdown), and the stalls."""
    return server_log_lines(server_log, ("step time over", "warmed up", *STALL_MARKS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--engine-flag", action="append", default=[],
                        help="an extra engine flag for both servers (repeatable; e.g. --engine-flag=--max-model-len=1024)")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy (on PATH) samples every process during the first HTTP run (speedscope files, "
                             "idle samples kept)")
    args = parser.parse_args()
    result_dir = Path(args.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    flags = [*ENGINE_FLAGS, *args.engine_flag]
    summary: dict = {"shape": args.shape, "input_len": args.input_len, "output_len": args.output_len,
                     "num_prompts": args.num_prompts, "engine_flags": flags}
    with tempfile.TemporaryDirectory() as work:
        model_dir = write_config_dir(args.shape, Path(work) / args.shape)
        write_id_word_tokenizer(model_dir, SHAPES[args.shape]["vocab_size"])
        with running_server(Path(work), str(model_dir), *flags, http=True, ready_timeout=900.0) as server:
            children = server.children
            summary["processes"] = {pid: role(pid) for pid in children}
            timed_bench(children, *serve_args("openai", server.http_url, args, "warmup", result_dir, 256))
            for backend, url in (("openai", server.http_url), ("grpc", server.target), ("openai", server.http_url)):
                name = f"{backend}_rate_inf" if f"{backend}_rate_inf" not in summary else f"{backend}_rate_inf_again"
                profile = result_dir / "profile" if args.profile and name == "openai_rate_inf" else None
                usage = timed_bench(children, *serve_args(backend, url, args, name, result_dir, args.num_prompts),
                                    profile_dir=profile)
                summary[name] = {**usage, **headline(json.loads((result_dir / f"{name}.json").read_text()))}
                print(name, json.dumps(summary[name]), flush=True)
        summary["online_step_timers"] = step_timers(server.log_path.read_text(errors="replace"))
        offline = timed_bench([], "throughput", "--model", str(model_dir), *flags, "--input-len", str(args.input_len),
                              "--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
                              "--output-json", str(result_dir / "offline.json"))
    record = json.loads((result_dir / "offline.json").read_text())
    summary["offline"] = {**offline, "requests_per_second": record["requests_per_second"],
                          "elapsed_time": record["elapsed_time"]}
    for name in ("openai_rate_inf", "grpc_rate_inf", "openai_rate_inf_again"):
        summary[f"{name}_over_offline"] = summary[name]["request_throughput"] / record["requests_per_second"]
    (result_dir / f"online_gap_{args.shape}.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
