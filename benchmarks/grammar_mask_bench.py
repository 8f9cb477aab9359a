"""Host cost of constrained decoding per step, llguidance (what the workers run) against xgrammar (vLLM's
default engine): the first use of a schema (grammar build and matchers) and the allowed-token bitmask of 8 rows
per step, each row walking its own random valid path through one nested JSON schema, over SmolLM2's tokenizer
(49152 tokens). CPU only; xgrammar is not a dependency (it imports torch, which the scheduler must not):

    pip install --target /tmp/xgr --no-deps xgrammar==0.2.8 apache-tvm-ffi
    PYTHONPATH=/tmp/xgr python -m benchmarks.grammar_mask_bench

Why the per-step figure matters: the workers fill the masks on the host while the step's forward pass runs on
the GPU, so a mask cheaper than the forward pass costs no throughput. `--w1 [--schema extraction|bounded]
[--tokenizer DIR]` measures that directly for benchmarks/structured_outputs_gpu.py's workload: 256 rows of one
of its schemas, the worker's llguidance thread count, masks as wide as the model's vocabulary (run it on the
GPU host: the answer depends on its cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler_svc.text.tokenizer_loading import load_tokenizer
from service_runtime.model_source import resolve_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                     "zip": {"type": "integer"}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
ROWS, STEPS, VOCAB, EOS = 8, 60, 49152, 2


def walk(name: str, first_use_s: float, fill: Callable[[np.ndarray], None], consume: Callable[[list[int]], None]):
    """Steps the rows along random allowed tokens (the same draws for both engines); prints the mask timings."""
    rng = np.random.default_rng(0)
    bitmask = np.zeros((ROWS, (VOCAB + 31) // 32), dtype=np.int32)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        fill(bitmask)
        times.append((time.perf_counter() - start) * 1e3)
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
        consume([int(rng.choice(np.flatnonzero(row))) if row.any() else EOS for row in allowed])
    times = np.array(times)
    print(f"{name}: first use {first_use_s * 1e3:.1f} ms; mask of {ROWS} rows per step: mean {times.mean():.2f} ms, "
          f"median {np.median(times):.2f} ms, p90 {np.percentile(times, 90):.2f} ms, max {times.max():.2f} ms")


def bench_llguidance(tokenizer_json: str) -> None:
    from llguidance import LLExecutor, LLMatcher, LLTokenizer
    from llguidance.numpy import fill_next_token_bitmask_par

    tokenizer, executor = LLTokenizer(tokenizer_json, eos_token=[EOS]), LLExecutor()
    start = time.perf_counter()
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA, overrides={"whitespace_flexible": False})
    matchers = [LLMatcher(tokenizer, grammar) for _ in range(ROWS)]
    first_use = time.perf_counter() - start

    def consume(tokens):
        for matcher, token in zip(matchers, tokens):
            if not matcher.is_stopped():
                assert matcher.consume_token(token)

    walk("llguidance", first_use, lambda bitmask: fill_next_token_bitmask_par(
        executor, [(matcher, i) for i, matcher in enumerate(matchers)], bitmask), consume)


def bench_xgrammar(tokenizer_json: str) -> None:
    import torch
    import xgrammar
    from tokenizers import Tokenizer as BackendTokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=BackendTokenizer.from_str(tokenizer_json), eos_token="<|im_end|>")
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB,
                                                                               stop_token_ids=[EOS]))
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(ROWS)]
    first_use = time.perf_counter() - start
    host = torch.zeros((ROWS, (VOCAB + 31) // 32), dtype=torch.int32)

    def fill(bitmask):
        for i, matcher in enumerate(matchers):
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(host, i)
        bitmask[:] = host.numpy()

    def consume(tokens):
        for matcher, token in zip(matchers, tokens):
            if not matcher.is_terminated():
                assert matcher.accept_token(token)

    walk("xgrammar", first_use, fill, consume)


def bench_w1_masks(tokenizer_json: str, schema: dict, rows: int, steps: int, vocab: int) -> None:
    """The host side of benchmarks/structured_outputs_gpu.py's constrained W1, without the GPU: `rows` matchers
    of one of its schemas on the worker's thread count, each step filling every row's mask (the model's vocabulary
    wide) and then advancing each by a random allowed token. Twice: fresh matchers, then the same ones reset
    (the worker's spares). Prints the fill time per step over ranges of steps, to set against a forward pass."""
    from llguidance import LLExecutor, LLMatcher, LLTokenizer
    from llguidance.numpy import fill_next_token_bitmask_par

    from worker_svc.grammar_matchers import mask_threads

    threads = mask_threads(1)
    tokenizer, executor = LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=[EOS]), LLExecutor(threads)
    grammar = LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
    matchers = [LLMatcher(tokenizer, grammar, log_level=0) for _ in range(rows)]
    bitmask = np.zeros((rows, (vocab + 31) // 32), dtype=np.int32)
    rng = np.random.default_rng(0)
    for name in ("fresh", "reset"):
        fills, advances = [], []
        for _ in range(steps):
            start = time.perf_counter()
            fill_next_token_bitmask_par(executor, [(matcher, i) for i, matcher in enumerate(matchers)], bitmask)
            fills.append(1e3 * (time.perf_counter() - start))
            allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
            tokens = [int(rng.choice(np.flatnonzero(row))) for row in allowed]
            start = time.perf_counter()
            executor.consume_token_par(list(zip(matchers, tokens)))
            advances.append(1e3 * (time.perf_counter() - start))
        ranges = ", ".join(f"steps {a}-{a + steps // 8 - 1}: {np.mean(fills[a : a + steps // 8]):.2f}"
                           for a in range(0, steps, steps // 8))
        print(f"{name} matchers, {rows} rows, {threads} threads: fill mean {np.mean(fills):.2f} ms "
              f"(p90 {np.percentile(fills, 90):.2f}) [{ranges}], advance mean {np.mean(advances):.2f} ms", flush=True)
        for matcher in matchers:
            matcher.reset()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--w1", action="store_true", help="the constrained W1's masks instead (bench_w1_masks)")
    parser.add_argument("--schema", default="bounded", help="with --w1: a schema of structured_outputs_gpu.py")
    parser.add_argument("--tokenizer", default=None, help="a directory with tokenizer.json (default: SmolLM2's)")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936, help="the model's vocabulary (the masks' width)")
    args = parser.parse_args()
    source = Path(args.tokenizer) / "tokenizer.json" if args.tokenizer else None
    tokenizer_json = source.read_text() if source else load_tokenizer(resolve_model(None).path).to_json()
    if args.w1:
        from benchmarks.structured_outputs_gpu import SCHEMAS

        bench_w1_masks(tokenizer_json, SCHEMAS[args.schema], args.rows, args.steps, args.vocab)
        return
    bench_llguidance(tokenizer_json)
    try:
        bench_xgrammar(tokenizer_json)
    except ImportError as error:
        print(f"xgrammar not measured ({error}); see this module's docstring")


if __name__ == "__main__":
    main()
