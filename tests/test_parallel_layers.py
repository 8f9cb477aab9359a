"""The tensor-parallel layers against their unsharded selves: two gloo ranks on the CPU compute what one rank
computes (worker_svc/layers/parallel_linear.py, vocab_parallel_embedding.py), a whole model sharded over two
ranks gives the single rank's logits and greedy tokens, and each rank reads only its slices of a checkpoint.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from pagedserve.free_port import free_port
from pagedserve.testing.paged_runner import greedy_generate_paged, prefill_logits_paged
from pagedserve.testing.tiny_models import OPT_350M_OVERRIDES, QWEN2_SLIDING_WINDOW, make_tiny_model
from worker_svc.layers.checkpoint_tensor import CheckpointTensor
from worker_svc.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from worker_svc.layers.vocab_parallel_embedding import VocabParallelEmbedding
from worker_svc.model_config import ModelConfig
from worker_svc.models.model_loader import load_model
from worker_svc.models.registry import build_model
from worker_svc.models.weight_loader import iter_checkpoint
from worker_svc.tensor_parallel import SINGLE_RANK, TensorParallel, init_tensor_parallel

WORLD_SIZE = 2


def run_ranks(target, *args) -> None:
    """Runs `target(tp, *args)` in WORLD_SIZE processes joined in one gloo group; a failure in any fails the test."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_rank_main, args=(target, init_method, args), nprocs=WORLD_SIZE, join=True)


def _rank_main(rank: int, target, init_method: str, args: tuple) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, WORLD_SIZE, init_method, torch.device("cpu"))
    try:
        target(tp, *args)
    finally:
        dist.destroy_process_group()


def _check_layers(tp: TensorParallel) -> None:
    generator = torch.Generator().manual_seed(0)
    hidden, heads, kv_heads, head_dim, vocab = 8, 4, 1, 4, 11  # fewer KV heads than ranks; vocab not divisible
    x = torch.randn(5, hidden, generator=generator)
    q, k, v = (torch.randn(n * head_dim, hidden, generator=generator) for n in (heads, kv_heads, kv_heads))
    bias = torch.randn((heads + 2 * kv_heads) * head_dim, generator=generator)

    local_heads, kv_start = tp.shard(heads)[1], tp.kv_head_start(kv_heads)
    q_shard = (tp.shard(heads)[0] * head_dim, local_heads * head_dim)
    kv_shard = (kv_start * head_dim, tp.kv_heads(kv_heads) * head_dim)
    qkv = ColumnParallelLinear(hidden, [q_shard, kv_shard, kv_shard], bias=True)
    offset = 0
    for part, weight in enumerate((q, k, v)):
        qkv.load("weight", CheckpointTensor(weight, tuple(weight.shape)), part)
        part_bias = bias[offset : offset + weight.shape[0]]
        qkv.load("bias", CheckpointTensor(part_bias, tuple(part_bias.shape)), part)
        offset += weight.shape[0]
    expected = torch.cat([x @ w.T for w in (q, k, v)], dim=-1) + bias
    q_out, k_out, v_out = qkv(x).split([q_shard[1], kv_shard[1], kv_shard[1]], dim=-1)
    torch.testing.assert_close(q_out, expected[:, q_shard[0] : q_shard[0] + q_shard[1]])
    kv_rows = slice(heads * head_dim + kv_shard[0], heads * head_dim + kv_shard[0] + kv_shard[1])
    torch.testing.assert_close(k_out, expected[:, kv_rows])  # the replicated KV head, whole on both ranks

    inter = 6
    down, down_bias = torch.randn(hidden, inter, generator=generator), torch.randn(hidden, generator=generator)
    row = RowParallelLinear(inter, hidden, bias=True, tp=tp)
    row.load("weight", CheckpointTensor(down, tuple(down.shape)))
    row.load("bias", CheckpointTensor(down_bias, tuple(down_bias.shape)))
    y = torch.randn(5, inter, generator=generator)
    start, count = tp.shard(inter)
    torch.testing.assert_close(row(y[:, start : start + count]), y @ down.T + down_bias)

    table = torch.randn(vocab, hidden, generator=generator)
    embedding = VocabParallelEmbedding(vocab, hidden, tp)
    embedding.load("weight", CheckpointTensor(table, tuple(table.shape)))
    ids = torch.tensor([0, 5, 6, 10, 3])
    torch.testing.assert_close(embedding(ids), table[ids])
    torch.testing.assert_close(embedding.logits(x), x @ table.T)


def test_parallel_layers_compute_what_one_rank_computes():
    run_ranks(_check_layers)


def check_sharded_model(tp: TensorParallel, model_dir: str, prompts: list[list[int]],
                        tolerance: float = 1e-5) -> None:
    """On each rank: the sharded model's prefill logits equal the whole model's (to `tolerance`) and its greedy
    tokens are the same."""
    config = ModelConfig.from_path(model_dir)
    whole, _ = load_model(model_dir, torch.float32, "cpu")
    sharded, _ = load_model(model_dir, torch.float32, "cpu", tensor_parallel=tp)
    local_kv_heads = tp.kv_heads(config.num_key_value_heads)
    want = prefill_logits_paged(whole, config, prompts)
    got = prefill_logits_paged(sharded, config, prompts, num_kv_heads=local_kv_heads)
    for ours, reference in zip(got, want):
        torch.testing.assert_close(ours, reference, atol=tolerance, rtol=tolerance)
    assert (greedy_generate_paged(sharded, config, prompts, 8, prefill_chunk=5, num_kv_heads=local_kv_heads)
            == greedy_generate_paged(whole, config, prompts, 8, prefill_chunk=5))


@pytest.mark.parametrize(
    "arch,kv_heads",
    [("llama", 1), ("llama", 2), ("qwen2", 2), ("qwen3", 1), ("gemma2", 2), ("gemma3", 1), ("opt", None),
     ("mixtral", 2), ("qwen3_moe", 2), ("phi3", 2)],
)
def test_sharded_model_gives_the_single_rank_logits_and_tokens(tmp_path, arch, kv_heads):
    """Llama with one KV head (replicated on both ranks) and two (split), Qwen2 with its qkv bias and tied
    embeddings, Qwen3 with its q/k norms, Gemma 2 (soft-caps, windows) and 3 (q/k norms, rope per layer type);
    OPT (no GQA: its 4 heads split; biases, learned positions and LayerNorms replicated, 350m's projections);
    Mixtral and Qwen3-MoE with every expert's intermediate dim split (and Qwen3-MoE's dense layer); Phi-3 with
    each rank's q/k/v and gate/up rows taken from the fused checkpoint tensors; vocab 512 split by rows;
    prefill and chunked greedy decode through the paged cache."""
    if arch == "opt":
        model_dir = make_tiny_model(tmp_path, "opt", **OPT_350M_OVERRIDES)
    else:
        model_dir = make_tiny_model(tmp_path, arch, num_key_value_heads=kv_heads)
    prompts = [[1, 17, 300, 42, 9, 255, 7], [1, 5, 5, 5, 480, 2, 61, 99, 100, 3, 4, 8]]
    run_ranks(check_sharded_model, str(model_dir), prompts)


@pytest.mark.parametrize("arch,overrides", [("mistral", {}), ("qwen2", QWEN2_SLIDING_WINDOW)], ids=["mistral", "qwen2"])
def test_sharded_windowed_model_gives_the_single_rank_logits_and_tokens(tmp_path, arch, overrides):
    """Mistral (window 20) and Qwen2 (window 12 from layer 1 on) over two ranks, prompts longer than the
    windows: each rank's heads attend through the same window."""
    model_dir = make_tiny_model(tmp_path, arch, **overrides)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (29, 45)]
    run_ranks(check_sharded_model, str(model_dir), prompts)


class RecordingTensor(CheckpointTensor):
    """A checkpoint tensor that counts the elements read from it."""

    def __init__(self, inner: CheckpointTensor, read: dict[str, int], name: str):
        super().__init__(inner, inner.shape)
        self._read, self._name = read, name

    def _note(self, tensor: torch.Tensor) -> torch.Tensor:
        self._read[self._name] = self._read.get(self._name, 0) + tensor.numel()
        return tensor

    def full(self) -> torch.Tensor:
        return self._note(self._source.full())

    def rows(self, start: int, count: int) -> torch.Tensor:
        return self._note(self._source.rows(start, count))

    def columns(self, start: int, count: int) -> torch.Tensor:
        return self._note(self._source.columns(start, count))


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen3_moe"])
def test_a_rank_reads_only_its_slices_of_the_checkpoint(tmp_path, arch):
    """Rank 1 of 2 (no collective is needed to load) reads half of every sharded tensor (each expert's too) and
    the whole of the replicated ones (norms, MoE routers), from safetensors slices."""
    model_dir = make_tiny_model(tmp_path, arch, num_key_value_heads=2)
    config = ModelConfig.from_path(model_dir)
    with torch.device("meta"):
        model = build_model(config, tensor_parallel=TensorParallel(rank=1, world_size=2))
    model = model.to_empty(device="cpu")
    read: dict[str, int] = {}
    sizes: dict[str, int] = {}

    def recorded():
        for name, tensor in iter_checkpoint(model_dir, config):
            sizes[name] = int(torch.Size(tensor.shape).numel())
            yield name, RecordingTensor(tensor, read, name)

    model.load_weights(recorded())
    for name, size in sizes.items():
        expected = size if "norm" in name or name.endswith(".gate.weight") else size // 2
        assert read[name] == expected, name


def test_one_rank_builds_plain_layers_with_no_collective():
    """With one rank the parallel layers are the plain matmul and lookup: the same numbers as nn.Linear."""
    linear = nn.Linear(6, 4)
    column = ColumnParallelLinear.split(6, [4], bias=True, tp=SINGLE_RANK)
    column.load("weight", CheckpointTensor(linear.weight.detach(), (4, 6)))
    column.load("bias", CheckpointTensor(linear.bias.detach(), (4,)))
    x = torch.randn(3, 6)
    assert torch.equal(column(x), linear(x))


def test_sizes_the_model_cannot_split_evenly_are_refused_naming_the_flag(tmp_path):
    """Checked before any process joins a group (worker_svc/tensor_parallel_fit.py): attention heads, KV heads
    (dividing the size or divided by it) and the MLP width must split evenly."""
    import dataclasses

    from worker_svc.tensor_parallel_fit import shard_refusal

    config = ModelConfig.from_path(make_tiny_model(tmp_path, "llama"))  # 4 heads, 2 KV heads, MLP 128
    assert shard_refusal(config, 2) is None and shard_refusal(config, 4) is None  # 4 ranks: KV heads replicated
    assert "does not divide the model's 4 attention heads" in shard_refusal(config, 3)
    six_heads = dataclasses.replace(config, num_attention_heads=6, num_key_value_heads=4)
    assert "--tensor-parallel-size 3" in shard_refusal(dataclasses.replace(six_heads, num_key_value_heads=2), 3)
    assert "4 KV heads (num_key_value_heads) do not split evenly" in shard_refusal(six_heads, 6)
    assert "intermediate_size 130" in shard_refusal(dataclasses.replace(config, intermediate_size=130), 4)
    moe = ModelConfig.from_path(make_tiny_model(tmp_path, "qwen3_moe", moe_intermediate_size=34))
    assert shard_refusal(moe, 2) is None
    assert "moe_intermediate_size 34" in shard_refusal(moe, 4)


def test_a_lone_rank_makes_an_indexed_cuda_device_current_and_leaves_a_bare_cuda_alone(monkeypatch):
    """A -dp engine's lone rank on cuda:1 must make it current (its graphs capture on that device's stream); a bare
    "cuda" names the current device, which torch.cuda.set_device refuses."""
    from worker_svc.tensor_parallel import SINGLE_RANK, init_tensor_parallel

    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    assert init_tensor_parallel(0, 1, None, torch.device("cuda")) is SINGLE_RANK
    assert made_current == []
    assert init_tensor_parallel(0, 1, None, torch.device("cuda:1")) is SINGLE_RANK
    assert made_current == [torch.device("cuda:1")]
