"""The stand-in engine process of the data-parallel CPU benchmark (pagedserve/testing/instant_engine.py): the
real scheduler service's gRPC API in front of an instant stand-in worker, streaming its pure-function tokens to
max_tokens, paced in several messages when stream pacing applies, and stopping cleanly on SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from client import Client
from pagedserve.free_port import free_port
from pagedserve.health_probe import grpc_serving
from pagedserve.testing.instant_engine import token_sampler
from pagedserve.testing.server_harness import REPO_ROOT
from service_runtime.model_source import resolve_model
from scheduler_svc.text.tokenizer_loading import load_tokenizer


def test_the_instant_engine_streams_its_sampler_tokens_to_max_tokens_and_stops_on_sigterm():
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "pagedserve.testing.instant_engine", "--grpc-port", str(port),
                                "--step-ms", "20", "--stream-messages-per-step", "1"], cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 60
        while not grpc_serving(f"127.0.0.1:{port}"):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        with Client(f"127.0.0.1:{port}", max_retries=0) as client:
            prompt = [300, 301, 302, 303]
            # At once (a stream's call starts when it is read), 20 ms a step: the three run side by side.
            with ThreadPoolExecutor(3) as pool:
                chunks = list(pool.map(lambda i: list(client.generate_stream(
                    prompt, max_tokens=20, ignore_eos=True, request_id=f"r{i}")), range(3)))
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0
    sample = token_sampler(load_tokenizer(resolve_model(None).path).vocab_size)
    for index, stream_chunks in enumerate(chunks):
        token_ids = [token for chunk in stream_chunks for token in chunk.token_ids]
        assert token_ids == [sample(f"r{index}", len(prompt) + position) for position in range(20)]
        assert stream_chunks[-1].finish_reason == "length"
        assert 3 < len(stream_chunks) < 20  # paced: 3 streams, 1 flushed per step: several tokens a message
