"""An EAGLE head's proposal passes through the graph buffers (worker_svc/eagle_graphs.py, which a GPU replays as
CUDA graphs and the CPU runs eagerly over the same buffers) propose exactly what its eager passes propose, for an
EAGLE-3 and an EAGLE-1 head, step after step of verified drafts, with the worker driven by launch and finish as
the serving loop drives it: rows of different lengths, proposals that run past a row's blocks into its scratch
blocks, fewer rows than the bucket, a row in the middle proposing fewer than k (near max_model_len) that turns
into a padding row while the others go on, and a row proposing one token only (no graph pass for it). The passes
write the eager passes' K/V into the head's pool, at the same slots and nowhere else."""

from __future__ import annotations

import pytest
import torch

from pagedserve.testing.tiny_eagle1 import make_tiny_eagle1_head
from pagedserve.testing.tiny_eagle3 import make_tiny_eagle3_head
from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import worker_pb2
from tests.test_draft_model_graph_passes import BLOCK, K, MAX_MODEL_LEN, MAX_NUM_SEQS, Requests, proposals_of
from worker_svc.config import WorkerConfig
from worker_svc.eagle_graphs import EagleProposalGraphs
from worker_svc.persistent_batch import PersistentBatch
from worker_svc.worker import Worker

HEADS = {"eagle3": lambda root, target: make_tiny_eagle3_head(root, target, seed=7),
         "eagle": lambda root, target: make_tiny_eagle1_head(root, target, seed=7, num_layers=2)}


class RecordingProposalGraphs(EagleProposalGraphs):
    """The proposal graphs (uncaptured: their buffers run eagerly), noting each proposal they run: (rows, bucket,
    passes), and whether it ran under inference mode (on a GPU a replayed graph's outputs are inference tensors)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.runs: list[tuple[int, int, int]] = []
        self.inference_mode: list[bool] = []

    def run(self, token_ids, states, tables, positions, counts, proposals, size):
        self.runs.append((len(counts), size, int(counts.max()) - 1))
        self.inference_mode.append(torch.is_inference_mode_enabled())
        super().run(token_ids, states, tables, positions, counts, proposals, size)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=3, num_hidden_layers=5)


def make_worker(target, head, method: str, k: int = K, block_size: int = BLOCK, max_num_seqs: int = MAX_NUM_SEQS,
                max_model_len: int = MAX_MODEL_LEN, max_proposing_rows: int = MAX_NUM_SEQS, **config) -> Worker:
    """A worker serving `target` with the head at `head` (`config`: WorkerConfig's fields beyond the defaults)."""
    worker = Worker(WorkerConfig(scheduler_address="", model=str(target), swap_space=0.01,
                                 **{"num_kv_blocks": 96, **config}))
    setup = worker_pb2.WorkerSetup(block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                   max_model_len=max_model_len)
    setup.draft_model.CopyFrom(worker_pb2.DraftModelSetup(model=str(head), num_speculative_tokens=k, method=method,
                                                          max_proposing_rows=max_proposing_rows))
    worker.setup(setup)
    return worker


def through_graph_buffers(worker: Worker) -> RecordingProposalGraphs:
    """The worker's head runs its proposal passes through the graphs' buffers, as on a GPU (the CPU worker has
    none: it runs them eagerly)."""
    head = worker.runner.draft
    assert head.graphs is None
    head.graphs = RecordingProposalGraphs(head.proposal_pass, head.model_config.hidden_size, torch.float32,
                                          MAX_NUM_SEQS, PersistentBatch.max_blocks_per_seq(MAX_MODEL_LEN, BLOCK),
                                          BLOCK, head.device)
    return head.graphs


@pytest.mark.parametrize("method", list(HEADS))
def test_proposals_through_the_graph_buffers_equal_the_eager_passes(target, tmp_path, method):
    head = HEADS[method](tmp_path, target)
    eager, buffered = make_worker(target, head, method), make_worker(target, head, method)
    graphs = through_graph_buffers(buffered)
    requests = Requests()
    step_plan, drafts_sent = requests.first_plan(), {}
    into_scratch, kept = 0, 0
    for step in range(5):
        # The buffered worker as the serving loop drives it: launch, then finish (not under inference mode).
        results = [eager.execute(step_plan).sampled, buffered.finish(buffered.launch(step_plan)).sampled]
        assert results[0] == results[1], step  # the target's tokens: the same drafts were verified
        proposed = proposals_of(results[1])
        assert proposed == proposals_of(results[0]), step
        # The passes wrote the same K/V (up to the rounding of other row counts) at the same slots of the head's
        # pool, and nothing else (done and padding rows write nothing).
        for eager_layer, buffered_layer in zip(eager.runner.draft.pool.layers, buffered.runner.draft.pool.layers,
                                               strict=True):
            torch.testing.assert_close(buffered_layer, eager_layer, rtol=1e-3, atol=1e-3)
        batch = buffered.batch
        for request_id, tokens in proposed.items():  # the last position a pass wrote, past the row's blocks?
            row = batch.row_of(request_id)
            into_scratch += int(batch.num_tokens[row] - 2 + len(tokens) >= batch.num_blocks[row] * BLOCK)
        if step == 0:  # c: 30 tokens of max_model_len 32
            assert {request_id: len(tokens) for request_id, tokens in proposed.items()} == {"a": K, "c": 2, "b": K}
        if step == 1:
            assert len(proposed["c"]) == 1
        requests.apply(results[1], drafts_sent)
        kept += sum(results[1].num_accepted_drafts)
        # a verifies all its proposals, b its first two with the second made wrong; c computes its newest token
        # without drafts once, then is done (max_model_len).
        drafts_sent = {"a": proposed["a"], "c": []} if step == 0 else {"a": proposed["a"]}
        drafts_sent["b"] = [proposed["b"][0], (proposed["b"][1] + 1) % 50]
        step_plan = requests.next_plan(drafts_sent, finished=["c"] if step == 1 else [])
    assert into_scratch >= 3
    assert all(graphs.inference_mode)  # Worker.finish is not under inference mode
    # Every step's proposal went through the buffers: 3 rows in the bucket of 4 (c proposing 2, then 1), then 2.
    assert graphs.runs == [(3, 4, K - 1)] * 2 + [(2, 2, K - 1)] * 3
