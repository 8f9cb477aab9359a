"""The batched multi-LoRA kernels (kernels/triton_lora.py) on a GPU: time of one `lora_add` against the bf16 base
matmul of the same projection, for the Llama-3.1-8B projections (benchmarks/gemm_floors.py `projections`: qkv
4096x6144, o 4096x4096, gate_up 4096x28672, down 14336x4096) at 1, 16 and 256 tokens, 8 adapters of rank 16
(R = 16), every token on a random adapter (the most adapters a step can touch), bf16.

Per projection and token count:
- `lora_us`: seconds per `lora_add` (shrink + expand), from replays of one CUDA graph of back-to-back calls
  (gemm_floors.time_in_graph), each call on its own copy of the stacked adapters, enough copies to read past the
  card's L2 (as between two layers of a served model, where the other weights evict them);
- `base_us`: F.linear of x by the bf16 weight [N, K], timed the same way over copies of the weight;
- `overhead` = lora_us / base_us: what LoRA adds to the projection;
- `base_rows_us`: `lora_add` with every token on slot -1 (the base model), what a step without adapter rows pays
  under the CUDA graphs captured with LoRA (worker_svc/decode_graphs.py): the launches and the programs' early
  exit, no adapter read;
- `splits`: the shrink's K slices; `relative_error` ||y - ref|| / ||ref|| and `bit_equal` (fraction of y's
  elements equal to the reference's bits) against kernels/lora_ref.py on the same inputs (bound ERROR_BOUND).

Run on an H100/H200 (not in CI): `python -m benchmarks.lora_kernels_gpu --out lora_kernels_gpu.json`. Exits 1
when the check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.gemm_floors import projections
from benchmarks.wna16_gemm_gpu import copies_past_l2, seconds_per_call
from kernels import lora_ref
from kernels.triton_lora import lora_add, shrink_splits

SHAPE = "llama-3.1-8b"
PROJECTIONS = ("qkv", "o", "gate_up", "down")
TOKENS = (1, 16, 256)
NUM_ADAPTERS, RANK = 8, 16
ALPHA = 32.0
ERROR_BOUND = 1e-2


def stacked_adapters(k_size: int, n_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A [S, R, K] and B [S, N, R] in bf16, scaled so that the update is of the order of a layer's output."""
    lora_a = torch.randn(NUM_ADAPTERS, RANK, k_size, device="cuda", generator=generator) / k_size ** 0.5
    lora_b = torch.randn(NUM_ADAPTERS, n_size, RANK, device="cuda", generator=generator) / RANK ** 0.5
    return lora_a.bfloat16(), lora_b.bfloat16()


def bench_projection(name: str, k_size: int, n_size: int, tokens_list: Sequence[int],
                     generator: torch.Generator) -> list[dict]:
    adapter_bytes = NUM_ADAPTERS * RANK * (k_size + n_size) * 2
    adapter_sets = [stacked_adapters(k_size, n_size, generator) for _ in range(copies_past_l2(adapter_bytes))]
    weights = [torch.randn(n_size, k_size, device="cuda", generator=generator, dtype=torch.bfloat16)
               for _ in range(copies_past_l2(k_size * n_size * 2))]
    scalings = torch.full((NUM_ADAPTERS,), ALPHA / RANK, device="cuda")
    results = []
    for num_tokens in tokens_list:
        x = torch.randn(num_tokens, k_size, device="cuda", generator=generator, dtype=torch.bfloat16)
        slots = torch.randint(0, NUM_ADAPTERS, (num_tokens,), device="cuda", generator=generator, dtype=torch.int32)
        y = torch.randn(num_tokens, n_size, device="cuda", generator=generator, dtype=torch.bfloat16)
        lora_s = seconds_per_call([lambda a=a, b=b: lora_add(y, x, a, b, slots, scalings) for a, b in adapter_sets])
        base_s = seconds_per_call([lambda w=w: F.linear(x, w) for w in weights])
        no_slots = torch.full_like(slots, -1)
        base_rows_s = seconds_per_call([lambda a=a, b=b: lora_add(y, x, a, b, no_slots, scalings)
                                        for a, b in adapter_sets])
        lora_a, lora_b = adapter_sets[0]
        fresh = torch.randn(num_tokens, n_size, device="cuda", generator=generator, dtype=torch.bfloat16)
        got, expected = fresh.clone(), fresh.clone()  # y has had the timed calls' updates added
        lora_add(got, x, lora_a, lora_b, slots, scalings)
        lora_ref.lora_add(expected, x, lora_a, lora_b, slots, scalings)
        row = {"projection": name, "k": k_size, "n": n_size, "tokens": num_tokens,
               "splits": shrink_splits(num_tokens, k_size), "lora_us": lora_s * 1e6, "base_us": base_s * 1e6,
               "base_rows_us": base_rows_s * 1e6,
               "overhead": lora_s / base_s,
               "relative_error": ((got.float() - expected.float()).norm() / expected.float().norm()).item(),
               "bit_equal": (got == expected).float().mean().item()}
        row["ok"] = row["relative_error"] < ERROR_BOUND
        print(f"{name:8s} T={num_tokens:4d} splits={row['splits']:2d} lora {row['lora_us']:7.1f} us  "
              f"base {row['base_us']:7.1f} us  (+{row['overhead']:5.1%})  slot -1 only {row['base_rows_us']:5.1f} us  err {row['relative_error']:.1e} "
              f"bit-equal {row['bit_equal']:.3f}", flush=True)
        results.append(row)
    return results


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON report")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="token counts to time")
    parser.add_argument("--projections", nargs="+", choices=PROJECTIONS, default=list(PROJECTIONS))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import triton

    generator = torch.Generator(device="cuda").manual_seed(0)
    shapes = projections(SHAPE)
    results = [row for name in args.projections
               for row in bench_projection(name, *shapes[name], args.tokens, generator)]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "shape": SHAPE, "num_adapters": NUM_ADAPTERS, "rank": RANK, "error_bound": ERROR_BOUND,
              "results": results, "ok": all(row["ok"] for row in results)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
