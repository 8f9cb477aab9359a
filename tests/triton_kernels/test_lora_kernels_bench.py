"""The pure-Python parts of the LoRA kernels' sweep (benchmarks/lora_kernels_gpu.py --sweep, which needs a GPU to
run): its candidates, and the choice per case of the tiles of least time summed over the layers, leaving out a
candidate whose result missed the reference."""

from __future__ import annotations

from dataclasses import asdict

from benchmarks.lora_kernels_gpu import (PROJECTIONS, QKV_STACKED_BLOCK, SWEEP_CASES, candidate_tiles, parse_args,
                                         sweep_summary)
from kernels.lora_tiles import DOT_BLOCK_M, LoraTiles, fit_registers, tiles_for

FAST = LoraTiles(block_m=1, block_k=64, split_columns=64, max_splits=64, block_n=64, num_warps=2, num_stages=1)
WRONG = LoraTiles(block_m=1, block_k=256, split_columns=256, max_splits=16, block_n=64, num_warps=4, num_stages=1)


def timing(tiles: LoraTiles, layer: str, num_tokens: int, us: float, ok: bool = True) -> dict:
    return {"layer": layer, "tokens": num_tokens, "adapters": 1, "tiles": asdict(tiles), "us": us, "ok": ok}


def test_candidates_are_distinct_fit_the_registers_and_include_the_default_and_the_dot_path():
    for num_tokens, _ in SWEEP_CASES:
        candidates = candidate_tiles(num_tokens)
        assert len(set(candidates)) == len(candidates) <= 30
        assert tiles_for(num_tokens) in candidates and LoraTiles() in candidates
        assert any(tiles.pdl for tiles in candidates)
        few = [tiles for tiles in candidates if tiles.block_m < DOT_BLOCK_M]
        assert all(fit_registers(tiles, QKV_STACKED_BLOCK) == tiles for tiles in few)
        assert all(tiles.block_m <= max(1, num_tokens) for tiles in few)


def test_the_best_tiles_have_the_least_time_over_the_layers_and_a_wrong_result_is_never_chosen():
    default = tiles_for(1)
    timings = [timing(tiles, layer, 1, us) for layer in PROJECTIONS
               for tiles, us in ((default, 5.0), (FAST, 4.0))]
    timings += [timing(WRONG, layer, 1, 1.0, ok=layer != "down") for layer in PROJECTIONS]
    best = {row["case"]: row for row in sweep_summary(timings)}["T=1 a=1"]
    assert best["best_tiles"] == asdict(FAST)
    assert (best["best_us"], best["default_us"]) == (16.0, 20.0)
    assert best["step_saving_us"] == 32 * 4.0


def test_sweep_is_a_flag():
    assert parse_args(["--out", "x.json", "--sweep"]).sweep
    assert not parse_args(["--out", "x.json"]).sweep
