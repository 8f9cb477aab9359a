"""The pure-Python parts of the FP8 linear benchmark (benchmarks/fp8_linear_gpu.py, which needs a GPU to run): the
weight bytes a call reads and the choice of one tile configuration per projection from the few-row timings."""

from __future__ import annotations

from benchmarks.fp8_linear_gpu import _weight_bytes, best_tiles


def test_weight_bytes_count_float8_weights_and_float32_scales():
    assert _weight_bytes(4096, 6144) == 4096 * 6144 + 4 * 6144


def _config(block_n: int, us: float) -> dict:
    return {"tiles": {"block_m": 16, "block_n": block_n, "block_k": 128, "warps": 4, "stages": 3}, "us": us}


def test_best_tiles_are_the_least_time_summed_over_row_counts_per_projection():
    few_rows = [
        {"projection": "qkv", "rows": 1, "configs": [_config(32, 10.0), _config(64, 12.0)]},
        {"projection": "qkv", "rows": 16, "configs": [_config(32, 20.0), _config(64, 15.0)]},  # 64: 27 < 30
        {"projection": "o", "rows": 1, "configs": [_config(32, 5.0), _config(64, 6.0)]},
    ]
    best = best_tiles(few_rows)
    assert best["qkv"] == {"tiles": _config(64, 0)["tiles"], "total_us": 27.0}
    assert best["o"] == {"tiles": _config(32, 0)["tiles"], "total_us": 5.0}
