"""Decode attention over an fp8 KV pool against a bf16 one on one GPU (issue 36: `--kv-cache-dtype fp8` should
read half the bytes in about half the time). Llama-3.1-8B heads (32 query / 8 KV, head_dim 128, block 16),
random block tables, each case under a CUDA graph holding enough calls to exceed L2 (kernel_bench.py's method).
For each (batch, context): bf16 at the defaults, fp8 at the defaults and over a few tile configurations
(block_n, num_warps, num_stages). Time per call, and K/V bytes read per second.

    PYTHONPATH=$PWD python benchmarks/fp8_kv_attention_gpu.py     # writes fp8_kv_attention.json to $OUT
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.kernel_bench import (BLOCK_SIZE, BYTES_PER_GRAPH, HEAD_DIM, MAX_CALLS_PER_GRAPH,  # noqa: E402
                                     NUM_KV_HEADS, NUM_Q_HEADS, copy_bandwidth, decode_metadata, time_graph)
from kernels.kv_quant import FP8_KV_DTYPE, KVScales  # noqa: E402
from kernels.triton_decode_attention import choose_num_kv_splits, decode_attention  # noqa: E402

CASES = ((256, 640), (256, 2048), (64, 4096), (8, 8192))
FP8_CONFIGS = ((None, 4, 2), (64, 4, 2), (128, 8, 2), (64, 8, 2), (128, 4, 3), (64, 4, 3))
SCALES = KVScales(k=0.5, v=2.0)  # not 1: the scaled path is the one timed


def time_case(query, pool, metadatas, splits, config, scales) -> float:
    output = torch.zeros_like(query)
    block_n, num_warps, num_stages = config

    def run():
        for m in metadatas:
            decode_attention(query, pool, m.query_start_loc, m.seq_lens, m.block_tables, HEAD_DIM**-0.5, output,
                             splits, block_n, num_warps, num_stages, kv_scales=scales)

    return time_graph(run) / len(metadatas)


def main() -> int:
    generator = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = copy_bandwidth()
    largest = max(batch * context for batch, context in CASES) // BLOCK_SIZE
    bf16_pool = torch.empty(2, 2 * largest, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    for first in range(0, bf16_pool.shape[1], 16384):
        bf16_pool[:, first : first + 16384].normal_(generator=generator)
    fp8_pool = bf16_pool.to(FP8_KV_DTYPE)
    rows = []
    for batch, context in CASES:
        values = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM
        calls = max(1, min(MAX_CALLS_PER_GRAPH, math.ceil(BYTES_PER_GRAPH / (2 * values))))
        metadatas = [decode_metadata(batch, context, bf16_pool.shape[1], generator) for _ in range(calls)]
        query = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device="cuda", generator=generator).bfloat16()
        splits = choose_num_kv_splits(batch, NUM_KV_HEADS)
        runs = [("bf16", bf16_pool, (None, 4, 2), KVScales()), *(("fp8", fp8_pool, c, SCALES) for c in FP8_CONFIGS)]
        for name, pool, config, scales in runs:
            row = {"batch": batch, "context": context, "splits": splits, "kv": name, "block_n": config[0],
                   "num_warps": config[1], "num_stages": config[2]}
            try:
                seconds = time_case(query, pool, metadatas, splits, config, scales)
                row.update(us=seconds * 1e6, tb_s=values * pool.element_size() / seconds / 1e12,
                           fraction_of_copy=values * pool.element_size() / seconds / copy_bw)
            except Exception as error:  # e.g. out of shared memory for one configuration
                row["error"] = repr(error)[:200]
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", ".")) / "fp8_kv_attention.json"
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "copy_tb_s": copy_bw / 1e12, "rows": rows},
                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
