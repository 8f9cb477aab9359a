"""The tutorial's experiment (benchmarks/vs_transformers_server.py) runs end to end on the CPU: it starts the
transformers-behind-a-lock server and pagedserve on the same tiny model, and its JSON and PNG hold both
servers' output speeds, the same-question answers and (where `pagedserve bench serve` is) the online benchmark.
The tiny model is random llama weights with the word tokenizer the GPU shapes use (--tokenizer, a directory of
its own as with --shape); short lengths, 2 rounds."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.id_word_tokenizer import write_id_word_tokenizer
from benchmarks.vs_transformers_server import SERVERS, bench_serve_help
from pagedserve.testing.server_harness import REPO_ROOT
from pagedserve.testing.tiny_models import make_tiny_model

OUTPUT_LENS, ROUNDS, THREADS, BENCH_PROMPTS = (4, 8), 2, 3, 4


def test_the_experiment_measures_both_servers_and_draws_them(tmp_path):
    model = make_tiny_model(tmp_path, "llama", eos_token_id=2)
    tokenizer = write_id_word_tokenizer(tmp_path / "tokenizer", vocab_size=512)  # as --shape does
    out = tmp_path / "out"
    command = [sys.executable, "benchmarks/vs_transformers_server.py", "--model", str(model),
               "--tokenizer", str(tokenizer),
               "--output-lens", ",".join(map(str, OUTPUT_LENS)), "--threads", f"1,{THREADS}", "--rounds", str(ROUNDS),
               "--answer-max-tokens", "8", "--request-rates", "inf", "--bench-num-prompts", str(BENCH_PROMPTS),
               "--bench-input-len", "8", "--bench-output-len", "8", "--result-dir", str(out)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    has_bench_serve = bench_serve_help() is not None
    summary = json.loads((out / "vs_transformers_server.json").read_text())
    assert summary["model"] == model.name and summary["device"] == "cpu" and summary["dtype"] == "float32"
    assert set(summary["servers"]) == set(SERVERS)
    for server in SERVERS:
        figures = summary["servers"][server]
        sweep = {(row["output_len"], row["threads"]): row for row in figures["sweep"]}
        assert set(sweep) == {(n, t) for n in OUTPUT_LENS for t in (1, THREADS)}
        for (output_len, threads), row in sweep.items():
            # EOS ignored: every thread's request gives exactly output_len tokens, counted by the server.
            assert row["output_tokens"] == output_len * threads, (server, row)
            assert len(row["request_latencies_s"]) == threads
            assert row["output_tokens_per_s"] == row["output_tokens"] / row["duration_s"] > 0

        answers = figures["same_question"]
        assert answers["sampling"] == {"temperature": 0.01, "top_p": 1.0, "top_k": 1, "seed": 42}
        assert len(answers["concurrent_answer_ids"]) == ROUNDS
        assert all(len(row) == THREADS for row in answers["concurrent_answer_ids"])
        assert len(answers["single_thread_answer_ids"]) == ROUNDS
        assert 1 <= answers["distinct_answers_concurrent"] <= ROUNDS * THREADS
        assert all(answer for answer in answers["answers"])

        if not has_bench_serve:
            assert figures["bench_serve"] == {"skipped": "this checkout has no `pagedserve bench serve`"}
            assert "bench serve: skipped" in done.stdout
        else:
            (run,) = figures["bench_serve"]
            assert run["request_rate"] == "inf" and "error" not in run, run
            assert run["completed"] == BENCH_PROMPTS and run["failed"] == 0
            assert run["p99_ttft_ms"] > 0 and run["output_throughput"] > 0
            assert (out / run["result_file"]).is_file()

    # Seed 42 and top_k 1 are greedy, and our sampling does not depend on the batch: one answer, from 3
    # threads at once as from one.
    engine = summary["servers"]["pagedserve"]["same_question"]
    assert engine["distinct_answers_concurrent"] == engine["distinct_answers_single_thread"] == 1
    assert engine["concurrent_answer_ids"][0][0] == engine["single_thread_answer_ids"][0]

    png = (out / "vs_transformers_server.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
