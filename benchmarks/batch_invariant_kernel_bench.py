"""Where `--batch-invariant` loses time on a GPU: the batch-invariant linear at candidate tiles against cuBLAS
(F.linear), at a shape's layer sizes. One command on a lent GPU:

    python benchmarks/batch_invariant_kernel_bench.py --decode [--tokens N ...] [--tiles 64,64,128,4,3,tma ...]
    python benchmarks/batch_invariant_kernel_bench.py --shape qwen2.5-1.5b [--tokens N ...] [--json FILE]

`--decode` (what serving's ROW_TILES were chosen by): every linear of a forward pass captured in a CUDA graph
per (tile, rows) and timed by replays, so only device time counts, each tile checked for serving's bits. The
default mode times CANDIDATES eagerly per (layer, tokens), back-to-back launches: at a decode's few rows that
measures Triton's launch overhead more than the kernel, so it is for prefill-sized token counts; "invariant"
there means row 0 of a 1-row product has the same bits as the same row at random positions among 3, 64, 257
and 2,048 rows (tests/triton_kernels' check). A tile is (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, tma])
(kernels/triton_batch_invariant_matmul.py's `Tile`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.kernel_bench import time_graph  # noqa: E402
from benchmarks.model_shapes import SHAPES, head_dim  # noqa: E402
from kernels.triton_batch_invariant_matmul import TILE, Tile, linear, tile_by_rows  # noqa: E402

CANDIDATES = [TILE, (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 4),
              (128, 128, 64, 4, 3), (128, 64, 128, 4, 3), (64, 128, 128, 4, 3), (128, 128, 128, 8, 3),
              (256, 128, 64, 8, 3), (64, 64, 128, 4, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4)]
TOKENS = (1, 64, 256, 2048, 16384)


def layer_sizes(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer of one decoder layer, and the LM head."""
    s = SHAPES[shape]
    hidden, heads, kv_heads, d = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"], head_dim(shape)
    inter = s["intermediate_size"]
    return {"qkv": ((heads + 2 * kv_heads) * d, hidden), "o": (hidden, heads * d), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), "lm_head": (s["vocab_size"], hidden)}


def rows_invariant(fn, full: torch.Tensor, batch_sizes=(1, 3, 64, 257, 2048)) -> bool | str:
    """True when rows 0 and last of `full` have the same bits in fn(full) and placed at random positions among
    random rows in batches of each size (tests/triton_kernels' check, which benchmarks may not import)."""
    expected = fn(full)
    generator = torch.Generator().manual_seed(0)
    for batch_size in batch_sizes:
        for row in (0, full.shape[0] - 1):
            position = int(torch.randint(batch_size, (1,), generator=generator))
            batch = torch.randn((batch_size,) + full.shape[1:], generator=generator).to(full.device, full.dtype)
            batch[position] = full[row]
            if not torch.equal(fn(batch)[position], expected[row]):
                return f"row {row} differs at batch size {batch_size}"
    return True


def tokens_of(layer: str, tokens: tuple[int, ...] = TOKENS) -> tuple[int, ...]:
    """The LM head sees only the sampled rows (at most a decode batch), the other layers every token."""
    return tuple(t for t in tokens if t <= 256) if layer == "lm_head" else tokens


def time_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


DECODE_TOKENS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048)
# Tiles tried on every row count (BLOCK_M 16 and 32 run the pre-Hopper MMA, 64 and up Hopper's).
DECODE_TILES = ((16, 32, 256, 4, 4), (32, 32, 256, 4, 4), (64, 32, 128, 4, 4), (64, 64, 64, 4, 4),
                (64, 64, 128, 4, 3), (128, 64, 64, 4, 4), (128, 64, 128, 8, 3), (128, 128, 64, 8, 3),
                (128, 128, 64, 8, 4), (256, 64, 64, 8, 3), (256, 128, 64, 8, 3), (128, 256, 64, 8, 3))
# Tiles also tried with their loads through the tensor memory accelerator (`Tile(..., tma=True)`).
TMA_TILES = ((16, 32, 256, 4, 4), (32, 32, 256, 4, 4), (64, 32, 128, 4, 4), (64, 64, 128, 4, 3),
             (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 3),
             (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3))


def tile_of(text: str) -> Tile:
    """'64,64,128,4,3,tma' -> Tile(64, 64, 128, 4, 3, tma=True)."""
    parts = text.split(",")
    return Tile(*(int(p) for p in parts[:5]), tma="tma" in parts[5:])


def decode_variants(tiles: list[Tile] | None = None) -> dict[str, Callable]:
    """The batch-invariant linear's ways for a step's rows: name -> fn(hidden, weight): "serving" (the tiles
    serving picks by the rows, `tile_by_rows`) and each tile (default: DECODE_TILES, TMA_TILES with TMA
    loads) for every row count."""
    if tiles is None:
        tiles = [Tile(*tile) for tile in DECODE_TILES] + [Tile(*tile, tma=True) for tile in TMA_TILES]
    variants = {"cublas": F.linear, "serving": partial(linear, tile=tile_by_rows)}
    for tile in tiles:
        variants[" ".join(str(v) for v in tile[:5]) + (" tma" if tile.tma else "")] = partial(linear, tile=tile)
    return variants


def decode_step_linears(shape: str, rows_list: tuple[int, ...] = DECODE_TOKENS,
                        tiles: list[Tile] | None = None) -> dict:
    """Every linear of one forward pass (each layer its own weights, as in a model: nothing stays in L2 from
    the layer before) plus the LM head, captured in one CUDA graph per (way, rows) and timed by replays: the
    device time a decode step spends in them, launch gaps inside a graph included, the host's launches not.
    Also whether each way gives the bits of "serving" on every layer's output at 1, 33 and 300 rows."""
    sizes = layer_sizes(shape)
    layers = SHAPES[shape]["num_hidden_layers"]
    weights = [{name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
                for name, (n, k) in sizes.items() if name != "lm_head"} for _ in range(layers)]
    n, k = sizes["lm_head"]
    lm_head = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    results: dict = {"shape": shape, "device": torch.cuda.get_device_name(0), "ms": {}, "same_bits": {}}
    variants = decode_variants(tiles)
    for rows in rows_list:
        # The LM head sees only the sampled rows (at most a decode batch's).
        inputs = {name: torch.randn(min(rows, 256) if name == "lm_head" else rows, k, device="cuda",
                                    dtype=torch.bfloat16) for name, (n, k) in sizes.items()}
        for way, fn in variants.items():
            def step(fn=fn, inputs=inputs):
                for layer in weights:
                    for name, weight in layer.items():
                        fn(inputs[name], weight)
                fn(inputs["lm_head"], lm_head)
            try:
                results["ms"][f"{way}@{rows}"] = time_graph(step, replays=20) * 1e3
            except Exception as error:  # noqa: BLE001 - a configuration that does not compile or fit is reported
                results["ms"][f"{way}@{rows}"] = repr(error)[:200]
        line = {way: results["ms"][f"{way}@{rows}"] for way in variants}
        print(f"{rows:4d} rows:", "  ".join(f"{w} {v:.3f}" if isinstance(v, float) else f"{w} {v}"
                                          for w, v in line.items()), flush=True)
    for way, fn in variants.items():
        if way == "cublas":
            continue
        same = True
        for rows in (1, 33, 300):
            for name, weight in list(weights[0].items()) + [("lm_head", lm_head)]:
                x = torch.randn(rows, weight.shape[1], device="cuda", dtype=torch.bfloat16)
                expected = variants["serving"](x, weight)
                same = same and all(torch.equal(fn(x, weight), expected) for _ in range(3))
        results["same_bits"][way] = same
    print("same bits as 'serving':", results["same_bits"], flush=True)
    best = {}
    for rows in rows_list:
        timed = {way: results["ms"][f"{way}@{rows}"] for way in variants if way != "cublas"}
        timed = {way: ms for way, ms in timed.items() if isinstance(ms, float)}
        way = min(timed, key=timed.get)
        best[rows] = {"way": way, "ms": timed[way], "over_cublas": timed[way] / results["ms"][f"cublas@{rows}"],
                      "serving_over_cublas": timed["serving"] / results["ms"][f"cublas@{rows}"]}
        print(rows, "rows: best", best[rows], flush=True)
    results["best"] = best
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--json", default=None)
    parser.add_argument("--tokens", type=int, nargs="*", default=None,
                        help="token counts compared (default: all; with --decode, its row counts)")
    parser.add_argument("--tiles", nargs="*", default=None,
                        help="--decode's tiles, each BLOCK_M,BLOCK_N,BLOCK_K,warps,stages[,tma] (default: all)")
    parser.add_argument("--decode", action="store_true",
                        help="only a forward pass's linears in CUDA graphs, per tile and row count "
                             "(decode_step_linears)")
    args = parser.parse_args()
    if args.decode:
        tiles = [tile_of(text) for text in args.tiles] if args.tiles else None
        results = decode_step_linears(args.shape, tuple(args.tokens or DECODE_TOKENS), tiles)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return 0
    sizes = layer_sizes(args.shape)
    layers = SHAPES[args.shape]["num_hidden_layers"]
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for name, (n, k) in sizes.items()}
    results: dict = {"shape": args.shape, "device": torch.cuda.get_device_name(0), "cublas_ms": {}, "configs": {}}
    counts = tuple(args.tokens or TOKENS)
    for name, weight in weights.items():
        for tokens in tokens_of(name, counts):
            x = torch.randn(tokens, weight.shape[1], device="cuda", dtype=torch.bfloat16)
            results["cublas_ms"][f"{name}@{tokens}"] = time_ms(lambda: F.linear(x, weight))
    probe = torch.randn(257, weights["gate_up"].shape[1], device="cuda", dtype=torch.bfloat16)
    outputs = {}  # which configurations give the same bits (may the row tile change with the batch?)
    for tile in CANDIDATES:
        entry: dict = {"ms": {}}
        try:
            for name, weight in weights.items():
                for tokens in tokens_of(name, counts):
                    x = torch.randn(tokens, weight.shape[1], device="cuda", dtype=torch.bfloat16)
                    entry["ms"][f"{name}@{tokens}"] = time_ms(lambda: linear(x, weight, tile=Tile(*tile)))
            full = torch.randn(2048, weights["gate_up"].shape[1], device="cuda", dtype=torch.bfloat16)
            entry["invariant"] = rows_invariant(lambda rows: linear(rows, weights["gate_up"], tile=Tile(*tile)),
                                                full)
            outputs[str(tile)] = linear(probe, weights["gate_up"], tile=Tile(*tile))
        except Exception as error:  # noqa: BLE001 - a configuration that does not compile or fit is reported
            entry["error"] = repr(error)[:300]
            results["configs"][str(tile)] = entry
            print(tile, entry["error"], flush=True)
            continue
        # One forward pass's linear time: every decoder layer's four plus the LM head (on the sampled rows).
        for tokens in {256, 16384} & set(counts):
            ours = layers * sum(entry["ms"][f"{n}@{tokens}"] for n in sizes if n != "lm_head")
            cublas = layers * sum(results["cublas_ms"][f"{n}@{tokens}"] for n in sizes if n != "lm_head")
            entry[f"forward_linear_ms@{tokens}"] = ours
            entry[f"over_cublas@{tokens}"] = ours / cublas
        results["configs"][str(tile)] = entry
        print(tile, "invariant" if entry["invariant"] is True else entry["invariant"],
              {k: round(v, 3) for k, v in entry.items() if k.startswith(("over", "forward"))}, flush=True)
    for tokens in counts:
        print(f"cublas forward linear ms @{tokens}:",
              layers * sum(results["cublas_ms"][f"{n}@{tokens}"] for n in sizes if n != "lm_head"))
    names = list(outputs)
    results["same_bits"] = [[a, b] for i, a in enumerate(names) for b in names[i + 1:]
                            if torch.equal(outputs[a], outputs[b])]
    print("configurations with the same bits:", results["same_bits"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
