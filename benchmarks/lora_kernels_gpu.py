"""The batched multi-LoRA kernels (kernels/triton_lora.py) on a GPU: time of one layer's fused `lora_add_fused`
(one shrink and one expand launch for all of the layer's parts) against the bf16 base matmul of the same
projection, for the Llama-3.1-8B layers (benchmarks/gemm_floors.py `projections`: qkv 4096x(4096|1024|1024), o
4096x4096, gate_up 4096x(14336|14336), down 14336x4096) at 1, 16 and 256 tokens, 8 adapters of rank 16 (R = 16),
every token on a random adapter (the most adapters a step can touch), bf16.

Per layer and token count:
- `lora_us`: seconds per `lora_add_fused` (shrink + expand, the tokens sorted by slot beforehand, as the model
  does once per step), from replays of one CUDA graph of back-to-back calls (gemm_floors.time_in_graph), each
  call on its own copy of the stacked adapters, enough copies to read past the card's L2 (as between two layers
  of a served model, where the other weights evict them);
- `per_part_us`: the same delta as one call per part (the launches before the fused kernels), for comparison;
- `base_us`: F.linear of x by the bf16 weight [N, K], timed the same way over copies of the weight;
- `overhead` = lora_us / base_us: what LoRA adds to the projection;
- `base_rows_us`: the fused call with every token on slot -1 (the base model), what a step without adapter rows
  pays under the CUDA graphs captured with LoRA (worker_svc/decode_graphs.py): the launches and the programs'
  one-load early exit, no adapter read;
- `splits`, `expand_columns`: the shrink's K slices and the columns of one expand program; `relative_error`
  ||y - ref|| / ||ref|| and `bit_equal` (fraction of y's elements equal to the reference's bits) against
  kernels/lora_ref.py on the same inputs (bound ERROR_BOUND).
And per token count, `sort_us`: `LoraTokens.of` (the step's one sort of its tokens by slot), and
`step_lora_us`: what a 32-layer step adds, 32 x the four layers' `lora_us` + `sort_us`.

Run on an H100/H200 (not in CI): `python -m benchmarks.lora_kernels_gpu --out lora_kernels_gpu.json`. Exits 1
when the check fails.

`--sweep` (instead of the above; one to two minutes, most of it ~130 Triton compiles): `lora_add_fused` of the
four layers at 1, 2, 4, 8 and 16 tokens on one adapter and at 16 tokens on 8, for each of `candidate_tiles` (the few-token
path's tokens per program, K slices and warps, and the 16-token `tl.dot` path), timed the same way as `lora_us`
(graph replays: timed eagerly, each call's two launches would cost more host time than the kernels take, so
events around eager calls would time Python). The JSON's "sweep" holds every timing, and per case the tiles of
least time summed over the four layers (one `LoraTiles` serves a step's every layer), against
`tiles_for`'s choice; the table prints each candidate's sum per case. Each candidate's result is also checked
against kernels/lora_ref.py (relative error below ERROR_BOUND, else left out of the choice and the exit status 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.gemm_floors import projections
from benchmarks.model_shapes import SHAPES
from benchmarks.wna16_gemm_gpu import copies_past_l2, seconds_per_call
from kernels import lora_ref
from kernels.lora_ref import LoraTokens
from kernels.lora_tiles import LoraTiles, expand_columns, fit_registers, shrink_splits, tiles_for
from kernels.triton_lora import lora_add_fused

SHAPE = "llama-3.1-8b"
PROJECTIONS = ("qkv", "o", "gate_up", "down")
TOKENS = (1, 16, 256)
NUM_LAYERS = 32
NUM_ADAPTERS, RANK = 8, 16
ALPHA = 32.0
ERROR_BOUND = 1e-2
# The sweep's cases: (tokens, adapters the tokens use).
SWEEP_CASES = ((1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (16, NUM_ADAPTERS))
# The few-token path's K cuts the sweep tries: (block_k, split_columns, max_splits), from one iteration per
# program over many programs to a few iterations over 8-16.
SWEEP_K_CUTS = ((64, 64, 64), (64, 256, 16), (128, 128, 32), (128, 256, 16), (256, 256, 16))
QKV_STACKED_BLOCK = 64  # q|k|v's 3 x 16 stacked ranks, padded: the widest register tiles of the four layers


def part_rows(shape: str) -> dict[str, tuple[int, ...]]:
    """Each layer's fused parts' output rows (q|k|v, gate|up; one part for o and down)."""
    config = SHAPES[shape]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", config["hidden_size"] // heads)
    intermediate = config["intermediate_size"]
    return {"qkv": (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), "o": (config["hidden_size"],),
            "gate_up": (intermediate, intermediate), "down": (config["hidden_size"],)}


def stacked_adapters(k_size: int, rows: tuple[int, ...], generator: torch.Generator
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A [S, P*R, K] and B [S, N, R] in bf16, scaled so that the update is of the order of a layer's output."""
    lora_a = torch.randn(NUM_ADAPTERS, len(rows) * RANK, k_size, device="cuda", generator=generator) / k_size ** 0.5
    lora_b = torch.randn(NUM_ADAPTERS, sum(rows), RANK, device="cuda", generator=generator) / RANK ** 0.5
    return lora_a.bfloat16(), lora_b.bfloat16()


def per_part(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, rows: tuple[int, ...],
             tokens: LoraTokens, scalings: torch.Tensor) -> None:
    """The delta as one fused call per part (P = 1 each): the launch count of the kernels before fusion."""
    start = 0
    for part, rows_of_part in enumerate(rows):
        lora_add_fused(y[:, start : start + rows_of_part], x, lora_a[:, part * RANK : (part + 1) * RANK],
                       lora_b[:, start : start + rows_of_part], (rows_of_part,), tokens, scalings)
        start += rows_of_part


def bench_layer(name: str, k_size: int, n_size: int, rows: tuple[int, ...], tokens_list: Sequence[int],
                generator: torch.Generator) -> list[dict]:
    adapter_bytes = NUM_ADAPTERS * RANK * (len(rows) * k_size + n_size) * 2
    adapter_sets = [stacked_adapters(k_size, rows, generator) for _ in range(copies_past_l2(adapter_bytes))]
    weights = [torch.randn(n_size, k_size, device="cuda", generator=generator, dtype=torch.bfloat16)
               for _ in range(copies_past_l2(k_size * n_size * 2))]
    scalings = torch.full((NUM_ADAPTERS,), ALPHA / RANK, device="cuda")
    results = []
    for num_tokens in tokens_list:
        x = torch.randn(num_tokens, k_size, device="cuda", generator=generator, dtype=torch.bfloat16)
        slots = torch.randint(0, NUM_ADAPTERS, (num_tokens,), device="cuda", generator=generator)
        tokens, no_tokens = LoraTokens.of(slots), LoraTokens.of(torch.full_like(slots, -1))
        y = torch.randn(num_tokens, n_size, device="cuda", generator=generator, dtype=torch.bfloat16)
        lora_s = seconds_per_call([lambda a=a, b=b: lora_add_fused(y, x, a, b, rows, tokens, scalings)
                                   for a, b in adapter_sets])
        per_part_s = seconds_per_call([lambda a=a, b=b: per_part(y, x, a, b, rows, tokens, scalings)
                                       for a, b in adapter_sets])
        base_s = seconds_per_call([lambda w=w: F.linear(x, w) for w in weights])
        base_rows_s = seconds_per_call([lambda a=a, b=b: lora_add_fused(y, x, a, b, rows, no_tokens, scalings)
                                        for a, b in adapter_sets])
        lora_a, lora_b = adapter_sets[0]
        fresh = torch.randn(num_tokens, n_size, device="cuda", generator=generator, dtype=torch.bfloat16)
        got, expected = fresh.clone(), fresh.clone()  # y has had the timed calls' updates added
        lora_add_fused(got, x, lora_a, lora_b, rows, tokens, scalings)
        lora_ref.lora_add_fused(expected, x, lora_a, lora_b, rows, tokens, scalings)
        tiles = tiles_for(num_tokens)
        row = {"layer": name, "k": k_size, "n": n_size, "parts": list(rows), "tokens": num_tokens,
               "tiles": asdict(tiles), "splits": shrink_splits(num_tokens, k_size, tiles),
               "expand_columns": expand_columns(num_tokens, n_size, tiles),
               "lora_us": lora_s * 1e6, "per_part_us": per_part_s * 1e6, "base_us": base_s * 1e6,
               "base_rows_us": base_rows_s * 1e6, "overhead": lora_s / base_s,
               "relative_error": ((got.float() - expected.float()).norm() / expected.float().norm()).item(),
               "bit_equal": (got == expected).float().mean().item()}
        row["ok"] = row["relative_error"] < ERROR_BOUND
        print(f"{name:8s} T={num_tokens:4d} splits={row['splits']:2d} lora {row['lora_us']:7.1f} us  "
              f"(per part {row['per_part_us']:7.1f})  base {row['base_us']:7.1f} us  (+{row['overhead']:5.1%})  "
              f"slot -1 only {row['base_rows_us']:5.1f} us  err {row['relative_error']:.1e} "
              f"bit-equal {row['bit_equal']:.3f}", flush=True)
        results.append(row)
    return results


def bench_steps(results: list[dict], tokens_list: Sequence[int], generator: torch.Generator) -> list[dict]:
    """Per token count: the step's sort and what LoRA adds to a NUM_LAYERS-layer step (all four layers timed)."""
    steps = []
    for num_tokens in tokens_list:
        slots = torch.randint(-1, NUM_ADAPTERS, (num_tokens,), device="cuda", generator=generator)
        sort_s = seconds_per_call([lambda: LoraTokens.of(slots)])
        rows = [row for row in results if row["tokens"] == num_tokens]
        step = {"tokens": num_tokens, "sort_us": sort_s * 1e6}
        if {row["layer"] for row in rows} == set(PROJECTIONS):
            step["step_lora_us"] = NUM_LAYERS * sum(row["lora_us"] for row in rows) + step["sort_us"]
            step["step_base_rows_us"] = NUM_LAYERS * sum(row["base_rows_us"] for row in rows) + step["sort_us"]
        print(f"T={num_tokens:4d} sort {step['sort_us']:5.1f} us  " + "  ".join(
            f"{key} {value:8.1f} us" for key, value in step.items() if key.startswith("step_")), flush=True)
        steps.append(step)
    return steps


def candidate_tiles(num_tokens: int) -> list[LoraTiles]:
    """The tiles the sweep tries at `num_tokens` tokens (14-27): `tiles_for`'s; the few-token path at 1, 2 and
    4 tokens per program (no more than the tokens, rounded up to a power of two) for each of SWEEP_K_CUTS at 2, 4
    and 8 warps, those that q|k|v runs as they are (`fit_registers`: no spilled registers); a wider expand and two
    stages for two of them; the `tl.dot` path's default and a shorter K cut of it; and the expand launched while
    the shrink runs (`pdl`) for `tiles_for`'s and the one-token tiles at 2 warps."""
    token_tile = 1 << (num_tokens - 1).bit_length()
    few = [LoraTiles(block_m=block_m, block_k=block_k, split_columns=columns, max_splits=splits, block_n=64,
                     num_warps=warps, num_stages=1)
           for block_m in (1, 2, 4) if block_m <= token_tile
           for block_k, columns, splits in SWEEP_K_CUTS for warps in (2, 4, 8) if block_m > 1 or warps < 8]
    few = [tiles for tiles in few if fit_registers(tiles, QKV_STACKED_BLOCK) == tiles]
    variants = [LoraTiles(block_m=1, block_k=128, split_columns=256, max_splits=16, block_n=128, num_warps=4,
                          num_stages=1),
                LoraTiles(block_m=1, block_k=64, split_columns=128, max_splits=32, block_n=64, num_warps=2,
                          num_stages=2)]
    dot = [LoraTiles(), LoraTiles(block_k=64, split_columns=128, max_splits=32, num_stages=2)]
    launched_early = [replace(tiles, pdl=True) for tiles in (tiles_for(num_tokens), *few)
                      if tiles.block_m == 1 and tiles.num_warps == 2]
    return list(dict.fromkeys([tiles_for(num_tokens), *few, *variants, *dot, *launched_early]))


def sweep_layer(name: str, k_size: int, n_size: int, rows: tuple[int, ...], generator: torch.Generator
                ) -> list[dict]:
    """Every candidate's time of `name`'s `lora_add_fused` in each of SWEEP_CASES."""
    adapter_bytes = NUM_ADAPTERS * RANK * (len(rows) * k_size + n_size) * 2
    adapter_sets = [stacked_adapters(k_size, rows, generator) for _ in range(copies_past_l2(adapter_bytes))]
    scalings = torch.full((NUM_ADAPTERS,), ALPHA / RANK, device="cuda")
    timings = []
    for num_tokens, num_adapters in SWEEP_CASES:
        x = torch.randn(num_tokens, k_size, device="cuda", generator=generator, dtype=torch.bfloat16)
        tokens = LoraTokens.of(torch.arange(num_tokens, device="cuda") % num_adapters)
        y = torch.randn(num_tokens, n_size, device="cuda", generator=generator, dtype=torch.bfloat16)
        fresh = torch.randn(num_tokens, n_size, device="cuda", generator=generator, dtype=torch.bfloat16)
        expected = fresh.clone()  # y has the timed calls' updates added
        lora_ref.lora_add_fused(expected, x, *adapter_sets[0], rows, tokens, scalings)
        for tiles in candidate_tiles(num_tokens):
            try:
                seconds = seconds_per_call([lambda a=a, b=b: lora_add_fused(y, x, a, b, rows, tokens, scalings,
                                                                             tiles) for a, b in adapter_sets])
                got = fresh.clone()
                lora_add_fused(got, x, *adapter_sets[0], rows, tokens, scalings, tiles)
                error = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
            except Exception as failure:  # e.g. a launch option the driver refuses: the others still get timed
                print(f"sweep {name} T={num_tokens} {tiles}: {failure!r:.300}", flush=True)
                seconds, error = float("nan"), float("inf")
            timings.append({"layer": name, "tokens": num_tokens, "adapters": num_adapters, "tiles": asdict(tiles),
                            "splits": shrink_splits(num_tokens, k_size, tiles), "us": seconds * 1e6,
                            "relative_error": error, "ok": error < ERROR_BOUND})
            if error >= ERROR_BOUND:
                print(f"sweep {name} T={num_tokens} {tiles}: relative error {error:.1e} (bound {ERROR_BOUND})")
        case = [timing["us"] for timing in timings if timing["tokens"] == num_tokens
                and timing["adapters"] == num_adapters]
        print(f"sweep {name:8s} T={num_tokens:3d} adapters={num_adapters}: {len(case)} tiles, "
              f"{min(case):6.1f}-{max(case):6.1f} us", flush=True)
    return timings


def sweep_summary(timings: list[dict]) -> list[dict]:
    """Per case: each candidate's time summed over the layers, the least one and `tiles_for`'s; prints the
    table (candidates as rows, cases as columns) and, per token count, the tiles of least time over its cases as
    kernels/lora_tiles.py's TILES_BY_TOKENS (to paste). A candidate whose result missed the reference at some
    layer is left out of that case."""
    def key(timing: dict) -> tuple[str, tuple]:
        return f"T={timing['tokens']} a={timing['adapters']}", tuple(timing["tiles"].values())

    missed = {key(timing) for timing in timings if not timing["ok"]}
    totals: dict[tuple, dict[str, float]] = {}
    for timing in timings:
        case, tiles = key(timing)
        if (case, tiles) not in missed:
            totals.setdefault(tiles, {}).setdefault(case, 0.0)
            totals[tiles][case] += timing["us"]
    cases = [f"T={tokens} a={adapters}" for tokens, adapters in SWEEP_CASES]
    fields = ", ".join(LoraTiles.__dataclass_fields__)
    print(f"sweep: us per call summed over {', '.join(PROJECTIONS)}; tiles ({fields})")
    print(f"{'tiles':40s}" + "".join(f"{case:>11s}" for case in cases))
    for tiles, per_case in totals.items():
        print(f"{str(tiles):40s}" + "".join(f"{per_case[case]:11.1f}" if case in per_case else f"{'-':>11s}"
                                             for case in cases))
    best = []
    for (num_tokens, _), case in zip(SWEEP_CASES, cases):
        timed = {tiles: per_case[case] for tiles, per_case in totals.items() if case in per_case}
        if not timed:
            continue
        fastest = min(timed, key=timed.get)
        default_us = timed.get(tuple(asdict(tiles_for(num_tokens)).values()))
        saving = None if default_us is None else NUM_LAYERS * (default_us - timed[fastest])
        best.append({"case": case, "best_tiles": dict(zip(LoraTiles.__dataclass_fields__, fastest)),
                     "best_us": timed[fastest], "default_us": default_us, "step_saving_us": saving})
        print(f"best {case:10s} {fastest} {timed[fastest]:7.1f} us (tiles_for {default_us} us: "
              f"{saving} us per {NUM_LAYERS}-layer step to gain)", flush=True)
    by_tokens = []  # per token count, the tiles of least time summed over its cases (16 tokens: 1 and 8 adapters)
    for num_tokens in sorted({tokens for tokens, _ in SWEEP_CASES}):
        own = [case for (tokens, _), case in zip(SWEEP_CASES, cases) if tokens == num_tokens]
        complete = {tiles: sum(per_case[case] for case in own) for tiles, per_case in totals.items()
                    if all(case in per_case for case in own)}
        if complete:
            by_tokens.append((num_tokens, LoraTiles(*min(complete, key=complete.get))))
    print(f"kernels/lora_tiles.py TILES_BY_TOKENS = {tuple(by_tokens)}", flush=True)
    return best


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON report")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="token counts to time")
    parser.add_argument("--layers", nargs="+", choices=PROJECTIONS, default=list(PROJECTIONS))
    parser.add_argument("--sweep", action="store_true",
                        help="only sweep the kernels' tiles at decode's few tokens (candidate_tiles, SWEEP_CASES)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import triton

    generator = torch.Generator(device="cuda").manual_seed(0)
    shapes, parts = projections(SHAPE), part_rows(SHAPE)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "shape": SHAPE, "num_adapters": NUM_ADAPTERS, "rank": RANK}
    if args.sweep:
        started = time.perf_counter()
        timings = [timing for name in args.layers
                   for timing in sweep_layer(name, *shapes[name], parts[name], generator)]
        report.update(sweep=sweep_summary(timings), timings=timings, seconds=time.perf_counter() - started,
                      error_bound=ERROR_BOUND, ok=all(timing["ok"] for timing in timings))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"swept in {report['seconds']:.0f} s; wrote {args.out}")
        return 0 if report["ok"] else 1
    results = [row for name in args.layers
               for row in bench_layer(name, *shapes[name], parts[name], args.tokens, generator)]
    steps = bench_steps(results, args.tokens, generator)
    report.update(error_bound=ERROR_BOUND, results=results, steps=steps, ok=all(row["ok"] for row in results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
