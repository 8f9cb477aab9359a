"""Tensor parallel through the real processes (`pagedserve serve -tp 2`: one scheduler, two worker ranks in a
gloo group on the CPU): greedy output equals transformers token for token with chunked prefill, prefix
caching and preemption by recompute or swap, on Llama with fewer KV heads than ranks and on Qwen2; a seeded
request samples the same tokens with one rank or two; a non-zero rank that dies or fails ends every stream
with a clear error and takes the stack down in bounded time; a size the model's heads do not allow is refused
before anything loads.

Each rank holds and computes its shard of the model (worker_svc/layers/: tests/test_parallel_layers.py checks
the layers alone); these tests add the processes: rank start-up and rendezvous, plans reaching every rank,
rank 0 alone answering, the agreed KV pool, fault handling, and the Ray executor.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.cli import build_parser
from pagedserve.launcher import _scheduler_argv, worker_rank_argvs
from pagedserve.private_server import server_argv
from pagedserve.testing.hf_reference import hf_greedy
from pagedserve.testing.server_harness import REPO_ROOT, free_port, launched_server, running_server
from pagedserve.testing.tiny_models import make_tiny_model
from tests.stream_watch import HealthWatch, assert_fault_handled, rank_pid, start_streams
from worker_svc.tensor_parallel_fit import gpus_refusal

MAX_TOKENS = 20
PROMPT_LENGTHS = [5, 17, 31, 40, 9, 23, 15, 33, 47, 3, 29, 12, 50, 7, 35, 21]
# 10 blocks of 16 tokens hold any one request but not all at once (preemption); 32 tokens a step chunk the
# longer prompts; prefix caching is on by default.
SMALL_POOL = ["--num-kv-blocks", "10", "--max-num-batched-tokens", "32", "--swap-space", "0.01"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    directory = tmp_path_factory.mktemp("models")
    # Llama with one KV head for two ranks (replicated KV heads); Qwen2 with as many KV heads as ranks.
    return {"llama": make_tiny_model(directory, "llama", seed=3, num_key_value_heads=1),
            "qwen2": make_tiny_model(directory, "qwen2", seed=4)}


@pytest.fixture(scope="module")
def llama_tp2(models, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("llama-tp2"), "--model", str(models["llama"]), "-tp", "2",
                        *SMALL_POOL, "--preemption-mode", "recompute") as server:
        yield server


@pytest.fixture(scope="module")
def qwen2_tp2(models, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("qwen2-tp2"), "--model", str(models["qwen2"]), "-tp", "2",
                        *SMALL_POOL, "--preemption-mode", "recompute") as server:
        yield server


def _random_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)])] for i in range(count)]


def _shared_prefix_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(512) for _ in range(40)]
    return [prefix + [rng.randrange(512) for _ in range(rng.randrange(1, 20))] for _ in range(count)]


def _generate_all(server, prompts, **sampling) -> list:
    sampling = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True) | sampling

    def one(prompt):
        with server.client() as client:
            return client.generate(prompt, **sampling)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _assert_matches_transformers(model_dir, prompts, results) -> None:
    for prompt, result in zip(prompts, results):
        assert list(result.token_ids) == hf_greedy(model_dir, prompt, MAX_TOKENS)
        assert result.finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_greedy_equals_transformers_with_prefix_cache_chunking_and_recompute(request, models, arch):
    server = request.getfixturevalue(f"{arch}_tp2")
    before = server.wait_all_blocks_free()
    shared = _shared_prefix_prompts(3, seed=5)
    first = _generate_all(server, shared[:1])  # fills the prefix cache before the others arrive
    rest = _generate_all(server, shared[1:])
    cached = server.wait_all_blocks_free()
    crowd = _random_prompts(16, seed=6)
    crowded = _generate_all(server, crowd)
    after = server.wait_all_blocks_free()
    _assert_matches_transformers(models[arch], shared + crowd, first + rest + crowded)
    assert cached.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens >= 32, "the shared prefix was recomputed"
    assert after.num_preemptions > cached.num_preemptions, "the pool was meant to force preemption"
    assert after.num_free_kv_blocks == after.num_kv_blocks == 10


def test_tp2_greedy_equals_transformers_under_preemption_by_swap(models, tmp_path):
    prompts = _random_prompts(16, seed=7)
    with running_server(tmp_path, "--model", str(models["llama"]), "-tp", "2", *SMALL_POOL,
                        "--preemption-mode", "swap") as server:
        results = _generate_all(server, prompts)
        stats = server.wait_all_blocks_free()
    _assert_matches_transformers(models["llama"], prompts, results)
    assert stats.num_swapped_out_blocks > 0, "swap mode must swap blocks out"
    assert stats.num_free_swap_blocks == stats.num_swap_blocks


def test_seeded_sampling_gives_the_same_tokens_with_one_rank_and_two(models, llama_tp2, tmp_path):
    prompts = _random_prompts(6, seed=8)
    seeded = [dict(temperature=1.0, seed=100 + i, max_tokens=16) for i in range(len(prompts))]

    def sample_all(server):
        def one(index):
            with server.client() as client:
                return list(client.generate(prompts[index], ignore_eos=True, **seeded[index]).token_ids)

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(one, range(len(prompts))))

    two_ranks = sample_all(llama_tp2)
    with running_server(tmp_path, "--model", str(models["llama"])) as one_rank_server:
        one_rank = sample_all(one_rank_server)
    assert two_ranks == one_rank
    assert len({tuple(tokens) for tokens in one_rank}) == len(prompts), "seeds must give distinct draws"


# ---- faults ------------------------------------------------------------------------------------------------


def test_a_killed_nonzero_rank_ends_every_stream_unavailable_and_the_stack_exits(models, tmp_path):
    with launched_server(tmp_path, "--model", str(models["llama"]), "-tp", "2", "--num-kv-blocks", "256",
                         "--max-worker-restarts", "0") as server:
        health = HealthWatch(server.target)
        streams = start_streams(server.target, 4, max_tokens=400)
        killed_at = time.monotonic()
        os.kill(rank_pid(server.children, 1), signal.SIGKILL)
        # Rank 1's connection closing, or (sharded) rank 0's collective failing on the lost peer: either way
        # a rank is named.
        assert_fault_handled(server, streams, health, killed_at, re.compile(r"worker rank [01] (disconnected|failed)"))
        health.close()


def test_a_step_that_fails_on_a_nonzero_rank_is_reported_by_that_rank(models, tmp_path):
    # The launcher gives --fail-at-step to the last rank only: rank 0 would run on, so only rank 1's
    # WorkerError can end the streams.
    with launched_server(tmp_path, "--model", str(models["llama"]), "-tp", "2", "--num-kv-blocks", "256",
                         "--fail-at-step", "60", "--max-worker-restarts", "0") as server:
        health = HealthWatch(server.target)
        streams = start_streams(server.target, 4, max_tokens=400)
        assert_fault_handled(server, streams, health, None,
                             re.compile(r"worker rank 1 failed at step \d+: .*failed on purpose"))
        health.close()


def test_a_stopped_nonzero_rank_misses_its_heartbeats_and_is_killed_with_the_stack(tmp_path):
    # A stopped rank stands for one hung in a collective: nothing closes its connection, only silence tells.
    # Until the layers are sharded, rank 0 runs on without rank 1, so the streams must outlast the 3 s of
    # silence: a context of 4096 positions, 3000 tokens each.
    model = make_tiny_model(tmp_path, "llama", seed=3, num_key_value_heads=1, max_position_embeddings=4096)
    with launched_server(tmp_path, "--model", str(model), "-tp", "2", "--num-kv-blocks", "1024",
                         "--heartbeat-interval", "1", "--heartbeat-grace", "0", "--max-worker-restarts", "0") as server:
        health = HealthWatch(server.target)
        streams = start_streams(server.target, 4, max_tokens=3000)
        rank1 = rank_pid(server.children, 1)
        stopped_at = time.monotonic()
        os.kill(rank1, signal.SIGSTOP)
        try:
            # 3 missed heartbeats or more: on a loaded machine the scheduler's check may come a beat late.
            assert_fault_handled(server, streams, health, stopped_at,
                                 re.compile(r"worker rank 1 missed [3-9] heartbeats"))
        finally:
            if os.path.exists(f"/proc/{rank1}"):
                os.kill(rank1, signal.SIGKILL)
        health.close()


# ---- refusals and command lines ----------------------------------------------------------------------------


def test_a_size_that_does_not_divide_the_heads_is_refused_before_anything_starts(models):
    completed = subprocess.run(
        [sys.executable, "-m", "pagedserve", "serve", "--model", str(models["llama"]), "-tp", "3", "--no-http",
         "--grpc-port", str(free_port())], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert completed.returncode != 0
    assert "--tensor-parallel-size 3 does not divide the model's 4 attention heads" in completed.stderr
    assert "gRPC listening" not in completed.stderr, "the scheduler must not have started"


def test_a_worker_started_alone_refuses_a_world_size_that_does_not_divide_the_heads(models):
    completed = subprocess.run(
        [sys.executable, "-m", "worker_svc", "--model", str(models["llama"]), "--rank", "0", "--world-size", "3",
         "--distributed-init-method", f"tcp://127.0.0.1:{free_port()}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert completed.returncode != 0
    assert "--world-size 3 does not divide the model's 4 attention heads" in completed.stderr


def test_the_launcher_starts_one_worker_per_rank_on_its_own_gpu_with_one_rendezvous():
    args = build_parser().parse_args(["serve", "--model", "m", "-tp", "4", "--device", "cuda",
                                      "--fail-at-step", "7"])
    ranks = worker_rank_argvs(args, ["--model", "m"], "ipc://workers", "tcp://127.0.0.1:29500")
    assert len(ranks) == 4
    for rank, argv in enumerate(ranks):
        flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1)}
        assert flags["--rank"] == str(rank) and flags["--world-size"] == "4"
        assert flags["--device"] == f"cuda:{rank}"
        assert flags["--distributed-init-method"] == "tcp://127.0.0.1:29500"
        assert ("--fail-at-step" in argv) == (rank == 3)
    scheduler = _scheduler_argv(args, ["--model", "m"], "ipc://workers")
    assert scheduler[scheduler.index("--num-workers") + 1] == "4"
    single = build_parser().parse_args(["serve", "--model", "m"])
    (only,) = worker_rank_argvs(single, [], "ipc://workers", None)
    assert "--rank" not in only and "--distributed-init-method" not in only
    assert server_argv("m", {"tensor_parallel_size": 2})[-2:] == ["--tensor-parallel-size", "2"]


def test_more_ranks_than_visible_gpus_are_refused_naming_the_flag_and_both_numbers():
    assert gpus_refusal(2, 0, 2) is None
    message = gpus_refusal(4, 0, 2)
    assert "--tensor-parallel-size 4" in message and "needs 4 GPUs" in message and "2 are visible" in message
    assert "from cuda:1" in gpus_refusal(2, 1, 2)


def test_the_ray_backend_places_the_ranks_and_gives_the_tokens_of_mp(models, llama_tp2, tmp_path):
    """`--distributed-executor-backend ray`: a private local Ray instance, a placement group of two CPU
    bundles, each rank a Ray actor running the worker; the scheduler on TCP. Same greedy tokens as the mp
    server, and nothing of the stack or of Ray is left once it stops."""
    prompts = _random_prompts(4, seed=11)
    with running_server(tmp_path, "--model", str(models["llama"]), "-tp", "2", *SMALL_POOL,
                        "--distributed-executor-backend", "ray", ready_timeout=240) as server:
        on_ray = _generate_all(server, prompts)
    log = server.log()  # whole once stopped: Ray forwards the ranks' lines in batches
    assert [r.token_ids for r in on_ray] == [r.token_ids for r in _generate_all(llama_tp2, prompts)]
    assert "Started a local Ray instance" in log
    assert re.search(r"waiting for 2 worker\(s\) on tcp://", log), "with Ray the scheduler listens on TCP"
    for rank in (0, 1):
        assert re.search(rf"RankHost.*rank {rank}: joining the tensor-parallel group of 2 at tcp://", log), rank
