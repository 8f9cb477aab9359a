"""Offline throughput (workload W1) through the engine's processes, against Hugging Face transformers in the
same run, and single-request decode latency (TPOT). One command on a lent GPU:

    python benchmarks/offline_throughput.py --shape qwen2.5-1.5b [--skip-hf] [--num-requests 256]
        [--tensor-parallel-size N] [--tag NAME]

W1 (DESIGN.md): 256 requests x 512 random prompt tokens x exactly 256 output tokens (EOS ignored), all
submitted at once, greedy. Peers: HF `generate` in static batches of 64, and HF continuous batching
(`generate_batch`). The floor: prefill FLOPs at the measured bf16 matmul rate plus, for each decode step,
(weight bytes + KV bytes read) at the measured copy bandwidth. Writes JSON (and a bar chart PNG) to $OUT.

The engine's run is `pagedserve bench throughput`'s (pagedserve/bench/throughput.py: its random dataset, its
offline engine and its measurement, greedy here), so W1 is also one command without the peers and the floor:

    pagedserve bench throughput --model DIR --load-format dummy --device cuda --input-len 512 --output-len 256
        --num-prompts 256 --num-iters-warmup 1 --max-num-batched-tokens 16384 --max-model-len 1024

With `--tensor-parallel-size N` the engine shards the model over N GPUs (`-tp N`) and the floor is that of N
cards: each reads 1/N of the weights and KV and does 1/N of the FLOPs (the all-reduces are not in the floor,
so the fraction of it says what they cost). Tokens per second per GPU is the total over N.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.model_shapes import (  # noqa: E402
    SHAPES, active_parameters_per_token, decode_weight_bytes, hf_config, kv_bytes_per_token, write_config_dir,
)
from client import AsyncClient, Client  # noqa: E402
from pagedserve.bench.offline_engine import start_engine  # noqa: E402
from pagedserve.bench.random_token_requests import BenchRequest, random_requests  # noqa: E402
from pagedserve.bench.throughput import measure_throughput  # noqa: E402
from pagedserve.cli import parse_args  # noqa: E402

PROMPT_LEN, OUTPUT_LEN, HF_STATIC_BATCH = 512, 256, 64


def measure_ceilings() -> dict:
    """The card's copy bandwidth (bytes read + written) and bf16 matmul rate, measured now."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    copy_bandwidth = 2 * src.numel() * 20 / (start.elapsed_time(end) / 1e3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    matmul_flops = 2 * 8192**3 * 20 / (start.elapsed_time(end) / 1e3)
    ceilings = {"copy_bandwidth_bytes_per_s": copy_bandwidth, "bf16_matmul_flops_per_s": matmul_flops}
    # The quantized settings' prefill floors: the same product on the FP8 and INT8 tensor cores.
    one = torch.ones((), device="cuda")
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    ai, bi = (a * 8).clamp(-127, 127).to(torch.int8), (b * 8).clamp(-127, 127).to(torch.int8)
    quantized = {"fp8_matmul_flops_per_s": lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                                     out_dtype=torch.bfloat16),
                 "int8_matmul_flops_per_s": lambda: torch._int_mm(ai, bi.t())}
    for key, product in quantized.items():
        try:
            for _ in range(3):
                product()
        except RuntimeError:  # no FP8 tensor cores (before compute capability 8.9)
            continue
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            product()
        end.record()
        torch.cuda.synchronize()
        ceilings[key] = 2 * 8192**3 * 20 / (start.elapsed_time(end) / 1e3)
    del src, dst, a, b, a8, b8, ai, bi
    torch.cuda.empty_cache()
    return ceilings


def w1_floor(shape: str, num_requests: int, ceilings: dict, num_gpus: int = 1, linear_bytes: float = 2.0,
             kv_bytes: int = 2, matmul: str = "bf16") -> dict:
    """W1's time floor: prefill at the matmul rate, decode at the copy bandwidth. A quantized setting's floor:
    `linear_bytes` per parameter of the decoder layers (embeddings and LM head stay 2 bytes), `kv_bytes` per
    cached value, prefill at the `matmul` ("bf16", "fp8", "int8") rate measured in `ceilings`."""
    s = SHAPES[shape]
    embedding_params = s["vocab_size"] * s["hidden_size"] * (1 if s["tie_word_embeddings"] else 2)
    # MoE: a token multiplies by its k experts only, and a decode step reads only the experts chosen
    # (model_shapes.decode_weight_bytes; at 256 sequences every expert of both MoE shapes).
    bf16_weights = decode_weight_bytes(shape, num_requests)
    weights = 2 * embedding_params + (bf16_weights - 2 * embedding_params) * linear_bytes / 2
    non_embedding_params = active_parameters_per_token(shape) - embedding_params
    prompt_tokens = num_requests * PROMPT_LEN
    attention_flops = num_requests * 2 * s["num_hidden_layers"] * s["hidden_size"] * PROMPT_LEN**2  # causal QK + PV
    prefill_flops = 2 * (non_embedding_params + s["vocab_size"] * s["hidden_size"] / PROMPT_LEN) * prompt_tokens
    prefill_s = (prefill_flops / ceilings[f"{matmul}_matmul_flops_per_s"]
                 + attention_flops / ceilings["bf16_matmul_flops_per_s"])
    kv_token = kv_bytes_per_token(shape, kv_bytes)
    decode_bytes = sum(weights + num_requests * (PROMPT_LEN + step) * kv_token for step in range(OUTPUT_LEN))
    decode_s = decode_bytes / ceilings["copy_bandwidth_bytes_per_s"]
    prefill_s, decode_s = prefill_s / num_gpus, decode_s / num_gpus
    total = num_requests * OUTPUT_LEN
    return {"prefill_s": prefill_s, "decode_s": decode_s, "num_gpus": num_gpus, "linear_bytes": linear_bytes,
            "kv_bytes": kv_bytes, "matmul": matmul, "output_tokens_per_s": total / (prefill_s + decode_s)}


def prompts(num_requests: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """W1's prompts: `pagedserve bench throughput`'s random dataset (the same for the Hugging Face peers)."""
    return [request.prompt_token_ids
            for request in random_requests(num_requests, PROMPT_LEN, OUTPUT_LEN, vocab, seed=seed)]


def run_engine(shape: str, requests, work: Path, extra: list[str], quantization_config: dict | None = None) -> dict:
    """W1 through `pagedserve bench throughput`'s engine and measurement, greedy: first over other random
    prompts (it pays Triton's and cuBLAS's one-time costs of batch shapes not seen before), then over
    `requests`, the run reported. Other prompts, because prefix caching is on: the same prompts again would
    find every full block cached and skip nearly all of the prefill. Then the TPOT of a lone request.
    `quantization_config`: written into the shape's config.json (a quantized checkpoint's random weights)."""
    model_dir = write_config_dir(shape, work / shape)
    if quantization_config is not None:
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    args = parse_args(["bench", "throughput", "--model", str(model_dir), "--load-format", "dummy", "--device", "cuda",
                       "--dtype", "bfloat16", "--max-num-seqs", "256", "--max-num-batched-tokens", "16384",
                       "--max-model-len", "1024", "--swap-space", "1", "--ready-timeout", "900", *extra])
    vocab = SHAPES[shape]["vocab_size"]
    measured = [BenchRequest(prompt, OUTPUT_LEN) for prompt in requests]
    warmup = [BenchRequest(prompt, OUTPUT_LEN) for prompt in prompts(len(requests), vocab, seed=1)]
    started = time.perf_counter()
    llm = start_engine(args)
    ready_s = time.perf_counter() - started
    # The scheduler's and worker's step timers are logged at shutdown, and the LLM deletes the log of a server
    # that exits cleanly: a handle opened now still reads the whole file after.
    with open(llm.log_path, errors="replace") as log, llm:
        first_run = measure_throughput(llm, warmup, temperature=0.0)
        run = measure_throughput(llm, measured, temperature=0.0)
        gaps = asyncio.run(_lone_request_gaps(llm.target, prompts(1, vocab, seed=2)[0]))
        with Client(llm.target) as client:
            stats = client.stats()
        llm.shutdown()
        server_log = log.read()
    # Where a step's time goes: means over every step of the run (both W1 passes and the lone request).
    step_timers = step_timer_lines(server_log)
    return {
        "step_timers": step_timers, "ready_s": ready_s,
        "device_busy_steady_decode": _device_busy(step_timers),
        "elapsed_s": run.elapsed_time, "output_tokens": run.total_output_tokens,
        "output_tokens_per_s": run.output_tokens_per_second, "bench_throughput": run.to_json(),
        "first_run_elapsed_s": first_run.elapsed_time,
        "tpot_median_ms": 1e3 * statistics.median(gaps), "tpot_p90_ms": 1e3 * sorted(gaps)[int(0.9 * len(gaps))],
        "num_kv_blocks": stats.num_kv_blocks, "preemptions": stats.num_preemptions, "steps": stats.num_steps,
    }


def step_timer_lines(server_log: str) -> list[str]:
    """A server log's lines on where steps' time went: the scheduler's and the worker's step timers and the
    worker's device clocks (logged at shutdown: read them from a handle opened before the `LLM` stops, since
    it deletes the log of a server that exits cleanly), slow step launches and the warm-up."""
    return [line.split(" INFO ", 1)[-1] for line in server_log.splitlines()
            if "step time over" in line or "slow step launch" in line or "warmed up" in line]


def _device_busy(step_timers: list[str]) -> float | None:
    """The worker's steady-decode busy fraction from its shutdown line (worker_svc/device_busy.py), or None."""
    for line in step_timers:
        if "device busy in steady decode: " in line and "%" in line:
            return float(line.split("device busy in steady decode: ", 1)[1].split("%", 1)[0]) / 100
    return None


async def _lone_request_gaps(target: str, prompt: list[int]) -> list[float]:
    """TPOT of a lone request: inter-chunk times of one stream on the idle server."""
    stamps = []
    async with AsyncClient(target) as client:
        async for _ in client.generate_stream(prompt, max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True):
            stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


def run_hf_static(model, requests) -> dict:
    start = time.perf_counter()
    generated = 0
    for i in range(0, len(requests), HF_STATIC_BATCH):
        batch = torch.tensor(requests[i : i + HF_STATIC_BATCH], device="cuda")
        with torch.no_grad():
            out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                                 max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN, pad_token_id=0)
        generated += (out.shape[1] - PROMPT_LEN) * out.shape[0]
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens": generated, "output_tokens_per_s": generated / elapsed}


def run_hf_generate_batch(model, requests) -> dict:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN, do_sample=False,
                              eos_token_id=2, pad_token_id=0)
    model.generate_batch(inputs=requests[:4], generation_config=config)  # warm-up
    start = time.perf_counter()
    results = model.generate_batch(inputs=requests, generation_config=config)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    generated = sum(len(r.generated_tokens) for r in results.values())
    return {"elapsed_s": elapsed, "output_tokens": generated, "output_tokens_per_s": generated / elapsed}


def run_hf(shape: str, requests, peers: list[str]) -> dict:
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.bfloat16).eval()
    results = {}
    runners = {"hf_static_batch64": run_hf_static, "hf_generate_batch": run_hf_generate_batch}
    for name, runner in ((name, runners[name]) for name in peers):
        try:
            results[name] = runner(model, requests)
        except Exception as error:  # a peer that cannot run here is reported, not hidden
            results[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
        print(name, json.dumps(results[name]), flush=True)
    del model
    torch.cuda.empty_cache()
    return results


def draw(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in summary["runs"].items() if "output_tokens_per_s" in r] + ["W1 floor"]
    values = [summary["runs"][n]["output_tokens_per_s"] for n in names[:-1]] + [summary["floor"]["output_tokens_per_s"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, values, color=["tab:blue"] + ["tab:gray"] * (len(names) - 2) + ["tab:green"])
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"W1 on {summary['device']}, {summary['shape']} shape (bf16)")
    for x, v in enumerate(values):
        ax.text(x, v, f"{v:,.0f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--hf-peers", default="hf_static_batch64,hf_generate_batch",
                        help="comma-separated Hugging Face runs (hf_static_batch64, hf_generate_batch)")
    parser.add_argument("--engine-flags", default="", help="extra `pagedserve serve` flags")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs the engine shards over")
    parser.add_argument("--tag", default="", help="appended to the output files' names")
    parser.add_argument("--quantization-config", type=json.loads, default=None,
                        help="a JSON quantization_config for the shape's config.json (AWQ, GPTQ, compressed-tensors)")
    parser.add_argument("--floor-linear-bytes", type=float, default=2.0,
                        help="bytes per decoder-layer weight in the floor (1 for FP8 / INT8, ~0.53 for 4-bit g128)")
    parser.add_argument("--floor-kv-bytes", type=int, default=2, help="bytes per KV value in the floor (1: fp8)")
    parser.add_argument("--floor-matmul", choices=("bf16", "fp8", "int8"), default="bf16",
                        help="the tensor-core rate of the floor's prefill")
    args = parser.parse_args()
    tp = args.tensor_parallel_size
    out_dir = Path(os.environ.get("OUT", "."))
    work = Path(tempfile.mkdtemp())
    ceilings = measure_ceilings()
    requests = prompts(args.num_requests, SHAPES[args.shape]["vocab_size"])
    summary = {"device": torch.cuda.get_device_name(0), "shape": args.shape, "ceilings": ceilings,
               "tensor_parallel_size": tp, "floor": w1_floor(args.shape, args.num_requests, ceilings, tp, args.floor_linear_bytes,
                                 args.floor_kv_bytes, args.floor_matmul), "runs": {}}
    print("ceilings", json.dumps(ceilings), "floor", json.dumps(summary["floor"]), flush=True)
    engine_flags = [*(["--tensor-parallel-size", str(tp)] if tp > 1 else []), *args.engine_flags.split()]
    summary["runs"]["pagedserve"] = run_engine(args.shape, requests, work, engine_flags, args.quantization_config)
    summary["runs"]["pagedserve"]["output_tokens_per_s_per_gpu"] = summary["runs"]["pagedserve"]["output_tokens_per_s"] / tp
    print("pagedserve", json.dumps(summary["runs"]["pagedserve"]), flush=True)
    if not args.skip_hf:
        summary["runs"].update(run_hf(args.shape, requests, args.hf_peers.split(",")))
    engine = summary["runs"]["pagedserve"]["output_tokens_per_s"]
    summary["ratios"] = {
        f"pagedserve_over_{name}": engine / run["output_tokens_per_s"]
        for name, run in summary["runs"].items() if name != "pagedserve" and "output_tokens_per_s" in run
    }
    summary["ratios"]["pagedserve_fraction_of_floor"] = engine / summary["floor"]["output_tokens_per_s"]
    stem = f"w1_{args.shape}" + (f"_tp{tp}" if tp > 1 else "") + (f"_{args.tag}" if args.tag else "")
    (out_dir / f"{stem}.json").write_text(json.dumps(summary, indent=2))
    draw(summary, out_dir / f"{stem}.png")
    print(json.dumps(summary["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
