"""The pure-Python parts of the W4A16 GEMM benchmark (benchmarks/wna16_gemm_gpu.py, which needs a GPU to run):
the bytes a call must move, the number of weight copies that keep a graph's reads out of L2, and its arguments."""

from __future__ import annotations

import pytest

from benchmarks.wna16_gemm_gpu import BYTES_PER_GRAPH, MAX_COPIES, ROWS, bytes_moved, copies_past_l2, parse_args


def test_bytes_moved_counts_packed_weights_scales_x_and_y():
    # Llama-3.1-8B qkv, one row: 4096 x 6144 nibbles, 32 x 6144 bf16 scales, 4096 + 6144 bf16 values in and out.
    assert bytes_moved(1, 4096, 6144, 4, 128) == 4096 * 6144 // 2 + 32 * 6144 * 2 + (4096 + 6144) * 2
    assert bytes_moved(16, 14336, 4096, 8, 128, has_zeros=True) == \
        14336 * 4096 + 2 * 112 * 4096 * 2 + 16 * (14336 + 4096) * 2


@pytest.mark.parametrize("num_bytes,copies", [(12_996_608, 21), (BYTES_PER_GRAPH, 1), (4 * BYTES_PER_GRAPH, 1),
                                              (1 << 20, MAX_COPIES)])
def test_a_graph_cycles_through_enough_copies_to_read_past_l2(num_bytes, copies):
    assert copies_past_l2(num_bytes) == copies


def test_arguments_default_to_the_briefed_rows_and_every_projection(tmp_path):
    args = parse_args(["--out", str(tmp_path / "out.json")])
    assert args.rows == list(ROWS) == [1, 2, 4, 8, 16, 64, 256]
    assert args.projections == ["qkv", "o", "gate_up", "down"]
    assert parse_args(["--out", "x.json", "--rows", "3", "--projections", "down"]).rows == [3]
    with pytest.raises(SystemExit):
        parse_args([])  # --out is required
