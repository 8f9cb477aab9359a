"""Sampler micro-benchmark: milliseconds per sampling step at batch 256, vocab 151936 (Qwen2.5), for several
parameter mixes, against the time of a whole Qwen2.5-1.5B-shape decode step (the issue's bar: sampling under
10% of it).

A "sampling step" is what the worker does after the forward pass: build the step's SamplingTensors from the
persistent batch's rows (host work, H2D copies, penalty counts), `sample`, pack the result and copy it to the
host (the step's one D2H copy). Rows hold PROMPT prompt tokens and OUTPUT generated ones, so the penalty
counts cover realistic lengths. Measured alone, one step at a time, the host work is paid in full; the
GPU's own share of it (kernels and copies, from torch.profiler) is reported beside it.

On CUDA it then runs a real Worker's decode steps (batch requests of 512 prompt tokens) with each mix. There
the host work overlaps the forward pass, as in serving, and the difference from the greedy step is what the
mix costs where it runs.

    python3 benchmarks/sampler_bench.py                          # CUDA: also measures the decode steps
    python3 benchmarks/sampler_bench.py --decode-step-ms 12.5    # compare with a decode time measured elsewhere
    python3 benchmarks/sampler_bench.py --device cpu --batch 8 --vocab 4096 --iters 3   # smoke test

Writes benchmarks/results/kernels/sampler_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kernels.sampling_ops import torch_sampling_ops, triton_sampling_ops  # noqa: E402
from protos.pagedserve.v1 import worker_pb2  # noqa: E402
from worker_svc.persistent_batch import PersistentBatch  # noqa: E402
from worker_svc.sampling.sampler import sample  # noqa: E402
from worker_svc.sampling.sampling_inputs import build_sampling_tensors  # noqa: E402
from worker_svc.model_runner import pack_sampler_output  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "kernels"

# Parameter mixes: WorkerSamplingParams fields given to every row (row i also gets seed i).
MIXES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "temperature_top_p": dict(temperature=0.8, top_p=0.95),
    "top_k_top_p_min_p": dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05),
    "penalties": dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    "logprobs_5": dict(temperature=0.8, num_logprobs=5),
    "everything": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                       frequency_penalty=0.5, repetition_penalty=1.1, num_logprobs=5, min_tokens=10 ** 6,
                       min_tokens_masked_ids=[2], logit_bias=[worker_pb2.LogitBias(token_id=7, bias=-5.0)]),
}


def filled_batch(batch_size: int, vocab: int, prompt: int, output: int, mix: dict) -> tuple[PersistentBatch, np.ndarray]:
    batch = PersistentBatch(batch_size, prompt + output + 1, block_size=16)
    rng = np.random.default_rng(0)
    fields = {**dict(top_p=1.0, top_k=-1, repetition_penalty=1.0, num_logprobs=-1, num_prompt_logprobs=-1), **mix}
    for i in range(batch_size):
        tokens = rng.integers(0, vocab, prompt + output).tolist()
        batch.add(worker_pb2.NewRequest(request_id=f"r{i}", token_ids=tokens, num_prompt_tokens=prompt,
                                        sampling=worker_pb2.WorkerSamplingParams(seed=i, **fields)))
    return batch, np.arange(batch_size, dtype=np.int64)


def sampling_step(batch, rows, logits, ops, device: torch.device):
    """One sampling step as the worker takes it: build the inputs, sample, pack, copy to the host."""

    def step():
        pack_sampler_output(sample(logits, build_sampling_tensors(batch, rows, device), ops)).cpu()

    return step


def time_sampling_step(batch, rows, logits, ops, iters: int, device: torch.device) -> float:
    """Median milliseconds of one sampling step, ending with the host copy (so it includes the device work)."""
    step = sampling_step(batch, rows, logits, ops, device)
    for _ in range(3):
        step()
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def gpu_time_ms(batch, rows, logits, ops, device: torch.device, steps: int = 5) -> float:
    """The GPU's own time in one sampling step: the kernels and copies it runs, from torch.profiler (no host
    work, no waiting for launches)."""
    from torch.autograd import DeviceType

    step = sampling_step(batch, rows, logits, ops, device)
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            step()
        _sync(device)
    on_gpu = [event for event in profiler.events() if event.device_type == DeviceType.CUDA]
    return sum(event.time_range.elapsed_us() for event in on_gpu) / steps / 1e3


def measure_decode_steps_ms(shape: str, batch: int, iters: int, mixes: list[str]) -> dict[str, float]:
    """Wall time of a whole decode step of a real Worker (random weights, bf16, CUDA graphs) whose `batch`
    requests all sample with each mix: what the mix costs where it runs, its host work overlapping the
    forward pass as it does in serving."""
    from benchmarks.profile_decode_step import decode_worker, prefill

    worker, previous, step_ms = decode_worker(shape, batch), [], {}
    for name in mixes:
        decode_step, previous = prefill(worker, batch, prompt=512, sampling=MIXES[name], replaces=previous, tag=name)
        for _ in range(5):
            decode_step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            decode_step()
        torch.cuda.synchronize()
        step_ms[name] = (time.perf_counter() - start) / iters * 1e3
    return step_ms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per row")
    parser.add_argument("--output", type=int, default=256, help="generated tokens per row")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--decode-step-ms", type=float, default=None,
                        help="the decode step to compare with (default on CUDA: measured, Qwen2.5-1.5B shape)")
    parser.add_argument("--shape", default="qwen2.5-1.5b", help="model shape of the measured decode step")
    parser.add_argument("--no-worker", action="store_true", help="skip the decode steps of a real Worker")
    parser.add_argument("--mixes", nargs="+", choices=sorted(MIXES), default=list(MIXES))
    args = parser.parse_args()
    device = torch.device(args.device)
    # As the worker does: the Triton kernels on a GPU.
    ops = triton_sampling_ops() if device.type == "cuda" else torch_sampling_ops()
    torch.manual_seed(0)  # the same logits each run: how many top-p draws are rejected depends on them
    logits = torch.randn(args.batch, args.vocab, device=device) * 3
    results, gpu_ms = {}, {}
    for name in args.mixes:
        batch, rows = filled_batch(args.batch, args.vocab, args.prompt, args.output, MIXES[name])
        results[name] = time_sampling_step(batch, rows, logits, ops, args.iters, device)
        if device.type == "cuda":
            gpu_ms[name] = gpu_time_ms(batch, rows, logits, ops, device)
    decode_ms, worker_ms = args.decode_step_ms, None
    if device.type == "cuda" and not args.no_worker:
        del logits
        torch.cuda.empty_cache()
        worker_ms = measure_decode_steps_ms(args.shape, args.batch, args.iters, ["greedy", *args.mixes])
        decode_ms = decode_ms or worker_ms["greedy"]
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "batch": args.batch, "vocab": args.vocab, "prompt_tokens": args.prompt, "output_tokens": args.output,
        "sampling_step_ms": results, "sampling_gpu_ms": gpu_ms or None, "decode_step_ms": decode_ms,
        "decode_shape": args.shape,
        "fraction_of_decode_step": {name: ms / decode_ms for name, ms in results.items()} if decode_ms else None,
        "worker_decode_step_ms": worker_ms,
        "worker_added_over_greedy_ms": {name: ms - worker_ms["greedy"] for name, ms in worker_ms.items()}
        if worker_ms else None,
    }
    for name, ms in results.items():
        share = f"  {ms / decode_ms:6.1%} of a {decode_ms:.2f} ms decode step" if decode_ms else ""
        if name in gpu_ms:
            share += f"; GPU time {gpu_ms[name]:.3f} ms" + (f" ({gpu_ms[name] / decode_ms:.1%})" if decode_ms else "")
        in_worker = (f"; in the worker's step {worker_ms[name]:.3f} ms, {worker_ms[name] - worker_ms['greedy']:+.3f}"
                     " ms over greedy" if worker_ms else "")
        print(f"{name:20s} {ms:8.3f} ms{share}{in_worker}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = report["device"].lower().replace(" ", "_") if device.type == "cuda" else "cpu"
    path = RESULTS / f"sampler_{tag}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
