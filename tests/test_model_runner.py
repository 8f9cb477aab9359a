"""The model runner's seams: one dispatcher picks how a step's forward pass runs, and test faults wrap the runner
instead of sitting in the step (a serving worker runs the bare runner)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import worker_pb2
from worker_svc.config import WorkerConfig
from worker_svc.fault_injection import FaultInjectingRunner, InjectedFault
from worker_svc.graph_dispatcher import GraphDispatcher
from worker_svc.model_runner import ModelRunner
from worker_svc.persistent_batch import StepInputs
from worker_svc.worker import Worker


def step_inputs(num_scheduled: list[int]) -> StepInputs:
    """Inputs of a step whose rows compute these many tokens each (only the shape matters here)."""
    tokens = sum(num_scheduled)
    starts = np.concatenate([[0], np.cumsum(num_scheduled)])
    empty = np.zeros(0, dtype=np.int64)
    return StepInputs(rows=np.arange(len(num_scheduled)), input_ids=np.zeros(tokens, dtype=np.int64),
                      positions=np.zeros(tokens, dtype=np.int64), slot_mapping=np.zeros(tokens, dtype=np.int64),
                      query_start_loc=starts, seq_lens=np.asarray(num_scheduled), block_tables=np.zeros((1, 1)),
                      sample_rows=empty, sample_offsets=empty, logits_indices=empty, num_draft_tokens=0,
                      num_decode_seqs=num_scheduled.count(1),
                      pending_input_indices=empty, pending_sources=empty)


class RecordingPath:
    """A captured path that takes the steps `takes` accepts, at a bucket of 8 tokens, and records its runs."""

    def __init__(self, name: str, takes):
        self.name, self._takes, self.runs = name, takes, []

    def bucket_for(self, inputs: StepInputs) -> int | None:
        return 8 if self._takes(inputs) else None

    def run(self, inputs: StepInputs, size: int, previous_sampled) -> torch.Tensor:
        self.runs.append((len(inputs.input_ids), size))
        return torch.zeros(len(inputs.input_ids), 4)


def test_the_dispatcher_gives_each_step_to_the_first_path_that_takes_it_and_eager_the_rest():
    decode = RecordingPath("decode graph", lambda inputs: len(inputs.input_ids) == len(inputs.rows) <= 8)
    mixed = RecordingPath("piecewise graphs", lambda inputs: len(inputs.input_ids) <= 8)
    dispatcher = GraphDispatcher(model=None, kv_caches=[], block_size=16, device=torch.device("cpu"),
                                 paths=(decode, mixed))
    assert [path.name for path in dispatcher.paths] == ["decode graph", "piecewise graphs", "eager"]
    chosen = {shape: dispatcher.choose(step_inputs(list(shape)))[0].name
              for shape in [(1, 1, 1), (1, 5), (7,), (1,) * 9, (30, 1)]}
    assert chosen == {(1, 1, 1): "decode graph", (1, 5): "piecewise graphs", (7,): "piecewise graphs",
                      (1,) * 9: "eager", (30, 1): "eager"}
    dispatcher.forward(step_inputs([1, 1]), previous_sampled=None)
    dispatcher.forward(step_inputs([3, 4]), previous_sampled=None)
    assert decode.runs == [(2, 8)] and mixed.runs == [(7, 8)]
    eager_path, size = dispatcher.choose(step_inputs([30, 1]))
    assert size == 31, "eager runs a step at its own token count"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"), "llama", seed=5)


def setup_message() -> worker_pb2.WorkerSetup:
    return worker_pb2.WorkerSetup(block_size=16, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)


def prefill(request_id: str, prompt: list[int], step_id: int) -> worker_pb2.StepPlan:
    new = worker_pb2.NewRequest(
        request_id=request_id, token_ids=prompt, block_ids=[step_id], num_computed_tokens=0,
        num_scheduled_tokens=len(prompt), num_prompt_tokens=len(prompt),
        sampling=worker_pb2.WorkerSamplingParams(temperature=0.0, top_p=1.0, top_k=-1, num_logprobs=-1,
                                                 num_prompt_logprobs=-1))
    return worker_pb2.StepPlan(step_id=step_id, new_requests=[new])


def test_a_serving_worker_runs_the_bare_runner_and_a_faulty_one_wraps_it(model_dir):
    serving = Worker(WorkerConfig(scheduler_address="", model=str(model_dir), num_kv_blocks=8, swap_space=0.01))
    assert type(serving.runner) is ModelRunner
    faulty = Worker(WorkerConfig(scheduler_address="", model=str(model_dir), num_kv_blocks=8, swap_space=0.01,
                                 fail_at_step=2))
    assert isinstance(faulty.runner, FaultInjectingRunner)
    for worker in (serving, faulty):
        worker.setup(setup_message())
    # The wrapper delegates everything else: the first step samples what the bare runner samples.
    first = [worker.execute(prefill("a", [3, 1, 4, 1, 5], 0)).sampled.token_ids for worker in (serving, faulty)]
    assert first[0] == first[1] and len(first[0]) == 1
    with pytest.raises(InjectedFault, match="forward pass 2"):
        faulty.execute(prefill("b", [2, 7, 1], 1))
    assert serving.execute(prefill("b", [2, 7, 1], 1)).sampled.request_ids == ["b"]


class Exited(Exception):
    """What the fault wrapper's os._exit raises here, so the test process survives the crash it asks for."""


def test_a_poison_token_crashes_the_worker_when_its_request_arrives_and_each_time_it_is_re_added(
        model_dir, monkeypatch):
    import worker_svc.fault_injection as fault_injection

    monkeypatch.setattr(fault_injection.os, "_exit", lambda code: (_ for _ in ()).throw(Exited(code)))
    worker = Worker(WorkerConfig(scheduler_address="", model=str(model_dir), num_kv_blocks=8, swap_space=0.01,
                                 crash_on_token_id=9))
    worker.setup(setup_message())
    worker.execute(prefill("clean", [3, 1, 4], 0))
    with pytest.raises(Exited, match="70"):
        worker.execute(prefill("poison", [2, 9, 1], 1))
    # Its row holds the poison now; a later step of the clean request alone does not crash again (checked at
    # arrival only), but the poison request re-added after a preemption does.
    decode = worker_pb2.StepPlan(step_id=2, scheduled_requests=[
        worker_pb2.ScheduledRequest(request_id="clean", num_scheduled_tokens=1)], preempted_request_ids=["poison"])
    assert worker.execute(decode).sampled.request_ids == ["clean"]
    with pytest.raises(Exited):
        worker.execute(prefill("poison", [2, 9, 1], 3))


def test_a_poison_token_with_an_output_position_crashes_only_there(model_dir, monkeypatch):
    import worker_svc.fault_injection as fault_injection

    monkeypatch.setattr(fault_injection.os, "_exit", lambda code: (_ for _ in ()).throw(Exited(code)))
    worker = Worker(WorkerConfig(scheduler_address="", model=str(model_dir), num_kv_blocks=8, swap_space=0.01,
                                 crash_on_token_id=9, crash_at_output_token=3))
    worker.setup(setup_message())
    worker.execute(prefill("poison", [2, 9, 1], 0))  # samples output token 1: no crash at arrival
    step = worker_pb2.StepPlan(step_id=1, scheduled_requests=[
        worker_pb2.ScheduledRequest(request_id="poison", num_scheduled_tokens=1)])
    worker.execute(step)  # output token 2
    with pytest.raises(Exited):
        worker.execute(step)  # output token 3


def verification_inputs() -> StepInputs:
    """Two rows at positions 5.. and 9..: row 0 verifies 2 drafts (3 tokens), row 1 none (1 token)."""
    empty = np.zeros(0, dtype=np.int64)
    return StepInputs(rows=np.asarray([3, 0]), input_ids=np.asarray([7, 8, 9, 4]), positions=np.asarray([5, 6, 7, 9]),
                      slot_mapping=np.asarray([5, 6, 7, 25]), query_start_loc=np.asarray([0, 3, 4]),
                      seq_lens=np.asarray([8, 10]), block_tables=np.asarray([[0, 4], [1, 2]]),
                      sample_rows=np.asarray([3, 3, 3, 0]), sample_offsets=np.asarray([0, 1, 2, 0]),
                      logits_indices=np.asarray([0, 1, 2, 3]), num_draft_tokens=2, num_decode_seqs=1,
                      pending_input_indices=empty, pending_sources=empty)


def test_a_verification_step_runs_as_one_token_decodes_each_token_over_its_own_context():
    view = verification_inputs().as_single_token_decodes()
    assert view.rows.tolist() == [3, 3, 3, 0] and view.num_decode_seqs == 4
    assert view.query_start_loc.tolist() == [0, 1, 2, 3, 4] and view.seq_lens.tolist() == [6, 7, 8, 10]
    assert view.block_tables.tolist() == [[0, 4], [0, 4], [0, 4], [1, 2]]
    assert view.input_ids.tolist() == [7, 8, 9, 4] and view.logits_indices.tolist() == [0, 1, 2, 3]
    plain = step_inputs([3, 1])  # a prefill chunk beside a decode: no drafts, no view
    assert plain.as_single_token_decodes() is None
    decode = RecordingPath("decode graph", lambda inputs: len(inputs.input_ids) == len(inputs.rows) <= 8)
    dispatcher = GraphDispatcher(model=None, kv_caches=[], block_size=16, device=torch.device("cpu"), paths=(decode,))
    dispatcher.forward(verification_inputs(), previous_sampled=None)
    assert decode.runs == [(4, 8)], "the decode graphs take a verification step"


def test_a_verification_step_as_decodes_computes_the_hidden_states_of_the_chunked_step(model_dir):
    """The eager forward of a worker holding a prefilled row, over a step of its last token and three drafts:
    the same hidden states through the one-token-decode view as through the 4-token chunk."""
    worker = Worker(WorkerConfig(scheduler_address="", model=str(model_dir), device="cpu", dtype="float32",
                                 num_kv_blocks=8, swap_space=0.01))
    worker.setup(setup_message())
    worker.execute(prefill("a", [5, 6, 7, 8, 9, 10], step_id=1))
    batch = worker.batch
    row = 0
    batch.token_ids[row, 7:10] = [11, 12, 13]
    inputs = dataclasses.replace(batch.build_inputs(np.asarray([row]), np.asarray([4])), num_draft_tokens=3)
    view = inputs.as_single_token_decodes()
    assert view is not None and view.num_decode_seqs == 4
    eager = worker.runner.graphs.paths[-1]
    chunked = eager.run(inputs, len(inputs.input_ids), None)
    as_decodes = eager.run(view, len(view.input_ids), None)
    torch.testing.assert_close(as_decodes, chunked, rtol=1e-5, atol=1e-5)


def test_a_lora_engine_gives_small_base_only_decode_steps_to_the_graphs_without_the_delta():
    """graph_dispatcher.decode_graph_paths: base-only decode steps of up to BASE_ONLY_DECODE_ROWS rows take the graphs
    captured without LoRA (no delta launches); steps with an adapter row, and larger ones, the LoRA graphs (buffers
    only here: nothing is captured or run on the CPU)."""
    from worker_svc.decode_graphs import DecodeGraphs
    from worker_svc.graph_dispatcher import BASE_ONLY_DECODE_ROWS, decode_graph_paths

    cpu = torch.device("cpu")
    lora = DecodeGraphs(None, [], 2 * BASE_ONLY_DECODE_ROWS, 4, 16, cpu, with_lora=True)
    base = DecodeGraphs(None, [], BASE_ONLY_DECODE_ROWS, 4, 16, cpu, with_lora=False)
    dispatcher = GraphDispatcher(None, [], 16, cpu, paths=decode_graph_paths(lora, base))
    for rows in (1, 5, BASE_ONLY_DECODE_ROWS, BASE_ONLY_DECODE_ROWS + 1):
        inputs = step_inputs([1] * rows)
        path, _ = dispatcher.choose(inputs)
        assert path.graphs is (base if rows <= BASE_ONLY_DECODE_ROWS else lora), rows
        with_adapter = dataclasses.replace(inputs, lora_token_slots=np.asarray([0] + [-1] * (rows - 1)))
        assert dispatcher.choose(with_adapter)[0].graphs is lora, rows
    without_lora = GraphDispatcher(None, [], 16, cpu, paths=decode_graph_paths(lora, None))
    assert without_lora.choose(step_inputs([1]))[0].graphs is lora
