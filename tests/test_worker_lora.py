"""Multi-LoRA on the worker: rows of three PEFT adapters (different ranks, targets, rsLoRA) and of the base model
decode in one batch, each greedy token for token PEFT's `PeftModel` output; one GPU slot reloaded with adapters of
other targets serves each exactly (nothing of the previous one is left), and from the host copy once the files are
gone; the adapters are refused at setup for what this slice cannot serve, naming the adapter and the key."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from kernels.lora_ref import lora_add
from pagedserve.testing.tiny_lora import make_tiny_adapter, peft_greedy
from pagedserve.testing.tiny_models import make_tiny_model
from protos.pagedserve.v1 import worker_pb2
from service_runtime.load_refusal import LoadRefused
from worker_svc.config import WorkerConfig
from worker_svc.decode_graphs import DecodeGraphs
from worker_svc.graph_dispatcher import DecodeGraphPath, GraphDispatcher
from worker_svc.persistent_batch import PersistentBatch
from worker_svc.worker import Worker

BLOCK = 4
MAX_TOKENS = 6
PROMPTS = [[5, 9, 2, 7, 3, 5, 9], [11, 4, 8, 30, 31, 2, 2, 9, 40], [7, 7, 1, 3, 99], [20, 21, 22, 23, 24, 25]]
ADAPTERS = {  # name: (rank, targets, extra config)
    "attn": (4, ["q_proj", "v_proj"], {}),
    "mlp": (8, ["gate_proj", "up_proj", "down_proj"], {"use_rslora": True}),
    "all": (2, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], {}),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def served(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    model = make_tiny_model(root, request.param, seed=4)
    adapters = {name: make_tiny_adapter(model, root / name, rank, targets, seed=index, **extra)
                for index, (name, (rank, targets, extra)) in enumerate(ADAPTERS.items())}
    return model, adapters


def make_worker(model, adapters, max_lora_rank=8, max_loras=3, max_cpu_loras=0) -> Worker:
    """A worker with `max_loras` empty GPU slots that read `adapters` at setup (the --lora-modules ones)."""
    worker = Worker(WorkerConfig(scheduler_address="", model=str(model), num_kv_blocks=64, swap_space=0.01))
    worker.setup(worker_pb2.WorkerSetup(
        block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64, max_lora_rank=max_lora_rank,
        max_loras=max_loras, max_cpu_loras=max_cpu_loras,
        lora_adapters=[worker_pb2.LoraAdapterSetup(name=name, path=str(path)) for name, path in adapters.items()]))
    return worker


def loads(adapters: dict, first_slot: int = 1) -> list[worker_pb2.LoraLoad]:
    return [worker_pb2.LoraLoad(slot=slot, name=name, path=str(path))
            for slot, (name, path) in enumerate(adapters.items(), start=first_slot)]


def decode(worker, requests: list[worker_pb2.NewRequest], lora_loads=()) -> dict[str, list[int]]:
    """The rows' greedy tokens over MAX_TOKENS steps, the first plan loading `lora_loads`."""
    outputs: dict[str, list[int]] = {new.request_id: [] for new in requests}
    step = worker_pb2.StepPlan(new_requests=requests, lora_loads=list(lora_loads))
    for _ in range(MAX_TOKENS):
        sampled = worker.execute(step).sampled
        for request_id, token in zip(sampled.request_ids, sampled.token_ids):
            outputs[request_id].append(token)
        step = worker_pb2.StepPlan(scheduled_requests=[
            worker_pb2.ScheduledRequest(request_id=request_id, num_scheduled_tokens=1) for request_id in outputs])
    step = worker_pb2.StepPlan(finished_request_ids=list(outputs))
    worker.execute(step)
    return outputs


def new(request_id, tokens, slot, first_block) -> worker_pb2.NewRequest:
    return worker_pb2.NewRequest(
        request_id=request_id, token_ids=tokens, block_ids=list(range(first_block, first_block + 8)),
        num_scheduled_tokens=len(tokens), num_prompt_tokens=len(tokens), lora_slot=slot,
        sampling=worker_pb2.WorkerSamplingParams(temperature=0.0, top_p=1.0, top_k=-1, seed=1, num_logprobs=-1,
                                                 num_prompt_logprobs=-1))


def test_adapters_and_the_base_model_interleaved_in_one_batch_equal_peft(served):
    """Four rows, one per adapter and one of the base model, prefilled and decoded together."""
    model, adapters = served
    worker = make_worker(model, adapters)
    names = [None, *adapters]
    requests = [new(f"r{i}", PROMPTS[i], slot=i, first_block=8 * i) for i in range(4)]
    outputs = decode(worker, requests, loads(adapters))
    expected = {f"r{i}": peft_greedy(model, None if names[i] is None else adapters[names[i]], PROMPTS[i], MAX_TOKENS)
                for i in range(4)}
    assert outputs == expected
    base_alone = [peft_greedy(model, None, PROMPTS[i], MAX_TOKENS) for i in range(1, 4)]
    assert all(outputs[f"r{i}"] != base_alone[i - 1] for i in range(1, 4)), "an adapter changed nothing"


def test_decode_steps_through_the_graphs_static_buffers_with_adapter_rows_equal_peft(served):
    """The CUDA-graph decode path with LoRA (decode_graphs.py `with_lora`), run on the CPU over its static buffers
    (uncaptured: the same buffer filling and padding): five rows, three adapters and two of the base model, in
    bucket 8 (three padding rows with slot -1), each greedy token for token PEFT's."""
    model, adapters = served
    worker = make_worker(model, adapters)
    runner = worker.runner
    graphs = DecodeGraphs(runner.model, runner.kv_cache.layers, 8, PersistentBatch.max_blocks_per_seq(64, BLOCK),
                          BLOCK, torch.device("cpu"), with_lora=True)
    decode_path = CountingPath(DecodeGraphPath(graphs))
    runner.graphs = GraphDispatcher(runner.model, runner.kv_cache.layers, BLOCK, torch.device("cpu"), (decode_path,))
    names = [None, *adapters, None]
    prompts = [*PROMPTS, PROMPTS[3]]
    requests = [new(f"r{i}", prompts[i], slot=0 if names[i] is None else i, first_block=8 * i) for i in range(5)]
    outputs = decode(worker, requests, loads(adapters))
    assert decode_path.sizes == [8] * (MAX_TOKENS - 1)  # every step after the prefill replayed bucket 8
    expected = {f"r{i}": peft_greedy(model, None if names[i] is None else adapters[names[i]], prompts[i], MAX_TOKENS)
                for i in range(5)}
    assert outputs == expected


class CountingPath:
    """A forward path that records the bucket of each step it runs."""

    def __init__(self, path):
        self._path, self.name, self.sizes = path, path.name, []

    def bucket_for(self, inputs):
        return self._path.bucket_for(inputs)

    def run(self, inputs, size, previous_sampled):
        self.sizes.append(size)
        return self._path.run(inputs, size, previous_sampled)


def test_graphs_captured_without_lora_take_no_step_with_adapter_tokens(served):
    model, adapters = served
    worker = make_worker(model, adapters)
    runner = worker.runner
    graphs = DecodeGraphs(runner.model, runner.kv_cache.layers, 8, PersistentBatch.max_blocks_per_seq(64, BLOCK),
                          BLOCK, torch.device("cpu"))
    rows = [worker.batch.add(new("b", PROMPTS[0][:1], 0, 0)), worker.batch.add(new("l", PROMPTS[2][:1], 2, 8))]
    assert graphs.bucket_for(worker.batch.build_inputs(np.asarray(rows[:1]), np.asarray([1]))) == 1
    assert graphs.bucket_for(worker.batch.build_inputs(np.asarray(rows), np.asarray([1, 1]))) is None


def test_one_slot_reloaded_serves_each_adapter_exactly_and_reloads_from_host_memory(served, tmp_path):
    """--max-loras 1: attn (q, v), then mlp (gate, up, down: nothing of attn may be left), then attn again from
    the host copy (its files deleted); --max-cpu-loras 2 keeps both."""
    model, adapters = served
    attn = shutil.copytree(adapters["attn"], tmp_path / "attn")
    worker = make_worker(model, {}, max_loras=1, max_cpu_loras=2)
    expected = {name: peft_greedy(model, path, PROMPTS[1], MAX_TOKENS) for name, path in
                (("attn", attn), ("mlp", adapters["mlp"]))}
    for turn, name in enumerate(["attn", "mlp", "attn"]):
        if turn == 2:
            shutil.rmtree(attn)
        load = worker_pb2.LoraLoad(slot=1, name=name, path=str(attn if name == "attn" else adapters["mlp"]))
        outputs = decode(worker, [new(f"{name}{turn}", PROMPTS[1], slot=1, first_block=0)], [load])
        assert outputs[f"{name}{turn}"] == expected[name], (turn, name)


def test_lora_add_reference_adds_each_tokens_own_adapter_and_skips_slot_minus_one():
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 6, generator=generator), torch.randn(5, 4, generator=generator)
    lora_a, lora_b = torch.randn(3, 2, 6, generator=generator), torch.randn(3, 4, 2, generator=generator)
    slots, scalings = torch.tensor([2, -1, 1, 2, -1]), torch.tensor([0.0, 0.5, 2.0])
    expected = y.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[t] += scalings[s] * ((x[t] @ lora_a[s].T) @ lora_b[s].T)
    lora_add(y, x, lora_a, lora_b, slots, scalings)
    torch.testing.assert_close(y, expected)


def _edited_adapter(adapters, tmp_path, **changes):
    """A copy of the "attn" adapter whose adapter_config.json has `changes`."""
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(adapters["attn"], copy)
    config = json.loads((copy / "adapter_config.json").read_text())
    config.update(changes)
    (copy / "adapter_config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("changes, named", [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
    ({"r": 32}, "--max-lora-rank 8"),
])
def test_refused_adapters_name_the_adapter_and_the_key(served, tmp_path, changes, named):
    model, adapters = served
    with pytest.raises(LoadRefused, match=rf"'odd'.*{named}"):
        make_worker(model, {"odd": _edited_adapter(adapters, tmp_path, **changes)})


def test_a_target_the_model_does_not_have_is_refused(served, tmp_path):
    from safetensors.torch import load_file, save_file

    model, adapters = served
    copy = _edited_adapter(adapters, tmp_path)
    weights = load_file(copy / "adapter_model.safetensors")
    weights = {key.replace("self_attn.q_proj", "self_attn.qq_proj"): value for key, value in weights.items()}
    save_file(weights, copy / "adapter_model.safetensors")
    with pytest.raises(LoadRefused, match="'odd'.*qq_proj"):
        make_worker(model, {"odd": copy})


def test_steps_without_adapter_rows_carry_no_slots(served):
    model, adapters = served
    worker = make_worker(model, adapters)
    base = worker.batch.build_inputs(np.asarray([worker.batch.add(new("b", PROMPTS[0], 0, 0))]), np.asarray([7]))
    assert base.lora_token_slots is None
    row = worker.batch.add(new("l", PROMPTS[2], 2, 8))
    mixed = worker.batch.build_inputs(np.asarray([0, row]), np.asarray([7, 5]))
    assert mixed.lora_token_slots.tolist() == [-1] * 7 + [1] * 5  # slot 2 is index 1 of the layers' stacks
