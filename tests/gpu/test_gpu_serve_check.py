"""The served path on a GPU gives transformers' greedy tokens exactly in float32 (benchmarks/gpu_serve_check.py's
float32 runs): 16 concurrent requests through the real processes with a profiled KV pool, and again with a pool
of 12 blocks that preempts by swapping to pinned host memory; decode steps replay CUDA graphs and steps with
prefill piecewise ones, so this holds the graphs to transformers' tokens too."""

from __future__ import annotations

from benchmarks import gpu_serve_check


def test_served_float32_tokens_equal_transformers_greedy_tokens(tmp_path):
    checks = gpu_serve_check.run_checks(tmp_path, gpu_serve_check.FLOAT32_RUNS)
    failed = {name: check for name, check in checks.items() if not check["passed"]}
    assert not failed, f"not token-exact (or blocks left in use): {failed}"
    assert all(check["mixed_step_graphs"] for check in checks.values()), "steps with prefill ran eagerly"
    assert checks["float32_swap_preemption"]["swapped_out_blocks"] > 0, "the small pool never swapped"
