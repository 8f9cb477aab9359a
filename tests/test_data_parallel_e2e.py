"""Data parallel through the real processes (`pagedserve serve -dp 2`: a front, two schedulers, a worker each,
on the CPU): concurrent requests get the greedy tokens of a single engine (transformers' here), different
prefixes spread over both engines while requests sharing a long prefix all go to one, whose prefix cache serves
them; a client's cancel reaches the engine; a killed worker of one engine is replaced and its streams finish
token-exact while the front keeps serving; a whole engine killed for good has its queued requests sent again
to the other engine, and its started stream resumed there; `bench serve`'s multi-turn dataset keeps each
conversation on one engine; `-dp 2` starts one front and `-dp 1` none. The router's policies alone, and the
front before stand-in schedulers: tests/test_data_parallel_router.py."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

from pagedserve.testing.hf_reference import hf_greedy
from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model
from tests.stream_watch import HealthWatch, StreamWatch
from tests.test_tensor_parallel_e2e import _generate_all as generate_all

MAX_TOKENS = 12
RECOVERY_TOKENS = 200  # long enough that engine 0's streams are still running when its worker is killed
FRONT_MODULE = "scheduler_svc.data_parallel"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=11)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("dp2"), "--model", str(model), "-dp", "2", "--max-model-len",
                        "512") as running:
        yield running


def _generate_all(server, prompts) -> list:
    return generate_all(server, prompts, max_tokens=MAX_TOKENS)


def _engines(server):
    with server.client() as client:
        return client.stats().engines


def _command_lines(pids: list[int]) -> list[str]:
    lines = []
    for pid in pids:
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            pass
    return lines


def test_dp2_starts_one_front_and_two_engines(server):
    commands = _command_lines(server.children)
    assert sum(f"-m {FRONT_MODULE} " in command for command in commands) == 1
    assert sum("-m scheduler_svc " in command for command in commands) == 2
    assert sum("-m worker_svc " in command for command in commands) == 2
    assert [entry.engine for entry in _engines(server)] == [0, 1]


def test_concurrent_requests_get_a_single_engines_greedy_tokens_and_spread_over_both(server, model):
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(20, 40))] for _ in range(10)]
    before = [entry.routed_requests for entry in _engines(server)]
    results = _generate_all(server, prompts)
    for prompt, result in zip(prompts, results):
        assert list(result.token_ids) == hf_greedy(model, prompt, MAX_TOKENS)
    routed = [entry.routed_requests - earlier for entry, earlier in zip(_engines(server), before)]
    assert sum(routed) == 10 and min(routed) >= 2, f"different prefixes should spread over both engines: {routed}"


def test_requests_sharing_a_long_prefix_all_go_to_one_engine_whose_cache_serves_them(server, model):
    rng = random.Random(6)
    prefix = [rng.randrange(512) for _ in range(48)]  # three 16-token blocks
    prompts = [prefix + [rng.randrange(512) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    before = _engines(server)
    first = _generate_all(server, prompts[:1])  # fills one engine's prefix cache
    rest = _generate_all(server, prompts[1:])  # 5 in flight at once: within the default load bound (16)
    after = server.wait_all_blocks_free()
    for prompt, result in zip(prompts, first + rest):
        assert list(result.token_ids) == hf_greedy(model, prompt, MAX_TOKENS)
    routed = [now.routed_requests - then.routed_requests for now, then in zip(after.engines, before)]
    home = routed.index(6)
    assert routed[1 - home] == 0
    hits = [now.stats.prefix_cache_hit_tokens - then.stats.prefix_cache_hit_tokens
            for now, then in zip(after.engines, before)]
    assert hits[home] >= 5 * 48 and hits[1 - home] == 0


def test_a_client_cancel_through_the_front_ends_the_engines_request(server):
    with server.client() as client:
        stream = client.generate_stream(list(range(1, 30)), max_tokens=400, temperature=0.0, ignore_eos=True)
        for _ in range(3):
            next(stream)
        running = [entry.stats.num_running for entry in client.stats().engines]
        assert sorted(running) == [0, 1]
        stream.close()
        deadline = time.monotonic() + 10
        while (stats := client.stats()).num_running and time.monotonic() < deadline:
            time.sleep(0.05)
    assert [entry.stats.num_running for entry in stats.engines] == [0, 0]
    assert all(entry.in_flight_requests == 0 for entry in stats.engines)
    stats = server.wait_all_blocks_free()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert stats.num_finished_abort >= 1


def test_a_killed_worker_of_one_engine_is_replaced_while_the_front_keeps_serving(server, model):
    """Each engine keeps its own crash recovery: its streams resume token-exact, and the other engine serves on."""
    health = HealthWatch(server.target)
    rng = random.Random(8)
    prompts = [[rng.randrange(512) for _ in range(20)] for _ in range(6)]
    streams = [StreamWatch(server.target, prompt, max_tokens=RECOVERY_TOKENS, temperature=0.0, ignore_eos=True)
               for prompt in prompts]
    for stream in streams:
        assert stream.first_chunk.wait(120), "a stream got no first chunk"
    (engine_0_worker,) = [pid for pid, command in zip(server.children, _command_lines(server.children))
                          if "-m worker_svc " in command and "workers-0.sock" in command]
    os.kill(engine_0_worker, signal.SIGKILL)
    for stream in streams:
        stream.join(timeout=180)
    health.close()
    assert [stream.error for stream in streams] == [None] * len(prompts)
    for prompt, stream in zip(prompts, streams):
        assert [token for chunk in stream.chunks for token in chunk.token_ids] == hf_greedy(model, prompt,
                                                                                             RECOVERY_TOKENS)
    assert "NOT_SERVING" not in health.statuses, health.statuses
    log = server.log()
    assert "the engine 0 worker rank 0 exited" in log and "restarting the workers" in log


def test_the_ray_backend_places_each_engine_in_its_own_placement_group_with_the_tokens_of_mp(server, model,
                                                                                            tmp_path):
    """`-dp 2 --distributed-executor-backend ray`: a private local Ray instance, one placement group per engine,
    each engine's worker a Ray actor reaching its own scheduler over TCP; the same greedy tokens as the local
    processes' -dp 2, requests spread over both engines, and nothing of the stack or of Ray left once it stops
    (running_server checks every process it started is gone)."""
    import re

    rng = random.Random(12)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(20, 40))] for _ in range(6)]
    with running_server(tmp_path, "--model", str(model), "-dp", "2", "--max-model-len", "512",
                        "--distributed-executor-backend", "ray", ready_timeout=240) as on_ray:
        results = _generate_all(on_ray, prompts)
        routed = [entry.routed_requests for entry in _engines(on_ray)]
    log = on_ray.log()
    assert [list(r.token_ids) for r in results] == [list(r.token_ids) for r in _generate_all(server, prompts)]
    assert min(routed) >= 1 and sum(routed) == 6, routed
    assert "Started a local Ray instance" in log
    addresses = re.findall(r"waiting for 1 worker\(s\) on (tcp://\S+)", log)
    assert len(set(addresses)) == 2, addresses  # one TCP address per engine


@pytest.fixture(scope="module")
def tokenized_model(tmp_path_factory):
    """A tiny model with the embedded model's tokenizer (bench serve's multi-turn prompts are text)."""
    from pagedserve.testing.tiny_models import add_embedded_tokenizer

    return add_embedded_tokenizer(make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=4,
                                                  vocab_size=49152, eos_token_id=2))


@pytest.fixture(scope="module")
def failover_server(tokenized_model, tmp_path_factory):
    """-dp 2 with one running request per engine (--max-num-seqs 1: later ones queue) and no scheduler
    restarts (a killed engine is gone for good). The kill test runs last on it."""
    with running_server(tmp_path_factory.mktemp("failover"), "--model", str(tokenized_model), "-dp", "2",
                        "--max-model-len", "512", "--max-num-seqs", "1", "--max-scheduler-restarts", "0") as running:
        yield running


def test_bench_serve_multi_turn_keeps_each_conversation_on_one_engine_whose_cache_serves_its_history(
        failover_server, tokenized_model, tmp_path):
    """`bench serve --dataset-name multi-turn` over gRPC against -dp 2 (prefix policy), on a tiny model with a
    real tokenizer: every turn completes, each turn's prompt is the previous turn's history and more, and the
    record's server prefill counts show the prefix cache serving the later turns (the engines' own counters)."""
    from pagedserve.cli import main

    server, model = failover_server, tokenized_model
    conversations, turns, prefix_len = 4, 3, 64
    before = [entry.routed_requests for entry in _engines(server)]
    code = main(["bench", "serve", "--backend", "grpc", "--base-url", server.target, "--tokenizer", str(model),
                 "--dataset-name", "multi-turn", "--multi-turn-num-conversations", str(conversations),
                 "--multi-turn-num-turns", str(turns), "--multi-turn-prefix-len", str(prefix_len),
                 "--multi-turn-input-len", "8", "--multi-turn-output-len", "6", "--max-active-conversations",
                 "2", "--ignore-eos", "--metric-percentiles", "50,99", "--disable-tqdm", "--result-dir",
                 str(tmp_path), "--result-filename", "multi_turn.json"])
    assert code == 0
    engines = _engines(server)
    record = json.loads((tmp_path / "multi_turn.json").read_text())
    assert (record["completed"], record["failed"]) == (conversations * turns, 0), record["errors"]
    assert record["p50_ttft_ms"] <= record["p99_ttft_ms"]
    for index in range(conversations):
        lens = record["input_lens"][index * turns:(index + 1) * turns]
        assert all(later >= earlier + 6 + 8 - 2 for earlier, later in zip(lens, lens[1:])), lens  # a token of slack
    prefill = record["server_prefill"]
    assert set(prefill["per_engine"]) == {"0", "1"}
    assert prefill["prompt_tokens"] == sum(record["input_lens"])
    assert prefill["computed_prefill_tokens"] == prefill["prompt_tokens"] - prefill["cached_tokens"]
    # Each later turn finds at least its conversation's first 3 blocks (48 of the 64 prefix tokens) cached.
    assert prefill["cached_tokens"] >= conversations * (turns - 1) * 48
    routed = [entry.routed_requests - earlier for entry, earlier in zip(engines, before)]
    assert sum(routed) == conversations * turns + 1  # and the test request


def _engine_pids(server, engine: int) -> list[int]:
    """Engine `engine`'s scheduler and worker: both name its private worker socket."""
    return [pid for pid, command in zip(server.children, _command_lines(server.children))
            if f"workers-{engine}.sock" in command]


def test_a_killed_engines_queued_requests_finish_on_the_other_engine_and_its_started_one_resumes(
        failover_server, tokenized_model):
    """A whole engine (scheduler and worker) killed for good while one request streams on it and four wait
    behind it (--max-num-seqs 1): the four are sent again by the front and the streaming one is resumed by the
    SDK, all on the other engine with a single engine's greedy tokens; the front never stops serving."""
    server, model = failover_server, tokenized_model
    rng = random.Random(9)
    prefix = [rng.randrange(512) for _ in range(32)]  # one first block: all go to one engine (prefix policy)
    prompts = [prefix + [rng.randrange(512) for _ in range(rng.randrange(1, 10))] for _ in range(5)]
    health = HealthWatch(server.target)
    started = StreamWatch(server.target, prompts[0], max_tokens=RECOVERY_TOKENS, temperature=0.0,
                          ignore_eos=True)
    assert started.first_chunk.wait(120) and started.error is None
    home = [entry.stats.num_running for entry in _engines(server)].index(1)
    queued = [StreamWatch(server.target, prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
              for prompt in prompts[1:]]
    deadline = time.monotonic() + 60
    while _engines(server)[home].stats.num_waiting < 4:
        assert time.monotonic() < deadline, "the four requests did not queue behind the first"
        time.sleep(0.05)
    assert not any(stream.chunks for stream in queued)
    for pid in _engine_pids(server, home):
        os.kill(pid, signal.SIGKILL)
    for stream in [started, *queued]:
        stream.join(timeout=180)
    health.close()
    assert [stream.error for stream in [started, *queued]] == [None] * 5, server.log()[-3000:]
    for prompt, stream, max_tokens in zip(prompts, [started, *queued], [RECOVERY_TOKENS] + [MAX_TOKENS] * 4):
        tokens = [token for chunk in stream.chunks for token in chunk.token_ids]
        assert tokens == hf_greedy(model, prompt, max_tokens)
    (survivor,) = _engines(server)
    assert survivor.engine == 1 - home and survivor.stats.num_finished_stop + survivor.stats.num_finished_length >= 5
    assert "NOT_SERVING" not in health.statuses, health.statuses
    assert f"engine {home} is gone, the other engines serve on" in server.log()


def test_dp1_keeps_todays_layout_with_no_front(model, tmp_path):
    with running_server(tmp_path, "--model", str(model), "-dp", "1", "--max-model-len", "512") as lone:
        commands = _command_lines(lone.children)
        assert not any(FRONT_MODULE in command for command in commands)
        assert sum("-m scheduler_svc " in command for command in commands) == 1
        with lone.client() as client:
            assert client.stats().engines == ()


def test_dp2_with_two_front_processes_gives_a_single_engines_greedy_tokens_over_many_connections(model, tmp_path):
    """`--api-server-count 2`: a supervisor and two front processes on the public port; requests over
    connections of their own (spread over both processes) get transformers' greedy tokens and reach both
    engines; the stack stops cleanly (the harness checks every process is gone)."""
    import asyncio

    from client import AsyncClient

    rng = random.Random(9)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(20, 40))] for _ in range(8)]
    with running_server(tmp_path, "--model", str(model), "-dp", "2", "--api-server-count", "2", "--max-model-len",
                        "512") as server:
        commands = _command_lines(server.children)
        assert sum(f"-m {FRONT_MODULE} " in command for command in commands) == 3
        assert sum("--api-server-rank" in command for command in commands) == 2

        async def generate_each_on_its_own_connection():
            clients = [AsyncClient(server.target, own_connection=True) for _ in prompts]
            try:
                return await asyncio.gather(*(client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                                              ignore_eos=True)
                                              for client, prompt in zip(clients, prompts)))
            finally:
                for client in clients:
                    await client.close()

        results = asyncio.run(generate_each_on_its_own_connection())
        finished = [entry.stats.num_finished_requests for entry in _engines(server)]  # the engines' own counts
    for prompt, result in zip(prompts, results):
        assert list(result.token_ids) == hf_greedy(model, prompt, MAX_TOKENS)
    assert sum(finished) >= len(prompts) and min(finished) > 0, finished
