"""Compiles the Triton kernel variants a server meets in its first minutes, before it reports ready.

Why: Triton compiles a kernel the first time it sees a new specialization (integer arguments equal to 1 or
divisible by 16, pointer alignment of a sliced metadata view, the decode split count), and a compile takes
100 ms to a second. Left to the first requests, the first mixed prefill/decode steps of a fresh server stall
for seconds (measured: the first W1 run 2.4x slower than the second). The decode CUDA graphs already warm
the pure-decode buckets; this runs the eager path over small synthetic batches that cover the other
specializations: 0, 1 or 16 decodes in front (an aligned or odd metadata slice), then 0, 1 or 2 prefill
chunks of 16 or 17 tokens, over a context with or without earlier tokens in the cache.

The batches write no K/V (every slot is -1) and read block 0 only, whatever it holds: results are discarded.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

NUM_DECODES = (0, 1, 16)
NUM_PREFILLS = (0, 1, 2)
CHUNK_LENS = (16, 17)
EARLIER_TOKENS = (0, 5)


@torch.inference_mode()
def warm_up_kernels(model, kv_caches: list[torch.Tensor], block_size: int, max_blocks_per_seq: int,
                    device: torch.device) -> int:
    """Runs every combination once; returns how many forward passes it ran."""
    start = time.perf_counter()
    count = 0
    for num_decodes, num_prefills, chunk_len, earlier in itertools.product(
        NUM_DECODES, NUM_PREFILLS, CHUNK_LENS, EARLIER_TOKENS
    ):
        if num_decodes + num_prefills == 0 or (num_prefills == 0 and (chunk_len, earlier) != (16, 0)):
            continue
        query_lens = [1] * num_decodes + [chunk_len] * num_prefills
        seq_lens = [1 + earlier] * num_decodes + [chunk_len + earlier] * num_prefills
        if max(seq_lens) > max_blocks_per_seq * block_size:
            continue
        metadata = synthetic_metadata(query_lens, seq_lens, block_size, max_blocks_per_seq, num_decodes, device)
        positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]).to(device)
        input_ids = torch.zeros(positions.shape[0], dtype=torch.long, device=device)
        model.compute_logits(model(input_ids, positions, kv_caches, metadata)[-1:])
        count += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("warmed up %d kernel variants in %.1f s", count, time.perf_counter() - start)
    return count


def synthetic_metadata(query_lens: list[int], seq_lens: list[int], block_size: int, max_blocks_per_seq: int,
                       num_decode_seqs: int, device: torch.device) -> AttentionMetadata:
    """Metadata of a batch that writes nothing (slots -1) and reads block 0 for every context position."""
    starts = [0, *itertools.accumulate(query_lens)]
    return AttentionMetadata(
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(len(seq_lens), max_blocks_per_seq, dtype=torch.int32, device=device),
        block_size=block_size,
        num_decode_seqs=num_decode_seqs,
    )
