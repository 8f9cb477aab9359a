"""A draft model's passes through the decode graphs' buffers (worker_svc/decode_graphs.py, which a GPU replays
as CUDA graphs and the CPU runs eagerly over the same buffers) propose exactly what its eager passes propose
(the same tokens, the same q for rows that sample, step after step of verified drafts) and the draft model's
own continuation of each row (a worker serving it alone, greedy or with the row's seeded sampling). Proposal
passes after the first take their input tokens, the previous pass's proposals, on the device (the decode
graphs' pending-token path), in a bucket larger than their rows; rows of different lengths, proposals that run
past a row's blocks into its scratch blocks, rows proposing fewer than k near max_model_len, a row in the middle
that stops proposing before the others, and a verification step that the mirror runs as one decode graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import worker_pb2
from tests.test_worker_draft_model import greedy_continuation
from tests.test_worker_draft_model import make_worker as make_single_worker
from worker_svc.config import WorkerConfig
from worker_svc.decode_graphs import DecodeGraphs
from worker_svc.graph_dispatcher import DecodeGraphPath, GraphDispatcher
from worker_svc.persistent_batch import PersistentBatch
from worker_svc.worker import Worker

BLOCK = 4
K = 3
MAX_NUM_SEQS = 8  # decode buckets 1, 2, 4, 8
MAX_MODEL_LEN = 32
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": 1}
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "min_p": 0.01, "seed": 11}
# a and b: short prompts whose proposals run past their blocks (each row gets only the blocks its computed
# tokens need); c: 29 tokens, so 2 proposals after its first token and 1 after its second (max_model_len 32).
# c between a and b: when it stops proposing, the next pass's rows take their tokens from other places of the
# pass before.
REQUESTS = {"a": ([5, 9, 2, 7, 3, 5, 9], GREEDY),
            "c": ([(7 * i + 3) % 50 for i in range(29)], SAMPLED),
            "b": ([11, 4, 8, 30, 31, 2, 2, 9, 40, 41, 17], SAMPLED)}


class RecordingDecodePath(DecodeGraphPath):
    """The decode graph path, noting each step it runs: (rows, bucket, input tokens taken on the device)."""

    def __init__(self, graphs: DecodeGraphs):
        super().__init__(graphs)
        self.runs: list[tuple[int, int, int]] = []
        # Whether each run was under inference mode: on a GPU the captured graph's outputs are inference tensors,
        # and the logits computed from them outside it raise ("Inference tensors cannot be saved for backward").
        self.inference_mode: list[bool] = []

    def run(self, inputs, size, previous_sampled):
        self.runs.append((len(inputs.rows), size, len(inputs.pending_input_indices)))
        self.inference_mode.append(torch.is_inference_mode_enabled())
        return super().run(inputs, size, previous_sampled)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return make_tiny_model(root, "llama", seed=3), make_tiny_model(root, "qwen2", seed=5, num_hidden_layers=2)


def make_worker(target, draft) -> Worker:
    worker = Worker(WorkerConfig(scheduler_address="", model=str(target), num_kv_blocks=96, swap_space=0.01))
    setup = worker_pb2.WorkerSetup(block_size=BLOCK, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=256,
                                   max_model_len=MAX_MODEL_LEN)
    setup.draft_model.CopyFrom(worker_pb2.DraftModelSetup(model=str(draft), num_speculative_tokens=K))
    worker.setup(setup)
    return worker


def through_decode_buffers(worker: Worker) -> RecordingDecodePath:
    """The worker's draft runs its steps through decode graphs, as on a GPU (uncaptured here: the same buffers,
    run eagerly) instead of its CPU dispatcher's eager path."""
    draft = worker.runner.draft
    graphs = DecodeGraphs(draft.model, draft.pool.layers, MAX_NUM_SEQS,
                          PersistentBatch.max_blocks_per_seq(MAX_MODEL_LEN, BLOCK), BLOCK, draft.device)
    path = RecordingDecodePath(graphs)
    draft.graphs = GraphDispatcher(draft.model, draft.pool.layers, BLOCK, draft.device, paths=(path,))
    return path


class Requests:
    """The scheduler's side of the test: each request's known tokens and blocks, which get only what the
    step's tokens need (fresh ids), and the worker's trim of a verified row's blocks to its computed tokens."""

    def __init__(self):
        self.known = {request_id: list(tokens) for request_id, (tokens, _) in REQUESTS.items()}
        self.num_blocks = dict.fromkeys(REQUESTS, 0)
        self.next_block = 0

    def blocks_for(self, request_id: str, num_positions: int) -> list[int]:
        needed = -(-num_positions // BLOCK) - self.num_blocks[request_id]
        self.num_blocks[request_id] += needed
        self.next_block += needed
        return list(range(self.next_block - needed, self.next_block))

    def first_plan(self) -> worker_pb2.StepPlan:
        new_requests = []
        for request_id, (tokens, sampling) in REQUESTS.items():
            new_requests.append(worker_pb2.NewRequest(
                request_id=request_id, token_ids=tokens, block_ids=self.blocks_for(request_id, len(tokens)),
                num_computed_tokens=0, num_scheduled_tokens=len(tokens), num_prompt_tokens=len(tokens),
                sampling=worker_pb2.WorkerSamplingParams(**sampling, num_logprobs=-1, num_prompt_logprobs=-1)))
        return worker_pb2.StepPlan(new_requests=new_requests, propose_draft_tokens=K)

    def next_plan(self, drafts: dict[str, list[int]], finished: list[str]) -> worker_pb2.StepPlan:
        scheduled = []
        for request_id, tokens in drafts.items():
            new_blocks = self.blocks_for(request_id, len(self.known[request_id]) + len(tokens))
            scheduled.append(worker_pb2.ScheduledRequest(
                request_id=request_id, num_scheduled_tokens=1 + len(tokens), draft_token_ids=tokens,
                new_block_ids=new_blocks))
        return worker_pb2.StepPlan(scheduled_requests=scheduled, has_draft_tokens=any(drafts.values()),
                                   propose_draft_tokens=K, finished_request_ids=finished)

    def apply(self, result: worker_pb2.SampledTokens, drafts: dict[str, list[int]]) -> None:
        accepted = list(result.num_accepted_drafts) or [0] * len(result.request_ids)
        for request_id, token, kept in zip(result.request_ids, result.token_ids, accepted):
            self.known[request_id] += drafts.get(request_id, [])[:kept] + [token]
            if drafts.get(request_id):
                self.num_blocks[request_id] = -(-(len(self.known[request_id]) - 1) // BLOCK)


def proposals_of(result: worker_pb2.SampledTokens) -> dict[str, list[int]]:
    flat, out, start = list(result.proposed_draft_token_ids), {}, 0
    for request_id, count in zip(result.request_ids, result.num_proposed_draft_tokens):
        out[request_id], start = flat[start : start + count], start + count
    return out


def test_proposals_through_the_decode_buffers_equal_the_eager_passes(models):
    eager, buffered, draft_alone = make_worker(*models), make_worker(*models), make_single_worker(models[1])
    path = through_decode_buffers(buffered)
    requests = Requests()
    step_plan, drafts_sent = requests.first_plan(), {}
    into_scratch = 0
    for step in range(5):
        # The buffered worker as the serving loop drives it: launch, then finish (not under inference mode).
        results = [eager.execute(step_plan).sampled, buffered.finish(buffered.launch(step_plan)).sampled]
        assert results[0] == results[1], step  # the target's tokens: the same drafts were verified
        proposed = proposals_of(results[1])
        assert proposed == proposals_of(results[0]), step
        eager_q, buffered_q = eager.runner.draft.proposed, buffered.runner.draft.proposed
        np.testing.assert_array_equal(buffered_q.rows, eager_q.rows)
        np.testing.assert_array_equal(buffered_q.token_ids, eager_q.token_ids)
        torch.testing.assert_close(buffered_q.probs, eager_q.probs, rtol=1e-5, atol=1e-6)
        batch = buffered.batch
        for request_id, tokens in proposed.items():  # the last position a pass wrote, past the row's blocks?
            row = batch.row_of(request_id)
            into_scratch += int(batch.num_tokens[row] - 2 + len(tokens) >= batch.num_blocks[row] * BLOCK)
        if step == 0:
            assert {request_id: len(tokens) for request_id, tokens in proposed.items()} == {"a": K, "c": 2, "b": K}
        if step == 1:
            assert len(proposed["c"]) == 1
        requests.apply(results[1], drafts_sent)
        for request_id, tokens in proposed.items():  # and both are the draft model's own continuation
            reference = greedy_continuation(draft_alone, requests.known[request_id], len(tokens),
                                            **REQUESTS[request_id][1])
            assert tokens == reference, (step, request_id)
        # a verifies all its proposals, b its first two with the second made wrong; c computes its newest token
        # without drafts once, then is done (max_model_len): step 1 has 4 + 3 + 1 tokens, one decode bucket.
        drafts_sent = {"a": proposed["a"], "c": []} if step == 0 else {"a": proposed["a"]}
        drafts_sent["b"] = [proposed["b"][0], (proposed["b"][1] + 1) % 50]
        step_plan = requests.next_plan(drafts_sent, finished=["c"] if step == 1 else [])
    assert into_scratch >= 3
    assert all(path.inference_mode)  # proposal passes included (Worker.finish is not under inference mode)
    taking = [(rows, bucket) for rows, bucket, taken in path.runs if taken]
    assert len(taking) == 5 * (K - 1)  # every proposal pass after each step's first
    assert all(taken in (0, rows) for rows, _, taken in path.runs)
    runs = [(rows, bucket) for rows, bucket, _ in path.runs]
    assert (3, 4) in runs  # step 0's first proposal pass: 3 rows padded to 4
    assert (8, 8) in runs  # step 1's verification, mirrored as 8 one-token decodes
