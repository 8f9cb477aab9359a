"""A draft model's own CUDA graphs (worker_svc/draft_model.py, ModelRunner.allocate): a worker serving a tiny Llama
with itself as the draft, graphs on, gives exactly the greedy tokens of the same worker under --enforce-eager, and
keeps nearly every draft (the draft computes what the target does), while every proposal pass and every
verification step's mirror of the draft replayed one of the draft's decode graphs (its piecewise graphs took the
prefill). The memory sizing keeps room for the draft's graphs where they are captured."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import worker_pb2
from worker_svc.config import WorkerConfig
from worker_svc.kv_cache import bytes_per_block
from worker_svc.kv_cache_sizing import DraftPool, num_kv_blocks
from worker_svc.worker import Worker

BLOCK = 16
K = 4
MAX_NUM_SEQS = 32  # a verification step of 4 rows x (1 + K) tokens fits the largest decode bucket
MAX_MODEL_LEN = 256
BLOCKS_PER_REQUEST = MAX_MODEL_LEN // BLOCK
PROMPTS = {"a": [5, 9, 2, 7, 3], "b": [(3 * i + 1) % 500 for i in range(17)],
           "c": [(7 * i + 2) % 500 for i in range(33)], "d": [(11 * i + 5) % 500 for i in range(60)]}
VERIFYING_STEPS = 6
PROFILED_TOKENS = 512  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"), "llama", seed=4)


def make_worker(model, cuda_graphs: bool) -> Worker:
    worker = Worker(WorkerConfig(scheduler_address="", model=str(model), device="cuda", dtype="float32",
                                 num_kv_blocks=len(PROMPTS) * BLOCKS_PER_REQUEST, swap_space=0.01,
                                 cuda_graphs=cuda_graphs))
    setup = worker_pb2.WorkerSetup(block_size=BLOCK, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=512,
                                   max_model_len=MAX_MODEL_LEN)
    setup.draft_model.CopyFrom(worker_pb2.DraftModelSetup(model=str(model), num_speculative_tokens=K))
    worker.setup(setup)
    return worker


def serve(worker: Worker) -> tuple[dict[str, list[int]], int]:
    """Every prompt's greedy output over a first step and VERIFYING_STEPS steps that verify the draft's proposals
    of the step before; and how many drafts were kept."""
    sampling = worker_pb2.WorkerSamplingParams(temperature=0.0, top_p=1.0, top_k=-1, seed=1, num_logprobs=-1,
                                               num_prompt_logprobs=-1)
    new_requests = [worker_pb2.NewRequest(
        request_id=request_id, token_ids=tokens, num_computed_tokens=0, num_scheduled_tokens=len(tokens),
        num_prompt_tokens=len(tokens), sampling=sampling,
        block_ids=list(range(index * BLOCKS_PER_REQUEST, (index + 1) * BLOCKS_PER_REQUEST)))
        for index, (request_id, tokens) in enumerate(PROMPTS.items())]
    result = worker.execute(worker_pb2.StepPlan(new_requests=new_requests, propose_draft_tokens=K)).sampled
    outputs = {request_id: [token] for request_id, token in zip(result.request_ids, result.token_ids)}
    kept = 0
    for step in range(VERIFYING_STEPS):
        drafts, start = {}, 0
        for request_id, count in zip(result.request_ids, result.num_proposed_draft_tokens):
            drafts[request_id], start = list(result.proposed_draft_token_ids[start : start + count]), start + count
        assert all(len(tokens) == K for tokens in drafts.values()), step
        result = worker.execute(worker_pb2.StepPlan(
            step_id=step + 1, has_draft_tokens=True, propose_draft_tokens=K, scheduled_requests=[
                worker_pb2.ScheduledRequest(request_id=request_id, num_scheduled_tokens=1 + K, draft_token_ids=tokens)
                for request_id, tokens in drafts.items()])).sampled
        for request_id, token, accepted in zip(result.request_ids, result.token_ids, result.num_accepted_drafts):
            outputs[request_id] += drafts[request_id][:accepted] + [token]
            kept += accepted
    return outputs, kept


def test_the_drafts_graphs_give_the_eager_tokens_and_replay_every_proposal_pass(model):
    with_graphs = make_worker(model, cuda_graphs=True)
    dispatcher = with_graphs.runner.draft.graphs
    assert [path.name for path in dispatcher.paths] == ["decode graph", "piecewise graphs", "eager"]
    decode_graphs = dispatcher.paths[0].graphs
    outputs, kept = serve(with_graphs)
    # K proposal passes after every step, and one mirror of each verification step (20 one-token decodes).
    assert decode_graphs.num_replays == (1 + VERIFYING_STEPS) * K + VERIFYING_STEPS
    eager = make_worker(model, cuda_graphs=False)
    assert [path.name for path in eager.runner.draft.graphs.paths] == ["eager"]
    eager_outputs, eager_kept = serve(eager)
    assert outputs == eager_outputs
    most = 0.9 * VERIFYING_STEPS * len(PROMPTS) * K  # the target as its own draft: float32 rounding aside, all
    assert kept >= most and eager_kept >= most, (kept, eager_kept)


def test_the_sizing_keeps_room_for_the_drafts_graphs(model, caplog):
    """The same sizing with the draft's graphs captured gives fewer blocks: the room its graphs' memory pool
    takes beside the target's (the draft's profiled activations, logged)."""
    worker = make_worker(model, cuda_graphs=False)  # the loaded target and draft, as the runner holds them
    runner = worker.runner
    config = WorkerConfig(scheduler_address="", model=str(model), device="cuda", dtype="float32",
                          gpu_memory_utilization=0.5)
    per_block = bytes_per_block(runner.draft.model_config, BLOCK, torch.float32)

    def blocks(captured: bool) -> int:
        draft = DraftPool(runner.draft.model, runner.draft.model_config, per_block, 0, captured=captured)
        return num_kv_blocks(config, runner.model, runner.model_config, BLOCK, PROFILED_TOKENS, MAX_NUM_SEQS,
                             PROFILED_TOKENS, torch.float32, runner.device, draft=draft)

    plain = blocks(captured=False)
    with caplog.at_level(logging.INFO, logger="worker_svc.kv_cache_sizing"):
        captured = blocks(captured=True)
    assert "kept for the draft model's CUDA graphs" in caplog.text
    assert 0 < captured < plain
