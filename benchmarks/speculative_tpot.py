"""Lone-request TPOT with speculative decoding against speculation off, per number of draft tokens k, on a
model shape (benchmarks/model_shapes.py). `--method ngram` (the default) runs two kinds of weights, in one run:

- **repeater** (acceptance about 1, the mechanism's ceiling): the shape's checkpoint with tied random embeddings
  and every layer's o_proj and down_proj zero, so each layer adds nothing and the model predicts the token it
  was given (its embedding is nearest itself): greedy output repeats the prompt's last token, and after a few
  tokens the n-gram proposer's drafts are all kept. Written once as safetensors (nothing can be downloaded on a
  lent GPU machine, and random weights never copy).
- **random** (`--load-format dummy`, acceptance about 0): what a step with drafts costs when none is kept.

`--method draft_model` serves the repeater as the target with three draft models: **itself** (its proposals are
its own greedy tokens: acceptance 1, the mechanism's ceiling, paying a full-size draft), a **4-layer
repeater** of the same shape family (acceptance about 1 at a small draft's cost: the gain a good draft gives) and
a **4-layer random** one (written as safetensors, since `--load-format dummy` applies to the target only;
acceptance about 0: what a step costs when the draft is wrong).

`--method eagle3` serves the repeater with two EAGLE-3 heads in the published layout
(pagedserve/testing/tiny_eagle3.py): an **echo head** (it proposes the token it last saw, which the repeater then
produces: acceptance about 1, the gain of a head that is always right) and a **random head** with a 32k draft
vocabulary (acceptance about 0: what the head's passes and the target's wider output cost per step).

Per (weights, k): TPOT of one greedy request on the idle engine (gaps between stream chunks divided by the tokens
each chunk carries, so a chunk of several accepted tokens counts per token), the mean tokens per verification
step (1 + accepted / drafts, from the spec_decode counters), and the ratio to speculation off. Issue 37's targets:
repeater with k = 4 on the 8B shape <= 0.45x off; random: cost per step <= 1.10x off.

    python -m benchmarks.speculative_tpot --shape llama-3.1-8b --out $OUT   # on a lent GPU machine
    python -m benchmarks.speculative_tpot --shape tiny --device cpu --out /tmp/spec   # the script's own check
    python -m benchmarks.speculative_tpot --method draft_model --shape tiny --device cpu --ks 2 4 --out /tmp/spec
    python -m benchmarks.speculative_tpot --method eagle3 --shape tiny --device cpu --ks 2 4 --out /tmp/spec
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.offline_throughput import step_timer_lines
from client import AsyncClient, Client
from pagedserve.llm import LLM

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18] * 8  # a repeated pattern: the proposer finds matches at once
OUTPUT_LEN = 128
WARMUP_LEN = 16


def write_repeater(config, directory: Path, device: str, repeats: bool = True) -> Path:
    """A checkpoint of the transformers `config` (tied embeddings) whose layers add nothing (o_proj and down_proj
    zero): checked on the CPU, a tiny one repeats the prompt's last token. `repeats` False: random weights
    left as they are (a draft model that is nearly always wrong)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if repeats and name.endswith(("o_proj.weight", "down_proj.weight")):
                parameter.zero_()
    model.save_pretrained(directory)
    del model  # the engine's memory profile must see the whole GPU free
    if device == "cuda":
        torch.cuda.empty_cache()
    return directory


@dataclass(frozen=True)
class TimedStream:
    """One generation stream as the client saw it. Why the arrival time of each chunk with its size: a chunk of a
    verified step carries every token the step accepted, so TPOT is the time between the first and the last
    chunk over the tokens after the first (which carries the prefill), not the number of chunks."""

    arrivals: tuple[float, ...]  # time.perf_counter() at each chunk
    chunk_sizes: tuple[int, ...]  # token ids each chunk carried
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    prompt_tokens: int | None

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first chunk."""
        return (self.arrivals[-1] - self.arrivals[0]) / max(1, sum(self.chunk_sizes[1:]))


async def timed_stream(client: AsyncClient, prompt=None, **request) -> TimedStream:
    """Streams one request (AsyncClient.generate_stream's arguments: a prompt or messages=, sampling keywords)."""
    arrivals, sizes, token_ids, texts, last = [], [], [], [], None
    async for chunk in client.generate_stream(prompt, **request):
        arrivals.append(time.perf_counter())
        sizes.append(len(chunk.token_ids))
        token_ids.extend(chunk.token_ids)
        texts.append(chunk.text)
        last = chunk
    return TimedStream(tuple(arrivals), tuple(sizes), tuple(token_ids), "".join(texts), last.finish_reason,
                       last.prompt_tokens)


async def _lone_tpot(target: str, max_tokens: int) -> float:
    """Seconds per output token of one greedy stream of PROMPT, EOS ignored."""
    async with AsyncClient(target) as client:
        stream = await timed_stream(client, PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return stream.tpot


def speculative_options(options: dict, k: int, draft: str | None = None, method: str = "draft_model",
                        prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> dict:
    """The LLM keywords `options` with k draft tokens (0: speculation off): `draft`'s (a draft model's or, `method`
    eagle3, an EAGLE-3 head's directory), else n-gram ones looked up with n from `prompt_lookup_max` down to
    `prompt_lookup_min`."""
    if k and draft is not None:
        return {**options, "speculative_config": {"method": method, "model": draft, "num_speculative_tokens": k}}
    if k:
        return {**options, "speculative_config": {"method": "ngram", "num_speculative_tokens": k,
                                                   "prompt_lookup_max": prompt_lookup_max,
                                                   "prompt_lookup_min": prompt_lookup_min}}
    return options


def spec_decode_figures(stats, since=None) -> dict:
    """The server's spec_decode counters (ServerStats) gained since the `since` stats (None: since it started),
    and the mean tokens per verification step, 1 + accepted / drafts (None without drafts)."""
    def gained(field: str) -> int:
        return getattr(stats, field) - (getattr(since, field) if since is not None else 0)

    before = since.spec_decode_num_accepted_tokens_per_pos if since is not None else ()
    per_position = [n - (before[j] if j < len(before) else 0)
                    for j, n in enumerate(stats.spec_decode_num_accepted_tokens_per_pos)]
    drafts, accepted = gained("spec_decode_num_drafts"), gained("spec_decode_num_accepted_tokens")
    return {"drafts": drafts, "draft_tokens": gained("spec_decode_num_draft_tokens"), "accepted_tokens": accepted,
            "accepted_tokens_per_position": per_position,
            "tokens_per_verification": 1 + accepted / drafts if drafts else None}


def measure(model: str, k: int, options: dict, draft: str | None = None, method: str = "draft_model") -> dict:
    """One engine: k draft tokens (0: speculation off), n-gram ones or `draft`'s (a draft model's or, `method`
    eagle3, an EAGLE-3 head's directory); TPOT (median of 3 lone requests) and acceptance."""
    options = speculative_options(options, k, draft, method)
    with LLM(model, **options) as llm:
        log = open(llm.log_path, errors="replace")  # readable after the server's exit unlinks it
        asyncio.run(_lone_tpot(llm.target, WARMUP_LEN))  # compiles, graphs
        tpots = [asyncio.run(_lone_tpot(llm.target, OUTPUT_LEN)) for _ in range(3)]
        with Client(llm.target) as client:
            stats = client.stats()
    with log:  # where each step's time went: the scheduler's and the worker's step timers, logged at exit
        timers = step_timer_lines(log.read())
    return {"k": k, "tpot_ms": 1e3 * statistics.median(tpots), "tpot_runs_ms": [1e3 * t for t in tpots],
            **spec_decode_figures(stats), "step_timers": timers}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b", help="a benchmarks/model_shapes.py shape, or 'tiny'")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--method", default="ngram", choices=("ngram", "draft_model", "eagle3"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    options = {"device": args.device, "dtype": "bfloat16" if args.device == "cuda" else "float32",
               "max_model_len": 1024}
    if args.shape == "tiny":  # the script's own check on the CPU: a test-sized Llama
        from transformers import LlamaConfig

        config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                             architectures=["LlamaForCausalLM"])
        config.save_pretrained(work / "random")
        random_model = str(work / "random")
    else:
        from benchmarks.model_shapes import hf_config, write_config_dir

        config = hf_config(args.shape, tie_word_embeddings=True)
        random_model = str(write_config_dir(args.shape, work / "random"))
    repeater = str(write_repeater(config, work / "repeater", args.device))
    random_options = {**options, "load_format": "dummy"}
    report = {"shape": args.shape, "device": args.device, "method": args.method, "runs": {}}
    if args.method == "ngram":
        kinds = (("repeater", repeater, options, None), ("random", random_model, random_options, None))
    elif args.method == "eagle3":
        import torch

        from pagedserve.testing.tiny_eagle3 import make_echo_eagle3_head, make_tiny_eagle3_head

        heads, layers = work / "heads", config.num_hidden_layers
        kinds = (("eagle3 echo head", repeater, options, str(make_echo_eagle3_head(heads, repeater, torch.bfloat16))),
                 ("eagle3 random head", repeater, options,
                  str(make_tiny_eagle3_head(heads, repeater, seed=1, draft_vocab_size=min(32000, config.vocab_size),
                                            aux_layer_ids=[0, layers // 2, layers - 1], dtype=torch.bfloat16))))
    else:
        fields = {**config.to_dict(), "num_hidden_layers": 4}
        if fields.get("layer_types"):  # per-layer attention kinds (Qwen2's): the first four layers'
            fields["layer_types"] = fields["layer_types"][:4]
        small = config.__class__.from_dict(fields)
        # Untied: with tied embeddings even random layers mostly predict their input token (a repeater too).
        wrong = config.__class__.from_dict({**small.to_dict(), "tie_word_embeddings": False})
        kinds = (("draft itself", repeater, options, repeater),
                 ("draft 4-layer repeater", repeater, options,
                  str(write_repeater(small, work / "draft-repeater", args.device))),
                 ("draft 4-layer random", repeater, options,
                  str(write_repeater(wrong, work / "draft-random", args.device, repeats=False))))
    off_run = None  # the draft models' runs share their target's run without speculation
    for weights, model, engine_options, draft in kinds:
        if off_run is None or draft is None:
            off_run = measure(model, 0, engine_options)
        runs = [off_run, *(measure(model, k, engine_options, draft, args.method) for k in args.ks)]
        off = runs[0]["tpot_ms"]
        runs = [{**run, "tpot_over_off": run["tpot_ms"] / off} for run in runs]
        report["runs"][weights] = runs
        print(weights, json.dumps(runs), flush=True)
    name = f"speculative_tpot_{'' if args.method == 'ngram' else args.method + '_'}{args.shape}.json"
    (args.out / name).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
