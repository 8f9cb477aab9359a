"""Structured outputs among other requests and across preemption, through the real processes (tiny random Llama
with SmolLM2's tokenizer): a constrained request in the batch leaves the unconstrained requests' greedy tokens
exactly as they are alone (the mask touches its own row only), and a constrained greedy request preempted
mid-output (priority preemption by recompute: its matcher is rebuilt from its output so far) returns the same
tokens as alone, valid against its schema."""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from client.types import GenerationResult
from pagedserve.testing.server_harness import running_server
from pagedserve.testing.tiny_models import add_embedded_tokenizer, make_tiny_model
from scheduler_svc.worker_io.plan_log import read_plan_log

# Bounded everywhere, so greedy output ends: short strings, enums, few items, no free whitespace.
BADGE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "level": {"enum": ["low", "mid", "high"]},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 2},
    },
    "required": ["name", "level", "tags"],
    "additionalProperties": False,
}
CONSTRAINED = dict(structured_outputs=dict(json=json.dumps(BADGE), disable_any_whitespace=True))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=4, vocab_size=49216, eos_token_id=2)
    return add_embedded_tokenizer(model_dir)


@pytest.fixture(scope="module")
def plan_log(tmp_path_factory):
    return tmp_path_factory.mktemp("plans") / "plans.bin"


@pytest.fixture(scope="module")
def server(model, plan_log, tmp_path_factory):
    # 24 blocks of 16 tokens: eight 40-token requests cannot all fit beside the probe.
    with running_server(tmp_path_factory.mktemp("logs"), "--model", str(model), "--max-model-len", "256",
                        "--num-kv-blocks", "24", "--plan-log", str(plan_log),
                        # A slowed prefill (hidden test flag): the crowd arrives together however fast steps are.
                        "--prefill-seconds-per-token", "0.002") as running:
        yield running


pytestmark = pytest.mark.usefixtures("no_block_leaks")


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(length)]


def test_a_constrained_request_leaves_the_unconstrained_ones_tokens_unchanged(server):
    plain = [(_prompt(12, seed=i), dict(temperature=0.0, max_tokens=16)) for i in range(3)]
    constrained = (_prompt(12, seed=9), dict(temperature=1.0, seed=2, max_tokens=80, **CONSTRAINED))

    def run(jobs):
        with server.client() as client, ThreadPoolExecutor(len(jobs)) as pool:
            return list(pool.map(lambda job: client.generate(job[0], **job[1]), jobs))

    alone = run(plain)
    *beside, badge = run([*plain, constrained])
    assert [r.token_ids for r in beside] == [r.token_ids for r in alone]
    assert badge.finish_reason == "stop"
    jsonschema.validate(json.loads(badge.text), BADGE)


def test_constrained_greedy_output_survives_a_preemption_identically(server, plan_log):
    prompt = _prompt(20, seed=8)
    probe = dict(temperature=0.0, max_tokens=120, **CONSTRAINED)
    with server.client() as client:
        alone = client.generate(prompt, **probe)
    assert alone.finish_reason == "stop"
    jsonschema.validate(json.loads(alone.text), BADGE)

    others = [(_prompt(40, seed=20 + i), dict(temperature=0.0, max_tokens=40, ignore_eos=True)) for i in range(8)]
    started = threading.Event()

    def run_probe():
        with server.client() as client:
            chunks = []
            for chunk in client.generate_stream(prompt, request_id="probe", priority=1, **probe):
                chunks.append(chunk)
                started.set()
            return GenerationResult.from_chunks(chunks)

    def run_other(job):
        with server.client() as client:
            return client.generate(job[0], **job[1])

    with ThreadPoolExecutor(len(others) + 1) as pool:
        crowded = pool.submit(run_probe)
        assert started.wait(timeout=120)
        for result in pool.map(run_other, others):
            assert result.finish_reason == "length"
        crowded = crowded.result()
    assert any("probe" in plan.preempted_request_ids for plan in read_plan_log(plan_log)), "the probe was preempted"
    resumed = [new for plan in read_plan_log(plan_log) for new in plan.new_requests
               if new.request_id == "probe" and new.num_prompt_tokens < len(new.token_ids)]
    assert resumed and all(new.sampling.structured_grammar for new in resumed), "resumed mid-output, constrained"
    assert crowded.token_ids == alone.token_ids and crowded.text == alone.text
