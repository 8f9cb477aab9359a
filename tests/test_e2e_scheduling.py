"""Scheduler features end to end through the real processes on tiny random models: prefix caching and
chunked prefill change no greedy output, a shared prefix is not computed twice, n sequences share the
prompt's blocks, beam search equals transformers', long prompts are chunked without stalling decodes,
priorities order admission, and an explicit abort ends every sequence of a request."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pagedserve.testing.hf_reference import _load, hf_greedy
from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import make_tiny_model
from scheduler_svc.worker_io.plan_log import read_plan_log

MAX_TOKENS = 20
BLOCK = 16


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=11)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "qwen2", seed=12)


@pytest.fixture(scope="module")
def llama_server(llama, tmp_path_factory):
    """The tiny Llama with the default flags, for the tests that need no flag of their own (beam search, explicit
    aborts): one server start instead of one a test; each of them waits until every block is free again."""
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(llama)) as server:
        yield server


def _shared_prefix_prompts(count: int, prefix_len: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(512) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(512) for _ in range(rng.randrange(1, 30))] for _ in range(count)]


def _greedy(server, prompts, **kwargs):
    def one(prompt):
        with server.client() as client:
            return client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kwargs)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


@pytest.mark.parametrize("flags", [
    ["--max-num-batched-tokens", "24"],  # prefix caching on, prompts chunked
    ["--no-prefix-caching", "--no-chunked-prefill"],
    ["--no-async-scheduling"],
    ["--max-steps-in-flight", "2", "--max-num-batched-tokens", "24"],
], ids=["prefix-cache-and-chunking", "neither", "sync-scheduling", "one-step-ahead"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equals_transformers_with_prefix_caching_and_chunking_on_or_off(request, arch, tmp_path, flags):
    model = request.getfixturevalue(arch)
    prompts = _shared_prefix_prompts(8, seed=3)
    with running_server(tmp_path, "--model", str(model), *flags) as server:
        first = _greedy(server, prompts[:1])  # fills the cache before the rest arrive
        rest = _greedy(server, prompts[1:])
        stats = server.wait_all_blocks_free()
    for prompt, result in zip(prompts, first + rest):
        assert list(result.token_ids) == hf_greedy(model, prompt, MAX_TOKENS)
    if "--no-prefix-caching" in flags:
        assert stats.prefix_cache_hit_tokens == 0
    else:
        assert stats.prefix_cache_hit_tokens >= 7 * 32 and stats.prefix_cache_hit_rate > 0.3


@pytest.mark.parametrize("steps_in_flight", [2, 3])
def test_async_scheduling_plans_the_next_step_before_a_stop_is_known(llama, tmp_path, steps_in_flight):
    """Steps after N are planned while step N runs: a request that samples its stop token in step N was
    already planned in the steps_in_flight - 1 steps after it (wasted tokens, dropped), and its output still
    ends exactly at the stop token."""
    prompt = _shared_prefix_prompts(1, prefix_len=10, seed=9)[0]
    log = tmp_path / "plans.bin"
    with running_server(tmp_path, "--model", str(llama), "--plan-log", str(log),
                        "--max-steps-in-flight", str(steps_in_flight)) as server:
        with server.client() as client:
            free_run = client.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids
            stop_at = next(i for i in range(1, 8) if free_run[i] not in free_run[:i])
            stopped = client.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True, request_id="stopper",
                                      stop_token_ids=[free_run[stop_at]])
    assert list(stopped.token_ids) == list(free_run[: stop_at + 1]) and stopped.finish_reason == "stop"
    plans = list(read_plan_log(log))
    steps = [p.step_id for p in plans
             if any(r.request_id == "stopper" for r in (*p.new_requests, *p.scheduled_requests))]
    assert len(steps) == stop_at + steps_in_flight, "prefill, a decode per later token, the steps planned ahead"
    ended = next(p.step_id for p in plans if "stopper" in p.finished_request_ids)
    assert ended > steps[-1]


def test_a_shared_prefix_is_computed_once(llama, tmp_path):
    prompts = _shared_prefix_prompts(2, prefix_len=50, seed=4)
    log = tmp_path / "plans.bin"
    with running_server(tmp_path, "--model", str(llama), "--plan-log", str(log)) as server:
        with server.client() as client:
            client.generate(prompts[0], max_tokens=4, temperature=0.0, request_id="first")
            client.generate(prompts[1], max_tokens=4, temperature=0.0, request_id="second")
    plans = list(read_plan_log(log))
    admitted = [n for p in plans for n in p.new_requests if n.request_id == "second"]
    assert admitted[0].num_computed_tokens == 48, "the 3 full blocks of the shared 50-token prefix are reused"
    prefill = sum(n.num_scheduled_tokens for n in admitted)
    assert prefill == len(prompts[1]) - 48


def test_n_sequences_share_the_prompts_full_blocks(llama, tmp_path):
    rng = random.Random(5)
    prompt = [rng.randrange(512) for _ in range(500)]
    log = tmp_path / "plans.bin"
    with running_server(tmp_path, "--model", str(llama), "--plan-log", str(log)) as server:
        with server.client() as client:
            result = client.generate(prompt, n=4, max_tokens=8, temperature=1.0, seed=9, request_id="fan")
        stats = server.wait_all_blocks_free()
    assert [o.index for o in result.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 8 for o in result.outputs)
    assert len({o.token_ids for o in result.outputs}) > 1, "four samples at temperature 1 should differ"
    plans = list(read_plan_log(log))
    children = [n for p in plans for n in p.new_requests if n.request_id.startswith("fan#")]
    assert len(children) == 4
    full_blocks = 500 // BLOCK  # 31: held once, by all four
    assert len({tuple(c.block_ids[:full_blocks]) for c in children}) == 1
    assert all(c.num_computed_tokens == 499 for c in children)
    copies = sum(len(p.copy) for p in plans)
    assert copies >= 3, "the shared partial block is copied on first write"
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_beam_search_equals_transformers(llama, llama_server):
    rng = random.Random(6)
    prompt = [rng.randrange(512) for _ in range(21)]
    model = _load(str(llama))
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  num_beams=4, do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                  length_penalty=1.0, early_stopping=False, eos_token_id=None, pad_token_id=0,
                                  temperature=None, top_p=None, top_k=None)[0, len(prompt):].tolist()
    server = llama_server
    with server.client() as client:
        result = client.generate(prompt, beam_width=4, max_tokens=12, temperature=0.0, length_penalty=1.0)
        both = client.generate(prompt, beam_width=4, n=2, max_tokens=12, temperature=0.0)
    stats = server.wait_all_blocks_free()
    assert list(result.token_ids) == expected
    assert both.outputs[0].token_ids == result.token_ids and len(both.outputs) == 2
    assert both.outputs[0].cumulative_logprob >= both.outputs[1].cumulative_logprob
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_a_long_prompt_is_chunked_while_decodes_keep_going(llama, tmp_path):
    budget = 64
    log = tmp_path / "plans.bin"
    rng = random.Random(7)
    with running_server(tmp_path, "--model", str(llama), "--max-num-batched-tokens", str(budget),
                        "--plan-log", str(log)) as server:
        started = threading.Barrier(17)
        results = {}

        def decode(i):
            with server.client() as client:
                stream = client.generate_stream([rng.randrange(512) for _ in range(3)], max_tokens=60,
                                                temperature=0.0, ignore_eos=True, request_id=f"d{i}")
                next(stream)
                started.wait()
                results[i] = list(stream)

        threads = [threading.Thread(target=decode, args=(i,)) for i in range(16)]
        for thread in threads:
            thread.start()
        started.wait()
        with server.client() as client:
            long = client.generate([rng.randrange(512) for _ in range(4 * budget)], max_tokens=2, temperature=0.0,
                                   request_id="long")
        for thread in threads:
            thread.join()
    assert long.finish_reason == "length"
    plans = list(read_plan_log(log))
    chunk_steps = [p for p in plans if any(r.request_id == "long" and r.num_scheduled_tokens > 1
                                           for r in list(p.new_requests) + list(p.scheduled_requests))]
    assert len(chunk_steps) >= 4, "a prompt of 4x the token budget takes several steps"
    for plan in chunk_steps:
        scheduled = {r.request_id: r.num_scheduled_tokens for r in list(plan.new_requests) + list(plan.scheduled_requests)}
        decodes = {rid: n for rid, n in scheduled.items() if rid.startswith("d")}
        assert len(decodes) == 16 and set(decodes.values()) == {1}, "every running decode gets its token"
        assert sum(scheduled.values()) <= budget


def test_priority_orders_admission(llama, tmp_path):
    with running_server(tmp_path, "--model", str(llama), "--max-num-seqs", "1") as server:
        finished: list[str] = []

        def run(request_id, priority):
            with server.client() as client:
                client.generate([1, 2, 3], max_tokens=4, temperature=0.0, ignore_eos=True,
                                request_id=request_id, priority=priority)
            finished.append(request_id)

        def wait_waiting(client, count):
            deadline = time.monotonic() + 30
            while client.stats().num_waiting < count and time.monotonic() < deadline:
                time.sleep(0.01)

        with server.client() as client:
            blocker = client.generate_stream([1, 2, 3], max_tokens=400, temperature=0.0, ignore_eos=True)
            next(blocker)  # running: the one sequence slot is taken
            low = threading.Thread(target=run, args=("low", 5))
            low.start()
            wait_waiting(client, 1)
            high = threading.Thread(target=run, args=("high", -1))
            high.start()
            wait_waiting(client, 2)
            assert len(list(blocker)) > 0, "the blocker was still running when both others waited"
        for thread in (low, high):
            thread.join()
    assert finished == ["high", "low"]


@pytest.mark.parametrize("kwargs", [dict(), dict(n=3, temperature=1.0), dict(beam_width=3, temperature=0.0)],
                         ids=["single", "n3", "beams"])
def test_explicit_abort_ends_every_sequence_and_frees_blocks(llama_server, kwargs):
    server = llama_server
    chunks = []

    def consume():
        with server.client() as client:
            chunks.extend(client.generate_stream([5] * 30, max_tokens=400, ignore_eos=True, request_id="victim",
                                                 **kwargs))

    consumer = threading.Thread(target=consume)
    consumer.start()
    with server.client() as client:
        deadline = time.monotonic() + 30
        while client.stats().num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert client.abort("victim")
        consumer.join(timeout=30)
        assert not consumer.is_alive()
        assert not client.abort("victim")
    stats = server.wait_all_blocks_free()
    finals = [c for c in chunks if c.finish_reason is not None]
    expected_sequences = kwargs.get("n", 1)
    assert sorted(c.index for c in finals) == list(range(expected_sequences))
    assert all(c.finish_reason == "abort" for c in finals)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
