"""Summarizes a tensor-parallel scaling run (the files benchmarks/tp_scaling_gpu.sh writes) into
tp_scaling.json and tp_scaling.png beside them: W1 and lone-request TPOT per shape and tensor-parallel size, the
ratios issue 17 sets targets for (W1 at -tp 2 >= 1.7x -tp 1, TPOT <= 0.65x), where a decode step's GPU time goes,
and the all-reduce's latency by size. Runs anywhere (no GPU).

    python benchmarks/tp_scaling.py benchmarks/results/tensor_parallel/tp_scaling_h100x2
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

W1_TARGET, TPOT_TARGET = 1.7, 0.65


def _load(directory: Path, pattern: str) -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(directory.glob(pattern))}


def summarize(directory: Path) -> dict:
    runs = {}
    for stem, report in _load(directory, "w1_*.json").items():
        engine = report["runs"]["pagedserve"]
        runs[stem] = {"shape": report["shape"], "tensor_parallel_size": report.get("tensor_parallel_size", 1),
                      "output_tokens_per_s": engine["output_tokens_per_s"],
                      "output_tokens_per_s_per_gpu": engine["output_tokens_per_s_per_gpu"],
                      "fraction_of_floor": report["ratios"]["pagedserve_fraction_of_floor"],
                      "tpot_median_ms": engine["tpot_median_ms"], "device": report["device"]}
    summary: dict = {"w1": runs}
    one, two = runs.get("w1_llama-3.1-8b"), runs.get("w1_llama-3.1-8b_tp2")
    if one and two:
        w1 = two["output_tokens_per_s"] / one["output_tokens_per_s"]
        tpot = two["tpot_median_ms"] / one["tpot_median_ms"]
        summary["llama-3.1-8b_tp2_over_tp1"] = {
            "w1": w1, "w1_target": W1_TARGET, "w1_met": w1 >= W1_TARGET,
            "tpot": tpot, "tpot_target": TPOT_TARGET, "tpot_met": tpot <= TPOT_TARGET}
    summary["decode_steps"] = {stem.removeprefix("decode_step_"): {
        key: report[key] for key in ("decode_step_wall_ms", "gpu_kernel_ms_per_step", "collective_ms_per_step",
                                     "collective_share_of_gpu_time", "collective_share_of_wall_time")}
        for stem, report in _load(directory, "decode_step_*.json").items()}
    summary["all_reduce"] = next(iter(_load(directory, "all_reduce_*.json").values()), None)
    summary["correctness"] = {stem: {key: report.get(key) for key in ("prefill_ok", "greedy_ok", "greedy_agree",
                                                                        "hf_one_bit_changed_greedy_agree", "checks")
                                     if key in report}
                              for stem, report in _load(directory, "gpu_*.json").items()}
    return summary


def draw(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (w1_axis, step_axis, reduce_axis) = plt.subplots(1, 3, figsize=(15, 4.2))
    names = list(summary["w1"])
    labels = [name.removeprefix("w1_") for name in names]
    w1_axis.bar(labels, [summary["w1"][n]["output_tokens_per_s"] for n in names], color="tab:blue")
    for x, name in enumerate(names):
        run = summary["w1"][name]
        w1_axis.text(x, run["output_tokens_per_s"], f"{run['output_tokens_per_s']:,.0f}\nTPOT {run['tpot_median_ms']:.2f} ms",
                     ha="center", va="bottom", fontsize=8)
    w1_axis.margins(y=0.15)
    w1_axis.set_ylabel("W1 output tokens / s")
    w1_axis.set_title("W1 by shape and -tp")
    w1_axis.tick_params(axis="x", labelsize=8)
    steps = summary["decode_steps"]
    step_names = sorted(steps)
    kernels = [steps[n]["gpu_kernel_ms_per_step"] - steps[n]["collective_ms_per_step"] for n in step_names]
    collectives = [steps[n]["collective_ms_per_step"] for n in step_names]
    step_axis.bar(step_names, kernels, label="other kernels", color="tab:gray")
    step_axis.bar(step_names, collectives, bottom=kernels, label="collectives", color="tab:red")
    step_axis.margins(y=0.1)
    step_axis.set_ylabel("GPU ms per decode step (8B shape)")
    step_axis.set_title("decode step: batch, -tp, all-reduce")
    step_axis.tick_params(axis="x", labelsize=7, rotation=20)
    step_axis.legend(fontsize=8)
    reduce = summary["all_reduce"]
    if reduce:
        sizes = [row["bytes"] for row in reduce["sizes"]]
        for key in ("nccl_us", "symm_one_shot_us", "symm_two_shot_us", "tensor_parallel_us"):
            points = [(row["bytes"], row[key]) for row in reduce["sizes"] if key in row]
            reduce_axis.plot(*zip(*points), marker="o", label=key.removesuffix("_us"))
        reduce_axis.set_xscale("log", base=2)
        reduce_axis.set_yscale("log")
        reduce_axis.set_xticks(sizes[::2])
        reduce_axis.set_xlabel("bytes (bf16, hidden 4096)")
        reduce_axis.set_ylabel("us per all-reduce (CUDA graph)")
        reduce_axis.set_title(f"all-reduce, {reduce['world_size']} x {reduce['device']}", fontsize=9)
        reduce_axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    directory = Path(sys.argv[1])
    summary = summarize(directory)
    (directory / "tp_scaling.json").write_text(json.dumps(summary, indent=2) + "\n")
    draw(summary, directory / "tp_scaling.png")
    print(json.dumps(summary.get("llama-3.1-8b_tp2_over_tp1"), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
