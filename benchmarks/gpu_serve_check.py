"""GPU smoke check of the serving path, one command on a lent GPU machine.

Builds a small random Qwen2/Llama checkpoint, serves it through the real processes with --device cuda
(KV pool sized by the memory profile, --gpu-memory-utilization), and checks:
  - float32: 16 concurrent greedy requests equal transformers' greedy output on the same GPU, token for token
    (also once with a pool small enough to preempt, in swap mode: pinned host swap pool);
  - bfloat16: the same requests run to completion, every block is free afterwards.
Steps with prefill replay piecewise CUDA graphs at -tp 1 (reported as mixed_step_graphs), so float32 checks
them against transformers too.
Writes a JSON summary to $OUT (or ./gpu_serve_check.json). tests/gpu/test_gpu_serve_check.py runs the float32 runs
(`make test-gpu`).

With `-tp N` every run is served by N workers, one per GPU (the tiny model's 8 heads and 2 KV heads split).

  python benchmarks/gpu_serve_check.py [-tp 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pagedserve.testing.server_harness import running_server  # noqa: E402
from pagedserve.testing.tiny_models import make_tiny_model  # noqa: E402

MAX_TOKENS = 32
NUM_REQUESTS = 16


def _run_all(server, prompts):
    def one(prompt):
        with server.client() as client:
            return client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _hf_greedy_cuda(model_dir, prompt):
    # hf_reference loads on the CPU; move the cached model to the GPU once.
    from pagedserve.testing import hf_reference

    model = hf_reference._load(str(model_dir))
    if model.device.type != "cuda":
        model.to("cuda")
    input_ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0,
                             temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


# (name, server flags, whether its tokens must equal transformers' greedy tokens): the float32 runs are the
# token-exactness check (tests/gpu/test_gpu_serve_check.py runs them), bfloat16 only has to complete.
FLOAT32_RUNS = [
    ("float32_profiled_pool", ["--dtype", "float32", "--gpu-memory-utilization", "0.3"], True),
    ("float32_swap_preemption", ["--dtype", "float32", "--num-kv-blocks", "12", "--preemption-mode", "swap",
                                 "--swap-space", "0.5"], True),
]
RUNS = FLOAT32_RUNS + [("bfloat16_profiled_pool", ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.3"], False)]


def run_checks(work: Path, runs, tp: int = 1) -> dict[str, dict]:
    """Serves the tiny checkpoint (made under `work`) once per run with -tp `tp` and checks its 16 requests:
    each run's figures by name, `passed` among them."""
    model_dir = make_tiny_model(work, "qwen2", seed=7, hidden_size=256, intermediate_size=768,
                                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                                max_position_embeddings=1024)
    rng = random.Random(0)
    prompts = [[rng.randrange(4096) for _ in range(rng.randrange(3, 90))] for _ in range(NUM_REQUESTS)]
    expected = [_hf_greedy_cuda(model_dir, p) for p in prompts]
    checks = {}
    for name, flags, exact in runs:
        started = time.monotonic()
        with running_server(work, "--model", str(model_dir), "--device", "cuda", "-tp", str(tp), *flags) as server:
            ready = time.monotonic() - started
            t0 = time.monotonic()
            results = _run_all(server, prompts)
            elapsed = time.monotonic() - t0
            stats = server.wait_all_blocks_free()
            with server.client() as client:
                info = client.model_info()
            # Steps with prefill ran as piecewise CUDA graphs (worker_svc/mixed_graphs.py) where the model allows.
            mixed_graphs = "captured CUDA graphs for steps with prefill" in server.log()
        matches = sum(list(r.token_ids) == e for r, e in zip(results, expected))
        all_free = stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_free_swap_blocks == stats.num_swap_blocks
        passed = all_free and all(len(r.token_ids) == MAX_TOKENS for r in results) and (matches == len(prompts) or not exact)
        checks[name] = {
            "passed": passed, "exact_matches": f"{matches}/{len(prompts)}", "num_kv_blocks": info.num_kv_blocks,
            "num_swap_blocks": info.num_swap_blocks, "preemptions": stats.num_preemptions,
            "swapped_out_blocks": stats.num_swapped_out_blocks, "all_blocks_free": all_free,
            "startup_s": round(ready, 1), "generate_s": round(elapsed, 2), "mixed_step_graphs": mixed_graphs,
        }
        print(name, json.dumps(checks[name]), flush=True)
    return checks


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    tp = parser.parse_args().tensor_parallel_size
    out_dir = Path(os.environ.get("OUT", "."))
    checks = run_checks(Path(tempfile.mkdtemp()), RUNS, tp)
    summary = {"device": torch.cuda.get_device_name(0), "tensor_parallel_size": tp, "checks": checks}
    ok = all(check["passed"] for check in checks.values())
    (out_dir / f"gpu_serve_check{f'_tp{tp}' if tp > 1 else ''}.json").write_text(json.dumps(summary, indent=2))
    print("PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
