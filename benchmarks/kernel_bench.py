"""Kernel benchmark on one GPU: the card's copy bandwidth, then every Triton kernel against its torch reference.

  PYTHONPATH=$PWD python benchmarks/kernel_bench.py [--sweep] [--skip-check] [--time-budget SECONDS]

1. Copy bandwidth: `dst.copy_(src)` of 1 GiB, bytes read + written per second; the yardstick for every
   memory-bound kernel below (measured in the same run, so clocks and card match).
2. Check: the interpreter test cases (tests/triton_kernels/attention_cases.py) and the elementwise
   kernels, compiled for this GPU, against the torch references in fp32 / bf16 / fp16.
3. Decode attention: bf16, 32 query / 8 KV heads, head_dim 128, block 16, random block tables into a
   pool twice the largest working set, batch 1/8/32/64/256 x context 1k/4k/8k, each variant (single pass,
   split-KV) under a CUDA graph. A graph holds several calls, each over its own random block tables, so
   the K/V a graph replay reads exceeds the L2 cache. Bandwidth = K/V bytes read / time per call.
4. Prefill/extend attention: fresh prefill and chunked extend, TFLOP/s (causal pairs only), against the
   reference and (fresh prefill) torch SDPA on the same shapes, dense.
5. Cache write, RMSNorm + residual, rotary, SiLU-and-mul at Llama-3.1-8B sizes: bytes moved / time.
6. The models' GEMMs (cuBLAS) at decode and prefill token counts against max(FLOPs, bytes) floors
   (benchmarks/gemm_floors.py).
`--sweep` (last, within --time-budget) times decode tile sizes, warps, stages, split counts, grid order.
Prints tables; writes kernel_bench.json to $OUT (or ./).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.gemm_floors import bench_gemms  # noqa: E402
from kernels import paged_attention_ref, rmsnorm_ref, rotary_ref, silu_and_mul_ref  # noqa: E402
from kernels import triton_rmsnorm, triton_rotary, triton_silu_and_mul  # noqa: E402
from kernels.attention_metadata import AttentionMetadata  # noqa: E402
from kernels.triton_backend import TritonAttentionBackend  # noqa: E402
from kernels.triton_decode_attention import choose_num_kv_splits, decode_attention  # noqa: E402
from kernels.triton_prefill_attention import prefill_attention  # noqa: E402
from pagedserve.testing import attention_cases  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DECODE_BATCHES = (1, 8, 32, 64, 256)
DECODE_CONTEXTS = (1024, 4096, 8192)
BYTES_PER_GRAPH = 512 << 20  # K/V one graph replay reads at least (L2 is 50 MB)
MAX_CALLS_PER_GRAPH = 32
# --sweep: (batch, context, splits, block_n, num_warps, num_stages, heads_fastest) around the defaults.
SWEEP_RUNS = (
    (1, 8192, 32, 64, 4, 2, True), (1, 8192, 32, 128, 4, 2, True), (1, 8192, 64, 64, 4, 2, True),
    (8, 4096, 8, 64, 4, 2, True), (8, 4096, 8, 128, 4, 2, True), (8, 4096, 4, 64, 4, 2, True),
    (16, 4096, 1, 128, 4, 2, True), (16, 4096, 2, 64, 4, 2, True), (16, 4096, 4, 64, 4, 2, True),
    (32, 4096, 1, 128, 4, 2, True), (32, 4096, 4, 64, 4, 2, True), (32, 4096, 8, 64, 4, 2, True),
    (64, 1024, 1, 128, 4, 2, True), (64, 1024, 1, 128, 4, 3, True), (64, 1024, 1, 128, 8, 2, True),
    (64, 4096, 1, 128, 4, 2, False), (64, 4096, 1, 128, 4, 2, True),
)
# --sweep, prefill: (block_n, num_warps, num_stages) on each PREFILL_CASES shape.
PREFILL_SWEEP = ((64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2), (128, 4, 2), (32, 4, 3))
# (name, sequences, context, new tokens each): fresh prefill and a chunked extend over a cached prefix.
PREFILL_CASES = (("fresh_prefill", 4, 2048, 2048), ("chunked_extend", 8, 4096, 512))
# Llama-3.1-8B sizes at 8192 tokens (a large prefill step).
ELEMENTWISE_TOKENS, HIDDEN_SIZE, INTERMEDIATE_SIZE = 8192, 4096, 14336
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def time_eager(fn, iters=10, warmup=2) -> float:
    """Seconds per call, CUDA events around `iters` back-to-back calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def time_graph(fn, replays=10) -> float:
    """Seconds per replay of a CUDA graph capturing `fn` (warmed up, i.e. compiled, on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_eager(graph.replay, iters=replays, warmup=2)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = time_eager(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() / seconds


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.float() - expected.float()).abs().max().item()


def is_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    tolerance = TOLERANCE[dtype]
    return torch.allclose(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


def check_attention() -> list[dict]:
    rows = []
    variants = [
        (torch.float32, 64, 4, 1), (torch.float32, 128, 6, 16), (torch.float32, 64, 1, 16),
        (torch.bfloat16, 128, 4, 1), (torch.bfloat16, 128, 4, 16), (torch.float16, 64, 4, None),
    ]
    for dtype, head_dim, group_size, splits in variants:
        query, kv_cache, metadata = attention_cases.make_case(
            attention_cases.MIXED, group_size, head_dim, dtype, num_padding_tokens=3, device="cuda"
        )
        scale = head_dim**-0.5
        output = TritonAttentionBackend(decode_kv_splits=splits).paged_attention(query, kv_cache, metadata, scale)
        expected = paged_attention_ref.paged_attention(query, kv_cache, metadata, scale)
        rows.append({"kernel": "attention_mixed", "dtype": str(dtype), "head_dim": head_dim,
                     "group_size": group_size, "splits": splits, "max_error": max_error(output, expected),
                     "ok": is_close(output, expected, dtype)})
    return rows


def check_elementwise() -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        generator = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(37, 1536, device="cuda", generator=generator).to(dtype)
        residual = torch.randn_like(hidden)
        weight = torch.randn(1536, device="cuda", generator=generator).to(dtype)
        pairs = {"rms_norm": (triton_rmsnorm.rms_norm(hidden, weight, 1e-6, residual),
                              rmsnorm_ref.rms_norm(hidden, weight, 1e-6, residual))}
        positions = torch.randint(0, 4096, (37,), device="cuda", generator=generator)
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
        freqs = torch.arange(4096, device="cuda").float()[:, None] * inv_freq[None, :]
        cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        query = torch.randn(37, 12, 128, device="cuda", generator=generator).to(dtype)
        key = torch.randn(37, 2, 128, device="cuda", generator=generator).to(dtype)
        pairs["rotary"] = (triton_rotary.rotary_embedding(positions, query, key, cos_sin_cache),
                           rotary_ref.rotary_embedding(positions, query, key, cos_sin_cache))
        gate_up = torch.randn(37, 2 * 8960, device="cuda", generator=generator).to(dtype)
        pairs["silu_and_mul"] = ((triton_silu_and_mul.silu_and_mul(gate_up),),
                                 (silu_and_mul_ref.silu_and_mul(gate_up),))
        for kernel, (got, want) in pairs.items():
            rows.append({"kernel": kernel, "dtype": str(dtype),
                         "max_error": max(max_error(a, b) for a, b in zip(got, want)),
                         "ok": all(is_close(a, b, dtype) for a, b in zip(got, want))})
    return rows


def decode_metadata(batch: int, context: int, pool_blocks: int, generator) -> AttentionMetadata:
    blocks_per_seq = context // BLOCK_SIZE
    block_tables = torch.randint(
        0, pool_blocks, (batch, blocks_per_seq), device="cuda", dtype=torch.int32, generator=generator
    )
    return AttentionMetadata(
        slot_mapping=(block_tables[:, -1].long() * BLOCK_SIZE + BLOCK_SIZE - 1),
        query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
        seq_lens=torch.full((batch,), context, device="cuda", dtype=torch.int32),
        block_tables=block_tables,
        block_size=BLOCK_SIZE,
        num_decode_seqs=batch,
    )


def kv_bytes(batch: int, context: int) -> int:
    return 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2  # K and V, bf16


def decode_calls(backend, query, kv_cache, metadatas):
    """One decode attention call per metadata (each its own block tables), as a graph body."""
    scale = HEAD_DIM**-0.5
    return lambda: [backend.paged_attention(query, kv_cache, m, scale) for m in metadatas]


def bench_decode(kv_cache, copy_bw: float) -> list[dict]:
    rows = []
    pool_blocks = kv_cache.shape[1]
    generator = torch.Generator(device="cuda").manual_seed(0)
    scale = HEAD_DIM**-0.5
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            calls = max(1, min(MAX_CALLS_PER_GRAPH, math.ceil(BYTES_PER_GRAPH / kv_bytes(batch, context))))
            metadatas = [decode_metadata(batch, context, pool_blocks, generator) for _ in range(calls)]
            query = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device="cuda", generator=generator).bfloat16()
            # The split column uses the split count the heuristic's formula gives this batch (>= 2).
            split_count = max(2, choose_num_kv_splits(batch, NUM_KV_HEADS, min_programs=1 << 30))
            row = {"batch": batch, "context": context, "calls_per_graph": calls,
                   "auto_splits": choose_num_kv_splits(batch, NUM_KV_HEADS), "split_count": split_count}
            for name, splits in (("single_pass", 1), ("split_kv", split_count)):
                seconds = time_graph(decode_calls(TritonAttentionBackend(splits), query, kv_cache, metadatas)) / calls
                row[f"{name}_us"] = seconds * 1e6
                row[f"{name}_tb_s"] = kv_bytes(batch, context) / seconds / 1e12
            output = TritonAttentionBackend().paged_attention(query, kv_cache, metadatas[0], scale)
            reference = lambda: paged_attention_ref.paged_attention(query, kv_cache, metadatas[0], scale)  # noqa: E731
            expected = reference()
            row["max_error_vs_reference"] = max_error(output, expected)
            ref_seconds = time_eager(reference, iters=1, warmup=0)
            row["reference_us"] = ref_seconds * 1e6
            row["reference_tb_s"] = kv_bytes(batch, context) / ref_seconds / 1e12
            auto = "single_pass" if row["auto_splits"] == 1 else "split_kv"
            row["auto_tb_s"] = row[f"{auto}_tb_s"]
            row["auto_fraction_of_copy"] = row["auto_tb_s"] * 1e12 / copy_bw
            rows.append(row)
            print(f"decode b={batch:4d} ctx={context:5d}  single {row['single_pass_tb_s']:.2f}  "
                  f"split {row['split_kv_tb_s']:.2f}  auto {row['auto_tb_s']:.2f} TB/s "
                  f"({row['auto_fraction_of_copy']:.0%} of copy)  ref {row['reference_tb_s']:.3f}  "
                  f"err {row['max_error_vs_reference']:.1e}", flush=True)
    return rows


def sweep_decode(kv_cache, deadline: float) -> list[dict]:
    """Decode tile configurations under graphs (direct decode_attention calls) until `deadline`."""
    rows = []
    generator = torch.Generator(device="cuda").manual_seed(1)
    cases = {}
    for batch, context, splits, block_n, num_warps, num_stages, heads_fastest in SWEEP_RUNS:
        if time.monotonic() > deadline:
            print("sweep stopped at the time budget", flush=True)
            break
        if (batch, context) not in cases:
            calls = max(1, min(MAX_CALLS_PER_GRAPH, math.ceil(BYTES_PER_GRAPH / kv_bytes(batch, context))))
            metadatas = [decode_metadata(batch, context, kv_cache.shape[1], generator) for _ in range(calls)]
            query = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device="cuda", generator=generator).bfloat16()
            cases[(batch, context)] = (metadatas, query, torch.zeros_like(query))
        metadatas, query, output = cases[(batch, context)]
        row = {"batch": batch, "context": context, "splits": splits, "block_n": block_n,
               "num_warps": num_warps, "num_stages": num_stages, "heads_fastest": heads_fastest}

        def run():
            for m in metadatas:
                decode_attention(query, kv_cache, m.query_start_loc, m.seq_lens, m.block_tables,
                                 HEAD_DIM**-0.5, output, splits, block_n, num_warps, num_stages, heads_fastest)

        try:
            row["tb_s"] = kv_bytes(batch, context) / (time_graph(run) / len(metadatas)) / 1e12
        except Exception as error:  # e.g. out of shared memory for one configuration
            row["error"] = repr(error)[:200]
        rows.append(row)
        print(f"sweep {row}", flush=True)
    return rows


def sweep_prefill(deadline: float) -> list[dict]:
    """Prefill tile configurations (direct prefill_attention calls, eager) until `deadline`."""
    rows = []
    generator = torch.Generator(device="cuda").manual_seed(4)
    for name, num_seqs, context, query_len in PREFILL_CASES:
        query, kv_cache, metadata = prefill_case(num_seqs, context, query_len, generator)
        output = torch.zeros_like(query)
        flops = 4 * num_seqs * sum(context - query_len + j + 1 for j in range(query_len)) * NUM_Q_HEADS * HEAD_DIM
        for block_n, num_warps, num_stages in PREFILL_SWEEP:
            if time.monotonic() > deadline:
                print("prefill sweep stopped at the time budget", flush=True)
                return rows
            row = {"case": name, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}
            try:
                seconds = time_eager(lambda: prefill_attention(
                    query, kv_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
                    HEAD_DIM**-0.5, output, query.shape[0], 64, block_n, num_warps, num_stages))
                row["tflop_s"] = flops / seconds / 1e12
            except Exception as error:  # e.g. out of shared memory for one configuration
                row["error"] = repr(error)[:200]
            rows.append(row)
            print(f"sweep {row}", flush=True)
    return rows


def prefill_case(num_seqs: int, context: int, query_len: int, generator):
    """Sequences each with `context` tokens of which the last `query_len` are new; K/V all cached."""
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = num_seqs * blocks_per_seq
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda",
                           generator=generator).bfloat16()
    block_tables = torch.randperm(num_blocks, device="cuda", generator=generator).to(torch.int32)
    block_tables = block_tables.view(num_seqs, blocks_per_seq)
    num_tokens = num_seqs * query_len
    metadata = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, device="cuda"),  # not read by attention
        query_start_loc=torch.arange(0, num_tokens + 1, query_len, device="cuda", dtype=torch.int32),
        seq_lens=torch.full((num_seqs,), context, device="cuda", dtype=torch.int32),
        block_tables=block_tables,
        block_size=BLOCK_SIZE,
        num_decode_seqs=0,
    )
    query = torch.randn(num_tokens, NUM_Q_HEADS, HEAD_DIM, device="cuda", generator=generator).bfloat16()
    return query, kv_cache, metadata


def bench_prefill() -> list[dict]:
    rows = []
    generator = torch.Generator(device="cuda").manual_seed(2)
    scale = HEAD_DIM**-0.5
    for name, num_seqs, context, query_len in PREFILL_CASES:
        query, kv_cache, metadata = prefill_case(num_seqs, context, query_len, generator)
        visible_pairs = num_seqs * sum(context - query_len + j + 1 for j in range(query_len))
        flops = 4 * visible_pairs * NUM_Q_HEADS * HEAD_DIM
        backend = TritonAttentionBackend()
        seconds = time_eager(lambda: backend.paged_attention(query, kv_cache, metadata, scale), iters=10)
        reference = lambda: paged_attention_ref.paged_attention(query, kv_cache, metadata, scale)  # noqa: E731
        error = max_error(backend.paged_attention(query, kv_cache, metadata, scale), reference())
        ref_seconds = time_eager(reference, iters=1, warmup=0)
        row = {"case": name, "seqs": num_seqs, "context": context, "query_len": query_len,
               "triton_tflop_s": flops / seconds / 1e12, "triton_ms": seconds * 1e3,
               "reference_tflop_s": flops / ref_seconds / 1e12, "max_error_vs_reference": error}
        if query_len == context:  # dense causal: torch SDPA (FlashAttention) as a speed yardstick
            dense_q = query.view(num_seqs, context, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)
            # K/V expanded to the query heads so SDPA takes its FlashAttention path.
            dense_k = torch.randn(num_seqs, NUM_Q_HEADS, context, HEAD_DIM, device="cuda").bfloat16()
            dense_v = torch.randn_like(dense_k)
            sdpa = lambda: F.scaled_dot_product_attention(dense_q, dense_k, dense_v, is_causal=True)  # noqa: E731
            row["sdpa_tflop_s"] = flops / time_eager(sdpa, iters=10) / 1e12
        rows.append(row)
        print(f"{name}: triton {row['triton_tflop_s']:.0f} TFLOP/s ({row['triton_ms']:.2f} ms), "
              f"sdpa {row.get('sdpa_tflop_s', float('nan')):.0f}, ref {row['reference_tflop_s']:.1f}, "
              f"err {error:.1e}", flush=True)
    return rows


def bench_elementwise(copy_bw: float) -> list[dict]:
    """Llama-3.1-8B sizes at 8192 tokens (a large prefill step), bf16."""
    tokens, hidden_size, intermediate = ELEMENTWISE_TOKENS, HIDDEN_SIZE, INTERMEDIATE_SIZE
    generator = torch.Generator(device="cuda").manual_seed(3)
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=generator).bfloat16()  # noqa: E731
    cases = []

    pool = torch.zeros(2, 2 * tokens, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(pool.shape[1] * BLOCK_SIZE, device="cuda", generator=generator)[:tokens]
    key, value = randn(tokens, NUM_KV_HEADS, HEAD_DIM), randn(tokens, NUM_KV_HEADS, HEAD_DIM)
    backend = TritonAttentionBackend()
    cases.append(("cache_write", 4 * key.numel() * 2,
                  lambda: backend.write_kv_cache(key, value, pool, slots),
                  lambda: paged_attention_ref.write_kv_cache(key, value, pool, slots)))

    hidden, residual, weight = randn(tokens, hidden_size), randn(tokens, hidden_size), randn(hidden_size)
    cases.append(("rms_norm_residual", 4 * hidden.numel() * 2,
                  lambda: triton_rmsnorm.rms_norm(hidden, weight, 1e-5, residual),
                  lambda: rmsnorm_ref.rms_norm(hidden, weight, 1e-5, residual)))

    positions = torch.randint(0, 8192, (tokens,), device="cuda", generator=generator)
    cos_sin_cache = torch.randn(8192, HEAD_DIM, device="cuda", generator=generator)  # values do not matter
    query, key_rot = randn(tokens, NUM_Q_HEADS, HEAD_DIM), randn(tokens, NUM_KV_HEADS, HEAD_DIM)
    cases.append(("rotary", 2 * (query.numel() + key_rot.numel()) * 2 + tokens * HEAD_DIM * 4,
                  lambda: triton_rotary.rotary_embedding(positions, query, key_rot, cos_sin_cache),
                  lambda: rotary_ref.rotary_embedding(positions, query, key_rot, cos_sin_cache)))

    gate_up = randn(tokens, 2 * intermediate)
    cases.append(("silu_and_mul", 3 * tokens * intermediate * 2,
                  lambda: triton_silu_and_mul.silu_and_mul(gate_up),
                  lambda: silu_and_mul_ref.silu_and_mul(gate_up)))

    rows = []
    for name, num_bytes, triton_fn, reference_fn in cases:
        seconds, ref_seconds = time_eager(triton_fn), time_eager(reference_fn)
        row = {"kernel": name, "bytes": num_bytes, "triton_us": seconds * 1e6,
               "triton_tb_s": num_bytes / seconds / 1e12, "reference_us": ref_seconds * 1e6,
               "reference_tb_s": num_bytes / ref_seconds / 1e12,
               "triton_fraction_of_copy": num_bytes / seconds / copy_bw}
        rows.append(row)
        print(f"{name:18s} triton {row['triton_tb_s']:.2f} TB/s ({row['triton_fraction_of_copy']:.0%} of copy, "
              f"{row['triton_us']:.0f} us)  reference {row['reference_tb_s']:.2f} TB/s", flush=True)
    return rows


def print_decode_table(rows: list[dict], copy_bw: float) -> None:
    print(f"\nDecode attention, bf16, 32/8 heads, head_dim 128, CUDA graphs; TB/s of K/V read "
          f"(copy bandwidth {copy_bw / 1e12:.2f} TB/s);\nsingle pass / split-KV x segments; * = variant the backend picks")
    print(f"{'batch':>6} " + " ".join(f"{'ctx ' + str(c):>22}" for c in DECODE_CONTEXTS))
    for batch in DECODE_BATCHES:
        cells = []
        for context in DECODE_CONTEXTS:
            row = next(r for r in rows if r["batch"] == batch and r["context"] == context)
            single, split = row["single_pass_tb_s"], row["split_kv_tb_s"]
            mark_single, mark_split = ("*", " ") if row["auto_splits"] == 1 else (" ", "*")
            cells.append(f"{single:5.2f}{mark_single} / {split:5.2f}{mark_split} x{row['split_count']}")
        print(f"{batch:>6} " + " ".join(f"{c:>22}" for c in cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time decode tile configurations (last)")
    parser.add_argument("--skip-check", action="store_true", help="skip the correctness check")
    parser.add_argument("--time-budget", type=float, default=270.0, help="seconds after which --sweep stops")
    args = parser.parse_args()
    started = time.monotonic()
    out_path = Path(os.environ.get("OUT", ".")) / "kernel_bench.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    summary: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    import triton

    def save(section: str, rows) -> None:  # after every section, so a run cut short keeps what it measured
        summary[section] = rows
        summary["seconds"] = time.monotonic() - started
        out_path.write_text(json.dumps(summary, indent=2))

    summary["triton"] = triton.__version__
    copy_bw = copy_bandwidth()
    save("copy_bandwidth_tb_s", copy_bw / 1e12)
    print(f"{summary['device']}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    if not args.skip_check:
        save("check", check_attention() + check_elementwise())
        for row in summary["check"]:
            print(f"check {row}", flush=True)
    largest = max(DECODE_BATCHES) * max(DECODE_CONTEXTS) // BLOCK_SIZE
    kv_cache = torch.empty(2, 2 * largest, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    for first in range(0, kv_cache.shape[1], 16384):  # chunks: keep each fill well under 2**31 elements
        kv_cache[:, first : first + 16384].normal_()
    save("decode", bench_decode(kv_cache, copy_bw))
    print_decode_table(summary["decode"], copy_bw)
    save("prefill", bench_prefill())
    save("elementwise", bench_elementwise(copy_bw))
    save("gemm", bench_gemms(copy_bw, time_eager))
    if args.sweep:
        save("decode_sweep", sweep_decode(kv_cache, started + args.time_budget))
        del kv_cache
        torch.cuda.empty_cache()
        save("prefill_sweep", sweep_prefill(started + args.time_budget))
    print(f"wrote {out_path} in {time.monotonic() - started:.0f} s")
    return 0 if all(row["ok"] for row in summary.get("check", [])) else 1


if __name__ == "__main__":
    raise SystemExit(main())
