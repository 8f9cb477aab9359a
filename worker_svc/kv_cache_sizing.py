"""How many KV blocks a worker can hold: fixed by flag, or measured.

On a GPU, DESIGN.md's rule: after the weights are loaded, run one forward pass at the largest batch the
scheduler may send (max_num_batched_tokens tokens, max_num_seqs sampled rows), read the peak memory, and give
what is left of `total * gpu_memory_utilization` to the pool. On the CPU, a fixed budget in GiB. Blocks are
counted in the pool's dtype (`kv_dtype`: an fp8 pool gets twice a bf16 one's blocks in the same memory).

With a draft model (speculative decoding, draft_model.py) a block id means a block in each of two pools, the
target's and the draft's: a block costs both, the draft's weights are in the peak (loaded before the profile),
its own profile pass is measured beside the target's, and its scratch blocks come off the top. Where the draft's
passes run from CUDA graphs of their own, those graphs' memory pool comes off the top too (`DraftPool.captured`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels.attention_metadata import AttentionMetadata
from worker_svc.config import GIB, WorkerConfig
from worker_svc.kv_cache import bytes_per_block
from worker_svc.model_config import ModelConfig
from worker_svc.tensor_parallel import SINGLE_RANK, TensorParallel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftPool:
    """What a draft model adds to the sizing: its model (profiled; None: not profiled, an EAGLE head's one
    layer, whose pass is far below the target's), its bytes per block of the shared block ids, and the bytes it
    takes beyond what the profile sees (its scratch blocks; an EAGLE head also the target's wider output).

    `captured`: the draft's passes will run from CUDA graphs (graph_dispatcher.py) of its own. The target's
    graphs take their memory pool from the room its profiled activations leave (the profile's peak is the
    larger of the two passes', freed before the pools are allocated); the draft's graphs hold a second pool,
    allocated for good beside the target's, so the sizing reserves the draft's profiled activations (its pass's
    peak over what was allocated before it, less its throwaway cache) on top. The pool holds the activations of
    at most max_num_seqs tokens (decode graphs) and of the piecewise graphs' largest bucket; where that bucket
    is larger than the profiled pass and does not fit, those graphs are not captured (mixed_graphs.py)."""

    model: torch.nn.Module | None
    model_config: ModelConfig
    bytes_per_block: int
    scratch_bytes: int
    captured: bool = False


def num_kv_blocks(
    config: WorkerConfig,
    model: torch.nn.Module,
    model_config: ModelConfig,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    kv_dtype: torch.dtype,
    device: torch.device,
    tensor_parallel: TensorParallel = SINGLE_RANK,
    draft: DraftPool | None = None,
) -> int:
    per_block = bytes_per_block(model_config, block_size, kv_dtype, tensor_parallel)
    reserved = 0
    if draft is not None:
        per_block += draft.bytes_per_block
        reserved = draft.scratch_bytes
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if device.type != "cuda":
        return max(1, int(config.cpu_kv_cache_space * GIB - reserved) // per_block)
    num_tokens = min(max_num_batched_tokens, max_model_len)
    profile_blocks = -(-num_tokens // block_size)
    torch.cuda.empty_cache()
    profiled = [(model, model_config)]
    if draft is not None and draft.model is not None:
        profiled.append((draft.model, draft.model_config))
    peak = 0
    for profiled_model, profiled_config in profiled:  # one after the other: the peak is the larger pass's
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        _profile_forward(profiled_model, profiled_config, num_tokens, min(max_num_seqs, num_tokens), profile_blocks,
                         block_size, kv_dtype, device, tensor_parallel.kv_heads(profiled_config.num_key_value_heads))
        torch.cuda.synchronize(device)
        pass_peak = torch.cuda.max_memory_allocated(device)
        peak = max(peak, pass_peak)
    if draft is not None and draft.model is not None and draft.captured:  # the draft's pass was the last
        draft_graph_bytes = max(0, pass_peak - before - profile_blocks * draft.bytes_per_block)
        reserved += draft_graph_bytes
        logger.info("memory profile: %.1f MiB kept for the draft model's CUDA graphs", draft_graph_bytes / 2**20)
    # Each pass's throwaway cache is freed before the next: the larger one was in the peak (over-counted: safe).
    profile_cache_bytes = profile_blocks * bytes_per_block(model_config, block_size, kv_dtype, tensor_parallel)
    _, total = torch.cuda.mem_get_info(device)
    available = total * config.gpu_memory_utilization - (peak - profile_cache_bytes) - reserved
    blocks = int(available // per_block)
    logger.info("memory profile: total %.1f GiB, peak %.2f GiB -> %d KV blocks", total / GIB, peak / GIB, blocks)
    if blocks < 1:
        raise SystemExit(
            f"no memory left for the KV cache at --gpu-memory-utilization {config.gpu_memory_utilization}"
        )
    torch.cuda.empty_cache()
    return blocks


@torch.inference_mode()
def _profile_forward(model, model_config: ModelConfig, num_tokens: int, num_seqs: int, num_blocks: int,
                     block_size: int, kv_dtype, device, num_kv_heads: int) -> None:
    """One sequence of num_tokens tokens through a throwaway cache (of the pool's dtype), then the logits of
    num_seqs rows."""
    shape = (2, num_blocks, block_size, num_kv_heads, model_config.head_dim)
    kv_caches = [torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(model_config.num_hidden_layers)]
    positions = torch.arange(num_tokens, device=device)
    metadata = AttentionMetadata(
        slot_mapping=positions.clone(),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device).unsqueeze(0),
        block_size=block_size,
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    hidden = model(input_ids, positions, kv_caches, metadata)
    model.compute_logits(hidden[-num_seqs:])
    del kv_caches
