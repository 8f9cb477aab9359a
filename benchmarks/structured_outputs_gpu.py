"""Issue 23's GPU figure: W1 with every request under a JSON schema against W1 without, in one engine, and the
TPOT of a lone constrained request against a lone unconstrained one. One command on a lent GPU:

    python benchmarks/structured_outputs_gpu.py --shape qwen2.5-1.5b --tokenizer DIR

DIR holds a real tokenizer (llguidance reads token text; the random-weight shapes have none): e.g. the
embedded SmolLM2 tokenizer written by `pagedserve.testing.tiny_models.add_embedded_tokenizer(DIR)`, whose
49,152 tokens sit inside the shape's vocabulary (the rest is masked for constrained rows). W1 here: 256
requests x 512 random prompt tokens x 256 output tokens (EOS ignored), all at once, greedy; whitespace off
(random weights would otherwise fill the output with it). Two schemas (SCHEMAS), each long enough that no
output completes it within 256 tokens, so every step of every row computes a real mask (`complete_documents`
in each constrained pass checks that: an earlier array schema without minItems was closed by the random model
within about 15 tokens, after which its masks allowed EOS alone):
- `extraction`: an object of 8 required free-text strings, the shape of a JSON-extraction request. llguidance
  masks a row of it in about 20 us of a core.
- `bounded`: an array of 200 to 1,000 strings of 1 to 12 characters. Counted repetitions are llguidance's
  costly case: about 220 us of a core per row and step whether its caches are warm or not, so 256 rows need
  about 56 ms of host CPU per step (`benchmarks/grammar_mask_bench.py --w1` measures the host side alone).
Every mode runs through one engine, interleaved (unconstrained first and last); `--rounds N` repeats them (W1
passes vary 10-25% run to run). The worker's step timers split constrained steps from the others, and its
grammar timing line says how long the mask fills took. Writes $OUT/structured_outputs_<shape>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.model_shapes import write_config_dir  # noqa: E402
from benchmarks.offline_throughput import step_timer_lines  # noqa: E402
from client import AsyncClient, SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedserve.bench.offline_engine import start_engine  # noqa: E402
from pagedserve.cli import parse_args  # noqa: E402

PROMPT_LEN, OUTPUT_LEN, NUM_REQUESTS, TOKENIZER_VOCAB = 512, 256, 256, 49152
SCHEMAS = {
    "extraction": {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(8)},
                   "required": [f"field_{i}" for i in range(8)], "additionalProperties": False},
    "bounded": {"type": "object", "properties": {"items": {"type": "array", "minItems": 200, "maxItems": 1000,
                                                           "items": {"type": "string", "minLength": 1,
                                                                     "maxLength": 12}}},
                "required": ["items"], "additionalProperties": False},
}


def prompts(count: int, seed: int, length: int = PROMPT_LEN) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TOKENIZER_VOCAB) for _ in range(length)] for _ in range(count)]


def params(schema: str | None, output_len: int) -> SamplingParams:
    constraint = StructuredOutputsParams(json=SCHEMAS[schema], disable_any_whitespace=True) if schema else None
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, structured_outputs=constraint)


def w1(llm, schema: str | None, seed: int, workload: argparse.Namespace) -> dict:
    batch = prompts(workload.num_requests, seed, workload.prompt_len)
    start = time.perf_counter()
    results = llm.generate(batch, [params(schema, workload.output_len)] * len(batch), use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(result.outputs[0].token_ids) for result in results)
    run = {"elapsed_s": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed}
    if schema:  # how much of the output the grammar shaped: a complete document is followed by EOS only
        texts = [result.outputs[0].text for result in results]
        run["complete_documents"] = sum(_is_complete(text) for text in texts) / len(texts)
        run["mean_document_chars"] = statistics.mean(len(text) for text in texts)
    return run


def _is_complete(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


async def lone_gaps(target: str, schema: str | None, output_len: int) -> list[float]:
    stamps = []
    sampling = {"structured_outputs": StructuredOutputsParams(json=SCHEMAS[schema], disable_any_whitespace=True)} \
        if schema else {}
    async with AsyncClient(target) as client:
        async for _ in client.generate_stream(prompts(1, 99)[0], max_tokens=output_len, temperature=0.0,
                                              ignore_eos=True, **sampling):
            stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json (see the docstring)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers (a CPU smoke run)")
    parser.add_argument("--rounds", type=int, default=1, help="passes of each mode")
    parser.add_argument("--schemas", nargs="+", choices=sorted(SCHEMAS), default=sorted(SCHEMAS))
    args = parser.parse_args()
    model_dir = write_config_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    if args.num_layers is not None:
        config = json.loads((model_dir / "config.json").read_text())
        config["num_hidden_layers"] = args.num_layers
        config.pop("layer_types", None)
        (model_dir / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(Path(args.tokenizer) / name, model_dir / name)
    engine_args = parse_args(["bench", "throughput", "--model", str(model_dir), "--load-format", "dummy",
                              "--device", args.device, "--dtype", "bfloat16", "--max-num-seqs", "256",
                              "--max-num-batched-tokens", "16384", "--max-model-len", "1024", "--ready-timeout", "900"])
    summary: dict = {"shape": args.shape, "schemas": {name: SCHEMAS[name] for name in args.schemas}, "runs": {}}
    modes = [None, *args.schemas]
    seeds = itertools.count(1)
    llm = start_engine(engine_args)
    with open(llm.log_path, errors="replace") as log, llm:
        for schema in modes:  # warm-up: batch shapes, kernels, the tokenizer's llguidance view, the mask kernel
            w1(llm, schema, next(seeds), args)
        passes = [mode for _ in range(args.rounds) for mode in modes] + [None]
        for index, schema in enumerate(passes):
            name = f"{schema or 'unconstrained'}_{index}"
            summary["runs"][name] = {"mode": schema or "unconstrained", **w1(llm, schema, next(seeds), args)}
            print(name, json.dumps(summary["runs"][name]), flush=True)
        for schema in modes:
            gaps = asyncio.run(lone_gaps(llm.target, schema, args.output_len))
            name = f"lone_{schema or 'unconstrained'}"
            summary["runs"][name] = {"tpot_median_ms": 1e3 * statistics.median(gaps),
                                     "tpot_p90_ms": 1e3 * sorted(gaps)[int(0.9 * len(gaps))]}
            print(name, json.dumps(summary["runs"][name]), flush=True)
        llm.shutdown()
        summary["step_timers"] = step_timer_lines(log.read())  # every pass above, every mode
        print("\n".join(summary["step_timers"]), flush=True)
    runs = summary["runs"]

    def throughput(mode: str) -> float:
        return statistics.mean(run["output_tokens_per_s"] for run in runs.values() if run.get("mode") == mode)

    summary["ratios"] = {}
    for schema in args.schemas:
        summary["ratios"][f"w1_{schema}_over_unconstrained"] = throughput(schema) / throughput("unconstrained")
        summary["ratios"][f"tpot_{schema}_over_unconstrained"] = (runs[f"lone_{schema}"]["tpot_median_ms"]
                                                                  / runs["lone_unconstrained"]["tpot_median_ms"])
    print(json.dumps(summary["ratios"]), flush=True)
    out = Path(os.environ.get("OUT", ".")) / f"structured_outputs_{args.shape}.json"
    out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
