"""n-gram speculative decoding on a copy-heavy chat workload with real weights (issue 37 item 5c): the embedded
SmolLM2-135M-Instruct (or the GGUF or model directory given by --model) served with speculation off (k = 0) and
with `{"method": "ngram", "num_speculative_tokens": k}` for each k of --ks.

The workload: chat requests (the model's chat template, rendered by the server) that give a paragraph of plain
English (PASSAGES: 160-185 tokens each, prompts of about 230) and ask the model to repeat it, to fix its typos
(the same paragraph with letters swapped in every ninth long word) or to rewrite it with one change (a name, a
day, a year). The answer copies long spans of the prompt, which is where the n-gram proposer finds its drafts.
Greedy, EOS honoured (the model stops itself: the tokens it made are counted), up to --max-tokens each.

Per k, one engine: a warm-up request, then each prompt once alone (TPOT per request: the time from its first
chunk to its last over the tokens after the first, median over the prompts), then --concurrency requests at once
(the prompts in turn, after a short warm-up batch of the same, so their prefills are prefix-cache hits: output
tokens per second over the wall time of the batch). The spec_decode counters of each
phase give the mean tokens per verification step (1 + accepted / drafts). Greedy verification is lossless: every
lone answer must have the token ids of k = 0's (the script exits 1 naming the ones that differ, after writing
its results); the concurrent answers are compared and reported too (not asserted: with a batch the steps'
shapes differ from run to run, and bfloat16 sums of other shapes may round differently).

    python -m benchmarks.speculative_copy_heavy --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT   # GPU
    python -m benchmarks.speculative_copy_heavy --device cpu --ks 0 2 --num-prompts 2 --max-tokens 32 --out /tmp/copy

Writes speculative_copy_heavy_<device>.json and a plot of TPOT and concurrent throughput against k (.png).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.offline_throughput import step_timer_lines
from benchmarks.speculative_tpot import TimedStream, spec_decode_figures, speculative_options, timed_stream
from client import AsyncClient, Client
from pagedserve.llm import LLM
from service_runtime.model_source import resolve_model


@dataclass(frozen=True)
class Passage:
    """A paragraph the model is asked to copy, and the one change a rewrite asks for (plain words, so the
    rewritten answer still copies everything else)."""

    text: str
    change: str


PASSAGES = (
    Passage("Every evening at six, Marta climbed the ninety steps of the old lighthouse on the northern cape and "
            "lit the lamp that warned the fishing boats away from the rocks. She had done this for eleven years, "
            "in calm weather and in storms, and she kept a small notebook in which she wrote the time, the state "
            "of the sea and the names of any ships she saw pass. The village below depended on her more than it "
            "liked to admit. When the electric beacon was installed on the harbour wall, the council sent her a "
            "polite letter thanking her for her service and telling her that the lamp would no longer be needed. "
            "Marta read the letter twice, folded it carefully and put it in the drawer with her notebooks. That "
            "evening at six she climbed the steps again, because the new beacon could not be seen from the "
            "western channel, and she knew that at least one boat would come home that way before midnight.",
            'replace the name "Marta" with "Elena" everywhere'),
    Passage("The public library on Station Road will change its opening hours from the first of next month. On "
            "Monday, Wednesday and Friday it will open at nine in the morning and close at eight in the evening. "
            "On Tuesday and Thursday it will open at ten and close at six. On Saturday it will open at nine and "
            "close at one in the afternoon, and it will stay closed on Sunday. The children's reading hour will "
            "move from Saturday morning to Tuesday afternoon at four, and the computer room will be available "
            "only with a booking made at the front desk or by telephone. Books may still be returned at any time "
            "through the slot beside the main door. Members who have questions about the new hours are welcome "
            "to speak to any of the staff, who will be happy to explain the changes and to help with bookings.",
            'change "Station Road" to "Mill Lane"'),
    Passage("To keep a bicycle running smoothly, clean and oil the chain about once a month, and more often if you "
            "ride in the rain. Start by shifting to the smallest gear at the back, then hold a dry cloth around "
            "the lower part of the chain and turn the pedals backwards so that the chain runs through the cloth. "
            "When most of the dirt has come off, put one small drop of oil on each link while you keep turning "
            "the pedals slowly. Wait a few minutes so that the oil can work its way into the rollers, and then "
            "wipe off everything that is left on the outside of the chain, because oil on the outside only "
            "collects more dirt. Finally, check the tyre pressure and the brakes before you ride, since a clean "
            "chain will not help you much if the tyres are soft or the brakes do not stop the wheels in time.",
            'replace the word "bicycle" with "bike"'),
    Passage("The canal was opened in 1823 to carry coal from the mines in the hills to the river port, a journey "
            "that had taken three days by road and took less than one day by water. For forty years it was the "
            "busiest route in the county, and the towns along its banks grew quickly as warehouses, inns and "
            "boatyards were built beside the locks. When the railway arrived, the boats lost their trade within "
            "a decade, and the canal slowly filled with mud and reeds. It was nearly forgotten until a group of "
            "volunteers began to clear it in the summer of 1974. Working mostly at weekends, they repaired the "
            "locks, rebuilt the towpath and raised money to dredge the channel. Today the canal carries holiday "
            "boats instead of coal, and the old lock keeper's cottage is a small museum that tells its story.",
            'change the year "1823" to "1832"'),
    Passage("The garden club met on Thursday evening in the church hall, with twenty members present. Mr. Okafor "
            "opened the meeting by thanking everyone who had helped with the spring plant sale, which raised more "
            "money than in any previous year. The treasurer reported that the club could now afford new tools "
            "for the community garden and a second water tank. There was a long discussion about the slugs that "
            "had eaten most of the young lettuces, and several members offered advice, from copper tape to "
            "beer traps. It was agreed that the club would visit the botanical gardens in June and that members "
            "should tell the secretary by the end of the month if they wished to join the trip. The meeting "
            "closed at nine o'clock, and tea and cake were served by the members of the committee.",
            'replace "Mr. Okafor" with "Ms. Lindqvist"'),
    Passage("Before you leave the office for the holidays, please make sure that your computer is shut down and "
            "not only asleep, that the windows in your room are closed and that no food is left in the kitchen "
            "fridge. The heating will be turned down to a low setting from Friday evening until the second of "
            "January, so plants that need warmth should be taken home. The post will be collected once a week "
            "by the security team, who will also check the building every night. If you need to come in during "
            "the holidays, tell the facilities manager in advance so that your card will open the front door. "
            "Finally, remember to set an automatic reply on your email that says when you will be back and whom "
            "to contact in the meantime. Thank you, and we wish you a restful and happy holiday.",
            'change "Friday evening" to "Thursday evening"'),
)
TASKS = ("repeat", "fix typos", "rewrite")


def with_typos(text: str) -> str:
    """The text with the second and third letters of every ninth word of five or more letters swapped."""
    long_words = 0

    def swap(match: re.Match) -> str:
        nonlocal long_words
        word = match.group(0)
        long_words += 1
        return word[0] + word[2] + word[1] + word[3:] if long_words % 9 == 0 else word

    return re.sub(r"[A-Za-z]{5,}", swap, text)


def copy_prompt(index: int) -> list[dict]:
    """The index-th chat of the workload: passages in turn, tasks in turn."""
    passage, task = PASSAGES[index % len(PASSAGES)], TASKS[index % len(TASKS)]
    if task == "repeat":
        content = f"Repeat the following text exactly, word for word, and add nothing else.\n\n{passage.text}"
    elif task == "fix typos":
        content = ("The following text contains some typos. Write the text again with the typos corrected and "
                   f"nothing else changed.\n\n{with_typos(passage.text)}")
    else:
        content = (f"Rewrite the following text with one change: {passage.change}. Keep every other word exactly "
                   f"the same.\n\n{passage.text}")
    return [{"role": "user", "content": content}]


async def _streams(target: str, chats: list[list[dict]], sampling: dict, at_once: bool) -> list[TimedStream]:
    """Streams every chat, one after another or all at once."""
    async with AsyncClient(target) as client:
        if at_once:
            return list(await asyncio.gather(*(timed_stream(client, messages=chat, **sampling) for chat in chats)))
        return [await timed_stream(client, messages=chat, **sampling) for chat in chats]


def _answers(streams: list[TimedStream]) -> list[dict]:
    return [{"text": s.text, "token_ids": list(s.token_ids), "output_tokens": len(s.token_ids),
             "prompt_tokens": s.prompt_tokens, "finish_reason": s.finish_reason, "tpot_ms": 1e3 * s.tpot}
            for s in streams]


def measure_copy(model: str | None, k: int, options: dict, args) -> dict:
    """One engine with k n-gram drafts (0: off): lone TPOT and acceptance, then the concurrent batch's."""
    options = speculative_options(options, k, prompt_lookup_min=args.prompt_lookup_min,
                                  prompt_lookup_max=args.prompt_lookup_max)
    # Plain greedy: explicit neutral penalties, so a model's generation defaults cannot change what is measured
    # (a penalty also turns a request's drafts off).
    sampling = {"temperature": 0.0, "max_tokens": args.max_tokens, "repetition_penalty": 1.0}
    lone_chats = [copy_prompt(i) for i in range(args.num_prompts)]
    batch_chats = [lone_chats[i % len(lone_chats)] for i in range(args.concurrency)]
    with LLM(model, **options) as llm, Client(llm.target) as stats_client:
        log = open(llm.log_path, errors="replace")  # readable after the server's exit unlinks it
        asyncio.run(_streams(llm.target, lone_chats[:1], {**sampling, "max_tokens": 16}, at_once=False))  # warm-up
        before_lone = stats_client.stats()
        lone = asyncio.run(_streams(llm.target, lone_chats, sampling, at_once=False))
        before_batch = stats_client.stats()
        asyncio.run(_streams(llm.target, batch_chats, {**sampling, "max_tokens": 8}, at_once=True))  # warm-up
        warm = stats_client.stats()
        started = time.perf_counter()
        batch = asyncio.run(_streams(llm.target, batch_chats, sampling, at_once=True))
        wall = time.perf_counter() - started
        after_batch = stats_client.stats()
    with log:  # where each step's time went: the scheduler's and the worker's step timers, logged at exit
        timers = step_timer_lines(log.read())
    batch_tokens = sum(len(s.token_ids) for s in batch)
    return {
        "k": k,
        "lone": {"tpot_ms": 1e3 * statistics.median(s.tpot for s in lone),
                 **spec_decode_figures(before_batch, since=before_lone), "answers": _answers(lone)},
        f"concurrency_{args.concurrency}": {
            "output_tokens_per_s": batch_tokens / wall, "wall_s": wall, "output_tokens": batch_tokens,
            "median_tpot_ms": 1e3 * statistics.median(s.tpot for s in batch),
            **spec_decode_figures(after_batch, since=warm), "answers": _answers(batch)},
        "spec_decode_all_phases": spec_decode_figures(after_batch),
        "step_timers": timers,
    }


def _mismatches(run: dict, off: dict, phase: str) -> list[int]:
    """Indices of the answers of `run` whose token ids differ from speculation off's."""
    return [i for i, (a, b) in enumerate(zip(run[phase]["answers"], off[phase]["answers"]))
            if a["token_ids"] != b["token_ids"]]


def plot(report: dict, path: Path, batch_phase: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    ks = [run["k"] for run in runs]
    fig, (lone_axis, batch_axis) = plt.subplots(1, 2, figsize=(10, 4))
    lone_axis.plot(ks, [run["lone"]["tpot_ms"] for run in runs], marker="o")
    for run in runs:
        per_step = run["lone"]["tokens_per_verification"]
        if per_step is not None:
            lone_axis.annotate(f"{per_step:.2f} tok/verif.", (run["k"], run["lone"]["tpot_ms"]), fontsize=7,
                               textcoords="offset points", xytext=(4, 6))
    lone_axis.set_xlabel("num_speculative_tokens k (0: off)")
    lone_axis.set_ylabel("lone-request TPOT, ms (median over prompts)")
    lone_axis.set_ylim(0, 1.2 * max(run["lone"]["tpot_ms"] for run in runs))
    lone_axis.set_xticks(ks)
    batch_axis.plot(ks, [run[batch_phase]["output_tokens_per_s"] for run in runs], marker="o", color="tab:green")
    batch_axis.set_xlabel("num_speculative_tokens k (0: off)")
    batch_axis.set_ylabel(f"output tokens/s, {batch_phase.replace('_', ' ')}")
    batch_axis.set_ylim(bottom=0)
    batch_axis.set_xticks(ks)
    fig.suptitle(f"n-gram speculation, copy-heavy chat: {report['model']} on {report['device']} "
                 f"({report['dtype']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or model directory (default: the embedded one)")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5, 6, 8])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto",
                        help="serve's --dtype (auto: bfloat16 on a GPU, float32 on the CPU)")
    parser.add_argument("--num-prompts", type=int, default=len(PASSAGES), help="lone requests per k (chats in turn)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    ks = sorted(set(args.ks) | {0})  # k = 0 is the reference the others' answers must equal
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dtype == "auto":
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    options = {"device": args.device, "dtype": args.dtype, "max_model_len": 2048}
    batch_phase = f"concurrency_{args.concurrency}"
    report = {"model": resolve_model(args.model).name, "device": args.device, "dtype": args.dtype,
              "max_tokens": args.max_tokens, "prompt_lookup_max": args.prompt_lookup_max,
              "prompt_lookup_min": args.prompt_lookup_min, "prompts": [copy_prompt(i) for i in range(args.num_prompts)],
              "runs": []}
    for k in ks:
        run = measure_copy(args.model, k, options, args)
        report["runs"].append(run)
        print(f"k={k}: lone TPOT {run['lone']['tpot_ms']:.2f} ms, tokens/verification "
              f"{run['lone']['tokens_per_verification']}, {batch_phase} {run[batch_phase]['output_tokens_per_s']:.1f} "
              f"tok/s, output tokens {[a['output_tokens'] for a in run['lone']['answers']]}", flush=True)
    off = report["runs"][0]
    failed = []
    for run in report["runs"]:
        run["lone"]["tpot_over_off"] = run["lone"]["tpot_ms"] / off["lone"]["tpot_ms"]
        run[batch_phase]["throughput_over_off"] = (run[batch_phase]["output_tokens_per_s"]
                                                   / off[batch_phase]["output_tokens_per_s"])
        run["lone"]["differs_from_off"] = _mismatches(run, off, "lone")
        run[batch_phase]["differs_from_off"] = _mismatches(run, off, batch_phase)
        if run["lone"]["differs_from_off"]:
            failed.append((run["k"], run["lone"]["differs_from_off"]))
    report["lone_answers_identical_to_off"] = not failed
    name = f"speculative_copy_heavy_{args.device.split(':')[0]}"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / f"{name}.png", batch_phase)
    for run in report["runs"]:
        print(f"k={run['k']}: lone TPOT {run['lone']['tpot_over_off']:.2f}x off, {batch_phase} "
              f"{run[batch_phase]['throughput_over_off']:.2f}x off; answers differing from off: lone "
              f"{run['lone']['differs_from_off']}, {batch_phase} {run[batch_phase]['differs_from_off']}")
    if failed:
        print(f"NOT LOSSLESS: lone greedy answers differ from k=0's (k, prompt indices): {failed}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
