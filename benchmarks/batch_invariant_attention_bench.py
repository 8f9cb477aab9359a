"""Decode attention time per step with --batch-invariant (kernels/triton_batch_invariant_attention.py) against the
default split-KV Triton backend, at a model's attention shape. One command on a lent GPU:

    python benchmarks/batch_invariant_attention_bench.py [--shape qwen2.5-1.5b] [--table-tokens 32768]

Cases: a lone decode at 512 and 4,096 keys of context, 256 decodes at 512 (and 64 at 4,096). Each backend's
`paged_attention` runs once per layer (each layer its own KV cache, as in serving, so K/V does not sit in L2)
inside one captured CUDA graph, as the decode graphs run it (worker_svc/decode_graphs.py); printed: ms per
step (all layers) and per layer. Block tables are `--table-tokens` wide, as the decode graphs' are
max-model-len wide (the split decodes' scratch and grid follow that width). The batch-invariant variants:
auto (what serving picks by the shape), (a) one program per decode merging its segments in registers, (b)
segments in programs of their own plus the merge kernel; (a), (b) and auto must give the same bits (checked,
printed). Other segment sizes (128, 512) give other (equally invariant) bits and are timed for choosing one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.model_shapes import SHAPES, head_dim  # noqa: E402
from kernels.attention_metadata import AttentionMetadata  # noqa: E402
from kernels.triton_backend import TritonAttentionBackend  # noqa: E402
from kernels.triton_batch_invariant_attention import BatchInvariantTritonBackend  # noqa: E402

BLOCK_SIZE = 16
CASES = ((1, 512), (1, 4096), (256, 512), (64, 4096))  # (decode sequences, context tokens)


def decode_step(num_seqs, context, num_heads, num_kv_heads, dim, layers, table_tokens, generator):
    """query [B, Hq, D], one KV cache per layer, and decode metadata with shuffled block tables."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    caches = [torch.randn((2, num_blocks, BLOCK_SIZE, num_kv_heads, dim), device="cuda", dtype=torch.bfloat16)
              for _ in range(layers)]
    tables = torch.zeros((num_seqs, max(table_tokens // BLOCK_SIZE, blocks_per_seq)), dtype=torch.int32)
    tables[:, :blocks_per_seq] = torch.randperm(num_blocks, generator=generator).view(num_seqs, blocks_per_seq)
    metadata = AttentionMetadata(
        slot_mapping=torch.full((num_seqs,), -1, device="cuda"),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((num_seqs,), context, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(), block_size=BLOCK_SIZE, num_decode_seqs=num_seqs)
    query = torch.randn((num_seqs, num_heads, dim), generator=generator).to("cuda", torch.bfloat16)
    return query, caches, metadata


def step_ms(backend, query, caches, metadata, scale, repeats=20) -> tuple[float, torch.Tensor]:
    """ms of one captured step (every layer's paged_attention), and layer 0's output."""
    def step():
        return [backend.paged_attention(query, cache, metadata, scale) for cache in caches]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()  # compiles, and warms the allocator outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats, outputs[0].clone()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--table-tokens", type=int, default=32768, help="block-table width in tokens")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's")
    args = parser.parse_args()
    s = SHAPES[args.shape]
    heads, kv_heads, dim = s["num_attention_heads"], s["num_key_value_heads"], head_dim(args.shape)
    layers = args.layers or s["num_hidden_layers"]
    print(f"{args.shape}: {heads} q heads / {kv_heads} kv heads, head dim {dim}, {layers} layers, bf16, "
          f"tables {args.table_tokens} tokens wide, {torch.cuda.get_device_name(0)}", flush=True)
    backends = {
        "default split-KV (TritonAttentionBackend)": TritonAttentionBackend(),
        "batch-invariant auto": BatchInvariantTritonBackend(),
        "batch-invariant (a) in registers": BatchInvariantTritonBackend(split_decodes=False),
        "batch-invariant (b) split": BatchInvariantTritonBackend(split_decodes=True),
        "batch-invariant (b) split, segment 128": BatchInvariantTritonBackend(segment=128, split_decodes=True),
        "batch-invariant (b) split, segment 512": BatchInvariantTritonBackend(segment=512, split_decodes=True),
    }
    failed = False
    for num_seqs, context in CASES:
        generator = torch.Generator().manual_seed(0)
        query, caches, metadata = decode_step(num_seqs, context, heads, kv_heads, dim, layers, args.table_tokens,
                                              generator)
        results = {}
        for name, backend in backends.items():
            ms, output = step_ms(backend, query, caches, metadata, dim ** -0.5)
            results[name] = (ms, output)
        baseline = results["default split-KV (TritonAttentionBackend)"][0]
        print(f"-- {num_seqs} decode(s) x {context} context", flush=True)
        for name, (ms, _) in results.items():
            print(f"  {name:42s} {ms:8.4f} ms/step  {1000 * ms / layers:8.2f} us/layer  {ms / baseline:5.2f}x default")
        same = [torch.equal(results["batch-invariant auto"][1], results[name][1])
                for name in ("batch-invariant (a) in registers", "batch-invariant (b) split")]
        print(f"  auto, (a) and (b) give the same bits: {all(same)}", flush=True)
        failed |= not all(same)
        del caches
        torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
