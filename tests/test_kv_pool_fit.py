"""A KV pool smaller than max_model_len: an unset --max-model-len is capped to what the pool holds (so a
request may fill the whole pool), an explicit one stops the server with the flags to change."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve.testing.server_harness import REPO_ROOT, free_port, running_server
from pagedserve.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=31)  # 512 positions


def test_an_unset_max_model_len_is_capped_to_the_pool_and_a_request_may_fill_it(model, tmp_path):
    with running_server(tmp_path, "--model", str(model), "--num-kv-blocks", "8") as server:
        with server.client() as client:
            assert client.model_info().max_model_len == 8 * 16
            result = client.generate(list(range(3, 23)), max_tokens=8 * 16 - 20, temperature=0.0, ignore_eos=True)
        log = server.log_path.read_text()
    assert (result.finish_reason, len(result.token_ids)) == ("length", 8 * 16 - 20)
    assert "max_model_len capped to 128, what the KV pool holds (the model allows 512" in log


def test_an_explicit_max_model_len_the_pool_cannot_hold_stops_the_server(model):
    completed = subprocess.run(
        [sys.executable, "-m", "pagedserve", "serve", "--model", str(model), "--num-kv-blocks", "8",
         "--max-model-len", "256", "--no-http", "--grpc-port", str(free_port())],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert completed.returncode != 0
    assert "--max-model-len 256 needs 256 KV slots but the KV pool holds 128 (8 blocks of 16)" in completed.stderr
