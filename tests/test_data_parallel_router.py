"""The data-parallel front's parts without engines: the routing policies (router.py), the prefix keys the
front computes from a request (prefix_key.py), its summed GetStats and the gateway's per-engine metrics; then
the front process itself before two stand-in schedulers (fake_generation_server.py): round-robin alternates,
least-load spreads a burst and avoids a busy engine, a client's cancel reaches the engine, an engine's refusal
reaches the client unchanged, and an engine that stops serving gets no request. The real engines:
tests/test_data_parallel_e2e.py."""

from __future__ import annotations

import random
import subprocess
import sys
import contextlib
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from client import Client, InvalidRequestError, ServerUnavailableError
from client.types import ModelInfo, ServerStats
from gateway.metrics import render_metrics
from gateway.vllm_metrics import ServedModel
from pagedserve.free_port import free_port
from pagedserve.health_probe import grpc_serving
from pagedserve.testing.server_harness import REPO_ROOT
from protos.pagedserve.v1 import generate_pb2
from scheduler_svc.core.block_hash import adapter_root_key, chain_block_key
from scheduler_svc.data_parallel.engine_stats import front_stats
from scheduler_svc.data_parallel.prefix_key import prefix_key
from scheduler_svc.data_parallel.router import Router
from scheduler_svc.text.tokenizer_loading import load_tokenizer
from service_runtime.model_source import resolve_model
from tests.fake_generation_server import MODEL_INFO, STATS

BOTH = [0, 1]


def _keys(count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [chain_block_key(None, [rng.randrange(512) for _ in range(16)]) for _ in range(count)]


# ---- router.py ---------------------------------------------------------------------------------------------

def test_round_robin_alternates_over_the_serving_engines():
    router = Router("round-robin", 3)
    assert [router.route(None, [0, 1, 2]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [router.route(None, [0, 2]) for _ in range(4)] == [0, 2, 0, 2]  # engine 1 not serving


def test_least_load_spreads_a_burst_evenly_and_avoids_the_busy_engine():
    router = Router("least-load", 2)
    burst = [router.route(None, BOTH) for _ in range(8)]  # none ends before the last arrives
    assert burst.count(0) == burst.count(1) == 4
    for engine in burst:
        router.release(engine)
    busy = router.route(None, BOTH)
    later = []
    for _ in range(4):  # each short request ends before the next; the first stays in flight
        later.append(router.route(None, BOTH))
        router.release(later[-1])
    assert set(later) == {1 - busy}
    assert router.routed == [4 + later.count(0) + (busy == 0), 4 + later.count(1) + (busy == 1)]


def test_prefix_policy_sends_each_key_to_one_engine_and_spreads_different_keys():
    router = Router("prefix", 2, load_bound=100)
    keys = _keys(32, seed=1)
    first = [router.route(key, BOTH) for key in keys]
    again = [router.route(key, BOTH) for key in keys]  # all still in flight: the load stays within the bound
    assert first == again
    assert 8 <= first.count(0) <= 24, "rendezvous hashing spreads keys over both engines"


def test_prefix_policy_spills_to_the_least_loaded_engine_past_the_load_bound():
    router = Router("prefix", 2, load_bound=2)
    key = _keys(1, seed=2)[0]
    home = router.route(key, BOTH)
    # A request goes home while home is at most 2 in-flight requests ahead: the 2nd and 3rd (1, 2 ahead) do, the
    # 4th (3 ahead) spills.
    assert [router.route(key, BOTH) for _ in range(2)] == [home, home]
    assert router.route(key, BOTH) == 1 - home
    router.release(1 - home)
    assert router.route(None, BOTH) == 1 - home  # no key (a prompt the front cannot read): least-load


def test_an_engine_that_stops_serving_moves_only_its_own_keys():
    router = Router("prefix", 3, load_bound=1000)
    keys = _keys(60, seed=3)
    with_all = [router.route(key, [0, 1, 2]) for key in keys]
    without_2 = [router.route(key, [0, 1]) for key in keys]
    assert all(after == before for before, after in zip(with_all, without_2) if before != 2)
    assert {after for before, after in zip(with_all, without_2) if before == 2} == {0, 1}


# ---- prefix_key.py -----------------------------------------------------------------------------------------

def _request(**fields) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(**fields)


def test_a_token_prompts_key_is_its_first_blocks_prefix_cache_key():
    ids = list(range(100, 140))
    key = prefix_key(_request(token_ids=generate_pb2.TokenIds(ids=ids)), None, 16)
    assert key == chain_block_key(None, ids[:16])
    assert prefix_key(_request(token_ids=generate_pb2.TokenIds(ids=ids[:16] + [7, 8])), None, 16) == key
    assert prefix_key(_request(token_ids=generate_pb2.TokenIds(ids=[5] + ids[1:])), None, 16) != key
    adapter = prefix_key(_request(token_ids=generate_pb2.TokenIds(ids=ids), lora_name="sql"), None, 16)
    assert adapter == chain_block_key(adapter_root_key("sql", ""), ids[:16])  # by the adapter's name
    assert adapter != key
    assert prefix_key(_request(text="hello"), None, 16) is None  # no tokenizer: the router balances by load


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded default model's (SmolLM2's BPE and chat template): local, no download."""
    return load_tokenizer(resolve_model(None).path)


def _chat(*contents: str) -> generate_pb2.GenerateRequest:
    roles = ["system", *(["user", "assistant"] * len(contents))]
    messages = [generate_pb2.ChatMessage(role=role, content=content) for role, content in zip(roles, contents)]
    return _request(chat=generate_pb2.ChatPrompt(messages=messages))


def test_a_chats_turns_share_their_key_and_other_conversations_differ(tokenizer):
    system = "You are a careful assistant who answers questions about the history of mathematics. " * 3
    first = prefix_key(_chat(system, "Who was Euler?"), tokenizer, 16)
    turn_2 = prefix_key(_chat(system, "Who was Euler?", "A Swiss mathematician.", "And Gauss?"), tokenizer, 16)
    other = prefix_key(_chat("You translate French into English, word for word, and nothing more. " * 3, "Bonjour"),
                       tokenizer, 16)
    assert first == turn_2 and first != other and first is not None
    text = "The quick brown fox jumps over the lazy dog, then naps in the afternoon sun. " * 4
    ids = tokenizer.encode(text)
    assert prefix_key(_request(text=text), tokenizer, 16) == chain_block_key(None, ids[:16])  # the engine's key
    assert prefix_key(_chat(), tokenizer, 16) is None  # a chat the scheduler refuses (no messages)


# ---- GetStats and /metrics ---------------------------------------------------------------------------------

def _engine_stats(running: int, hits: int, queries: int) -> generate_pb2.GetStatsResponse:
    stats = generate_pb2.GetStatsResponse(num_running=running, prefix_cache_hit_tokens=hits,
                                          prefix_cache_query_tokens=queries, prefix_cache_hit_rate=hits / queries,
                                          spec_decode_num_accepted_tokens_per_pos=[running])
    stats.time_to_first_token.upper_bounds.extend([0.5, 1.0])
    stats.time_to_first_token.counts.extend([running, 1, 0])
    stats.time_to_first_token.count = running + 1
    return stats


def test_the_fronts_stats_sum_the_engines_and_carry_each_with_the_router_counts():
    total = front_stats({0: _engine_stats(2, 10, 40), 1: _engine_stats(3, 30, 40)}, routed=[5, 7], in_flight=[2, 3],
                        policy="prefix")
    assert (total.num_running, total.prefix_cache_hit_tokens, total.prefix_cache_hit_rate) == (5, 40, 0.5)
    assert list(total.spec_decode_num_accepted_tokens_per_pos) == [5]
    assert list(total.time_to_first_token.counts) == [5, 2, 0] and total.time_to_first_token.count == 7
    assert [(e.engine, e.stats.num_running, e.routed_requests, e.in_flight_requests) for e in total.engines] == [
        (0, 2, 5, 2), (1, 3, 7, 3)]
    assert total.router_policy == "prefix"


def test_metrics_carry_each_engines_label_and_the_router_counters():
    total = front_stats({0: _engine_stats(2, 10, 40), 1: _engine_stats(3, 30, 40)}, routed=[5, 7], in_flight=[2, 3],
                        policy="least-load")
    text = render_metrics(ServerStats.from_response(total),
                          ServedModel("m", ModelInfo.from_response(MODEL_INFO))).decode()
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 2.0' in text
    assert 'vllm:num_requests_running{engine="1",model_name="m"} 3.0' in text
    assert text.count("# HELP vllm:num_requests_running ") == 1  # one family, a sample per engine
    assert 'pagedserve_router_requests_routed_total{engine="1",policy="least-load"} 7.0' in text
    assert 'pagedserve_router_requests_in_flight{engine="0"} 2.0' in text
    assert "pagedserve_num_requests_running 5.0" in text  # pagedserve's own families: the sums
    lone = render_metrics(ServerStats.from_response(STATS), ServedModel("m", ModelInfo.from_response(MODEL_INFO)))
    assert b'engine="1"' not in lone and b"pagedserve_router" not in lone


# ---- the front process before two stand-in schedulers ------------------------------------------------------



@pytest.fixture
def front(engines, tmp_path):
    """Starts the front with the policy given (a factory); stops each with SIGTERM and checks it exits 0."""
    started = []

    def start(policy: str) -> str:
        for engine in engines:
            engine.reset()
        port = free_port()
        log = open(tmp_path / f"front-{port}.log", "wb")
        process = subprocess.Popen([sys.executable, "-m", "scheduler_svc.data_parallel", "--grpc-port", str(port),
                                    "--router-policy", policy, "--engine-targets", *(e.target for e in engines)],
                                   cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        started.append(process)
        target = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while not grpc_serving(target):
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / f"front-{port}.log").read_text()
            time.sleep(0.1)
        return target

    yield start
    for process in started:
        process.terminate()
        assert process.wait(timeout=30) == 0


def _served_by(engines, before: list[int]) -> int:
    counts = [len(engine.generation.requests) for engine in engines]
    (engine,) = [index for index in BOTH if counts[index] > before[index]]
    return engine


def test_round_robin_through_the_front_alternates_and_relays_every_message(engines, front):
    target = front("round-robin")
    order = []
    with Client(target, max_retries=0) as client:
        for _ in range(6):
            before = [len(engine.generation.requests) for engine in engines]
            result = client.generate("hello")
            assert (result.text, result.finish_reason) == ("Hello world", "stop")
            order.append(_served_by(engines, before))
        assert client.model_info().model_name == "fake-model"
        stats = client.stats()
    assert order in ([0, 1] * 3, [1, 0] * 3)
    assert stats.num_steps == 2 * STATS.num_steps  # the engines' sums
    assert [(e.engine, e.routed_requests, e.in_flight_requests) for e in stats.engines] == [(0, 3, 0), (1, 3, 0)]
    assert stats.router_policy == "round-robin"


def test_least_load_through_the_front_spreads_a_burst_and_avoids_a_busy_engine(engines, front):
    target = front("least-load")
    with Client(target, max_retries=0) as client:
        streams = [client.generate_stream("gated") for _ in range(6)]
        for stream in streams:
            assert next(stream).text == "first"  # each is in flight at its engine before the next starts
        assert [len(engine.generation.requests) for engine in engines] == [3, 3]
        for engine in engines:
            engine.generation.gate.set()
        assert all("".join(chunk.text for chunk in stream) == " second" for stream in streams)
        for engine in engines:
            engine.generation.gate.clear()
        busy_stream = client.generate_stream("gated")
        before = [len(engine.generation.requests) for engine in engines]
        next(busy_stream)
        busy = _served_by(engines, before)
        before = [len(engine.generation.requests) for engine in engines]
        for _ in range(3):
            client.generate("hello")
        after = [len(engine.generation.requests) for engine in engines]
        assert after[busy] == before[busy] and after[1 - busy] == before[1 - busy] + 3
        engines[busy].generation.gate.set()
        list(busy_stream)


def test_a_client_cancel_through_the_front_cancels_the_engines_stream(engines, front):
    target = front("round-robin")
    with Client(target, max_retries=0) as client:
        stream = client.generate_stream("endless")
        next(stream)
        serving = _served_by(engines, [0, 0])
        stream.close()
        assert engines[serving].generation.cancelled.wait(5), "the engine's stream was not cancelled"
        with pytest.raises(InvalidRequestError, match="sampling.temperature: must be >= 0, got -0.5"):
            client.generate("invalid")  # the engine's refusal, code and message, unchanged


def test_an_engine_that_stops_serving_gets_no_request_and_none_serving_makes_the_front_unavailable(engines, front):
    target = front("round-robin")
    engines[1].set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    time.sleep(1.0)  # the front polls every 0.25 s
    with Client(target, max_retries=0) as client:
        for _ in range(4):
            client.generate("hello")
    assert [len(engine.generation.requests) for engine in engines] == [4, 0]
    assert grpc_serving(target)
    engines[0].set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    deadline = time.monotonic() + 5
    while grpc_serving(target) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not grpc_serving(target), "the front serves while any engine does, and only then"
    channel = grpc.insecure_channel(target)
    with channel, pytest.raises(grpc.RpcError) as refused:
        call = channel.unary_stream("/pagedserve.v1.Generation/Generate")(
            generate_pb2.GenerateRequest(text="hello").SerializeToString())
        list(call)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_request_whose_engine_is_gone_before_its_first_output_is_sent_again_to_a_live_engine(engines, front):
    target = front("round-robin")
    engines[0].generation.unreachable = True  # its health still says SERVING: the front learns from the call
    with Client(target, max_retries=0) as client:
        results = [client.generate("hello") for _ in range(4)]
    assert [result.text for result in results] == ["Hello world"] * 4
    tried_first = len(engines[0].generation.requests)
    assert tried_first >= 1, "round-robin sent the first request to engine 0, which failed it"
    assert len(engines[1].generation.requests) == 4
    assert all(request.text == "hello" for request in engines[1].generation.requests)  # the same request, again


def test_a_stream_whose_engine_is_lost_after_its_first_output_fails_naming_the_engine(engines, front):
    target = front("round-robin")
    with Client(target, max_retries=0, resume_timeout=0) as client:
        with pytest.raises(ServerUnavailableError, match=r"engine \d \(127\.0\.0\.1:\d+\) was lost after this "
                                                         r"stream's first output"):
            list(client.generate_stream("dies after a chunk"))
    assert sum(len(engine.generation.requests) for engine in engines) == 1  # started: never sent again


def test_an_engine_unreachable_past_the_grace_is_lost_and_a_slow_one_is_not():
    import asyncio
    import socket

    from scheduler_svc.data_parallel.engine_link import ENGINE_LOST_GRACE_S, EngineLink

    async def scenario(port: int) -> None:
        gone = EngineLink(0, f"127.0.0.1:{free_port()}", None)  # nothing listens there: UNAVAILABLE
        engine_call = gone.generate(b"", (), 30.0)
        assert not await gone.poll_health(now=100.0) and not gone.lost  # unreachable, within the grace
        await gone.poll_health(now=100.0 + ENGINE_LOST_GRACE_S / 2)
        assert not gone.lost and not engine_call.lost
        await gone.poll_health(now=100.5 + ENGINE_LOST_GRACE_S)
        assert gone.lost and engine_call.lost  # its calls are marked lost (and cancelled)
        gone.done(engine_call)
        slow = EngineLink(1, f"127.0.0.1:{port}", None)  # takes the connection, never answers: checks time out
        assert not await slow.poll_health(now=100.0)
        assert not await slow.poll_health(now=101.0 + ENGINE_LOST_GRACE_S) and not slow.lost
        for link in (gone, slow):
            await link.channel.close()

    with socket.create_server(("127.0.0.1", 0)) as hung:
        asyncio.run(scenario(hung.getsockname()[1]))


def test_data_parallel_refuses_what_one_front_cannot_serve_yet():
    """A shared worker address, runtime LoRA loads (the front does not fan them out) and TLS (the front
    reaches the engines by loopback IP) are refused with -dp > 1, in one line naming the flag; -dp 1 takes all."""
    import argparse

    from pagedserve.engine_replicas import data_parallel_refusal

    def refusal(size=2, **changes):
        args = argparse.Namespace(data_parallel_size=size, tensor_parallel_size=1, device="cpu",
                                  distributed_executor_backend="mp", worker_address=None,
                                  allow_runtime_lora_updating=False, tls_cert_file=None, api_server_count=1)
        return data_parallel_refusal(argparse.Namespace(**{**vars(args), **changes}), None)

    assert refusal() is None
    assert refusal(distributed_executor_backend="ray") is None  # a placement group per engine
    assert "--worker-address" in refusal(worker_address="tcp://127.0.0.1:5")
    assert "--allow-runtime-lora-updating" in refusal(allow_runtime_lora_updating=True)
    assert "--tls-cert-file" in refusal(tls_cert_file="/etc/cert.pem")
    assert refusal(1, allow_runtime_lora_updating=True, tls_cert_file="/etc/cert.pem") is None
    assert "needs 4 GPUs" in data_parallel_refusal(argparse.Namespace(
        data_parallel_size=2, tensor_parallel_size=2, device="cuda", distributed_executor_backend="mp",
        worker_address=None, allow_runtime_lora_updating=False, tls_cert_file=None, api_server_count=1), 2)


def test_engine_ports_are_distinct_and_never_the_public_port(monkeypatch):
    import argparse

    import pagedserve.engine_replicas as replicas

    offered = iter([50051, 40000, 40000, 40001])
    monkeypatch.setattr(replicas, "free_port", lambda: next(offered))
    args = argparse.Namespace(data_parallel_size=2, tensor_parallel_size=1, device="cpu", grpc_port=50051,
                              grpc_host="0.0.0.0")
    assert [replica.port for replica in replicas.engine_replicas(args, "/tmp/x", "ipc:///tmp/w")] == [40000, 40001]
    offered = iter([40000, 40001, 41000, 41001])
    monkeypatch.setattr(replicas, "free_port", lambda host="127.0.0.1": next(offered))
    on_ray = replicas.engine_replicas(args, "/tmp/x", "tcp://10.0.0.5:9", ray_host="10.0.0.5")
    assert [replica.worker_address for replica in on_ray] == ["tcp://10.0.0.5:41000", "tcp://10.0.0.5:41001"]


def test_a_request_aborted_while_it_waits_to_be_sent_again_is_not_sent(engines, front):
    """Both engines fail the call (their health still says SERVING): after the second, the request waits up to
    RESEND_WAIT_S for an untried engine; an Abort arriving then ends it CANCELLED at once, sent to no one."""
    import threading

    target = front("round-robin")
    for engine in engines:
        engine.generation.unreachable = True
    channel = grpc.insecure_channel(target)
    outcome: dict = {}

    def generate() -> None:
        call = channel.unary_stream("/pagedserve.v1.Generation/Generate")(
            generate_pb2.GenerateRequest(text="hello", request_id="waiting-one").SerializeToString())
        try:
            list(call)
        except grpc.RpcError as error:
            outcome["code"], outcome["at"] = error.code(), time.monotonic()

    with channel:
        thread = threading.Thread(target=generate)
        thread.start()
        time.sleep(0.8)  # both engines tried; now waiting for a third
        sent = sum(len(engine.generation.requests) for engine in engines)
        aborted_at = time.monotonic()
        with contextlib.suppress(grpc.RpcError):  # the stand-in engines may not implement Abort
            channel.unary_unary("/pagedserve.v1.Generation/Abort")(
                generate_pb2.AbortRequest(request_id="waiting-one").SerializeToString(), timeout=5)
        thread.join(10)
    assert outcome["code"] == grpc.StatusCode.CANCELLED
    assert outcome["at"] - aborted_at < 1.0  # not after the resend wait ran out
    assert sum(len(engine.generation.requests) for engine in engines) == sent == 2
