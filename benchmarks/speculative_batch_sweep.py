"""Where speculation stops paying as the batch grows: output tokens/s of c concurrent greedy requests with
speculation on (k = 4, never disabled) against off, for c in --concurrency, on a model shape with random weights
(benchmarks/model_shapes.py), in one run. The data behind `disable_by_batch_size`'s default (issue 37 item 3).

Two cases bracket every workload:
- **best**: n-gram drafts on the repeater (benchmarks/speculative_tpot.py `write_repeater`: nearly every draft is
  kept), the most speculation can give at each batch size;
- **worst**: a 4-layer random draft model beside the repeater (nearly no draft kept), what a step with drafts costs
  when none is kept, the draft's passes included.
Speculation pays below the batch size where best's ratio falls to 1 and costs worst's ratio everywhere: the default
should sit where the best case no longer gains much.

    python -m benchmarks.speculative_batch_sweep --shape llama-3.1-8b --out $OUT     # on a lent GPU
    python -m benchmarks.speculative_batch_sweep --shape tiny --device cpu --concurrency 1 4 --out /tmp/sweep
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from benchmarks.speculative_tpot import PROMPT, write_repeater
from client import AsyncClient, Client
from pagedserve.llm import LLM

OUTPUT_LEN = 128
K = 4


async def _batch_rate(target: str, concurrency: int) -> float:
    """Output tokens per second of `concurrency` greedy streams started together."""
    async with AsyncClient(target) as client:
        async def one() -> int:
            count = 0
            async for chunk in client.generate_stream(PROMPT, max_tokens=OUTPUT_LEN, temperature=0.0,
                                                      ignore_eos=True):
                count += len(chunk.token_ids)
            return count

        started = time.perf_counter()
        counts = await asyncio.gather(*(one() for _ in range(concurrency)))
        return sum(counts) / (time.perf_counter() - started)


def sweep(model: str, options: dict, speculative: dict | None, concurrencies: list[int]) -> dict:
    if speculative is not None:
        options = {**options, "speculative_config": speculative}
    with LLM(model, **options) as llm:
        asyncio.run(_batch_rate(llm.target, max(concurrencies)))  # warm-up: compiles, graphs
        rates = {c: asyncio.run(_batch_rate(llm.target, c)) for c in concurrencies}
        with Client(llm.target) as client:
            stats = client.stats()
    drafts = stats.spec_decode_num_drafts
    return {"output_tokens_per_s": rates, "drafts": drafts,
            "tokens_per_verification": 1 + stats.spec_decode_num_accepted_tokens / drafts if drafts else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b", help="a benchmarks/model_shapes.py shape, or 'tiny'")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    if args.shape == "tiny":
        from transformers import LlamaConfig

        config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                             architectures=["LlamaForCausalLM"])
    else:
        from benchmarks.model_shapes import hf_config

        config = hf_config(args.shape, tie_word_embeddings=True)
    repeater = str(write_repeater(config, work / "repeater", args.device))
    small = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": 4, "tie_word_embeddings": False})
    if small.to_dict().get("layer_types"):
        small = config.__class__.from_dict({**small.to_dict(), "layer_types": small.layer_types[:4]})
    wrong_draft = str(write_repeater(small, work / "draft-random", args.device, repeats=False))
    options = {"device": args.device, "dtype": "bfloat16" if args.device == "cuda" else "float32",
               "max_model_len": 1024, "max_num_seqs": max(256, max(args.concurrency))}
    never_disabled = {"disable_by_batch_size": 1 << 20, "num_speculative_tokens": K}
    cases = {"off": None,
             "best: n-gram on the repeater": {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1,
                                             **never_disabled},
             "worst: 4-layer random draft model": {"method": "draft_model", "model": wrong_draft, **never_disabled}}
    report = {"shape": args.shape, "device": args.device, "k": K, "output_len": OUTPUT_LEN, "runs": {}}
    for name, speculative in cases.items():
        report["runs"][name] = sweep(repeater, options, speculative, args.concurrency)
        print(name, json.dumps(report["runs"][name]), flush=True)
    off = report["runs"]["off"]["output_tokens_per_s"]
    report["ratio_to_off"] = {name: {c: run["output_tokens_per_s"][c] / off[c] for c in args.concurrency}
                              for name, run in report["runs"].items() if name != "off"}
    print(json.dumps(report["ratio_to_off"], indent=1))
    (args.out / f"speculative_batch_sweep_{args.shape}.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
