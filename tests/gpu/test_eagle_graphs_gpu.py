"""An EAGLE head's proposal passes from CUDA graphs (worker_svc/eagle_graphs.py, ModelRunner.allocate): a worker
with an EAGLE-3 or an EAGLE-1 head, graphs on, gives exactly the greedy tokens of the same worker under
--enforce-eager, and every proposal pass after the first replayed one of the head's graphs. An echo head beside
the repeater keeps nearly every draft; a random head beside a tiny Llama proposes what the eager passes propose
(its proposals read the K/V the graph passes wrote). The head's graphs take no more memory than the KV sizing
reserves for them."""

from __future__ import annotations

import pytest
import torch

from pagedserve.testing.tiny_eagle1 import make_echo_eagle1_head, make_tiny_eagle1_head
from pagedserve.testing.tiny_eagle3 import make_echo_eagle3_head, make_tiny_eagle3_head
from pagedserve.testing.tiny_models import make_repeater_model, make_tiny_model
from tests.gpu.test_draft_graphs_gpu import (BLOCK, K, MAX_MODEL_LEN, MAX_NUM_SEQS, PROMPTS, VERIFYING_STEPS,
                                             serve)
from tests.test_eagle_graph_passes import make_worker as make_cpu_test_worker
from worker_svc.decode_graphs import bucket_sizes
from worker_svc.persistent_batch import PersistentBatch
from worker_svc.worker import Worker

MAX_PROPOSING_ROWS = 8  # speculation's disable_by_batch_size: the head's graphs for 1, 2, 4 and 8 rows
HEADS = {  # method -> (echo head beside the repeater, random head beside a tiny Llama)
    "eagle3": (make_echo_eagle3_head, lambda root, target: make_tiny_eagle3_head(root, target, seed=7)),
    "eagle": (make_echo_eagle1_head, lambda root, target: make_tiny_eagle1_head(root, target, seed=7, num_layers=2)),
}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return make_repeater_model(root, "qwen2", seed=4), make_tiny_model(root, "llama", seed=3, num_hidden_layers=5)


def make_worker(target, head, method: str, cuda_graphs: bool) -> Worker:
    return make_cpu_test_worker(target, head, method, k=K, block_size=BLOCK, max_num_seqs=MAX_NUM_SEQS,
                                max_model_len=MAX_MODEL_LEN, max_proposing_rows=MAX_PROPOSING_ROWS, device="cuda",
                                dtype="float32", num_kv_blocks=len(PROMPTS) * (MAX_MODEL_LEN // BLOCK),
                                cuda_graphs=cuda_graphs)


def serve_both_ways(target, head, method: str) -> tuple[dict[str, list[int]], int, int]:
    """The greedy outputs (asserted identical with graphs and eager) and the drafts each way kept."""
    with_graphs = make_worker(target, head, method, cuda_graphs=True)
    graphs = with_graphs.runner.draft.graphs
    assert graphs is not None and graphs.buckets == bucket_sizes(MAX_PROPOSING_ROWS)
    outputs, kept = serve(with_graphs)
    # Every step proposes K for each of the 4 rows: K - 1 passes after the first, each one replay.
    assert graphs.num_replays == (1 + VERIFYING_STEPS) * (K - 1)
    eager = make_worker(target, head, method, cuda_graphs=False)
    assert eager.runner.draft.graphs is None
    eager_outputs, eager_kept = serve(eager)
    assert outputs == eager_outputs
    return outputs, kept, eager_kept


@pytest.mark.parametrize("method", list(HEADS))
def test_an_echo_heads_graphs_give_the_eager_tokens_and_keep_nearly_every_draft(targets, tmp_path, method):
    repeater = targets[0]
    _, kept, eager_kept = serve_both_ways(repeater, HEADS[method][0](tmp_path, repeater), method)
    most = 0.9 * VERIFYING_STEPS * len(PROMPTS) * K
    assert kept >= most and eager_kept >= most, (kept, eager_kept)


@pytest.mark.parametrize("method", list(HEADS))
def test_a_random_heads_graphs_keep_the_drafts_its_eager_passes_keep(targets, tmp_path, method):
    """A random head's proposals depend on the K/V of the head's earlier passes: the graphs' proposals are the
    eager passes' (float32; the same verification keeps the same drafts)."""
    llama = targets[1]
    _, kept, eager_kept = serve_both_ways(llama, HEADS[method][1](tmp_path, llama), method)
    assert kept == eager_kept


def test_the_heads_graphs_take_no_more_memory_than_the_sizing_reserves(targets, tmp_path):
    """What capturing the head's graphs keeps (their private pool and static buffers; the warm-up's cached
    activations released) is within `EagleHead.proposal_graph_bytes`, which the KV sizing takes off the top."""
    repeater = targets[0]
    worker = make_worker(repeater, make_echo_eagle3_head(tmp_path, repeater), "eagle3", cuda_graphs=False)
    head = worker.runner.draft
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    head.capture_graphs(MAX_PROPOSING_ROWS, PersistentBatch.max_blocks_per_seq(MAX_MODEL_LEN, BLOCK))
    torch.cuda.empty_cache()
    taken = torch.cuda.memory_reserved() - before
    assert 0 < taken <= head.proposal_graph_bytes(MAX_PROPOSING_ROWS, worker.runner.model_config.vocab_size), taken
