"""Compiles the Triton kernel variants a server meets in its first minutes, before it reports ready.

Why: Triton compiles a kernel the first time it sees a new specialization (integer arguments equal to 1 or
divisible by 16, pointer alignment of a sliced metadata view, the decode split count), and a compile takes
a large fraction of a second. Left to the first requests, the first mixed prefill/decode steps of a fresh
server stall for seconds (docs/benchmarks.md, "Host overhead": the first W1 pass after ready against the
second). The decode CUDA graphs already warm
the pure-decode buckets; this runs the eager path over small synthetic batches that cover the other
specializations of a mixed step: a leading decode range of every size class the decode kernel tells apart
(`decode_size_classes`: its split-KV count, a size of 1, a multiple of 16 or not), and none, followed by 0, 1,
2 or 16 prefill chunks (the prefill kernel specializes its sequence count the same way, and the slices of
the metadata after an odd number of decodes are less aligned); and prefill-only batches with chunks of 16
or 17 tokens, with or without earlier tokens in the cache.

Each pass runs the whole model, so every attention variant its layers use (the kernels' HAS_WINDOW /
HAS_SOFTCAP constexprs: Mistral's sliding layers, Qwen2's full and sliding ones, Gemma's soft-cap) meets every
batch shape above; the decode graphs' eager warm-up and capture (decode_graphs.py) likewise run every layer.
A model without windows compiles exactly the plain variants, as before.

The batches write no K/V (every slot is -1) and read block 0 only, whatever it holds: results are discarded.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

NUM_PREFILLS = (0, 1, 2, 16)
CHUNK_LENS = (16, 17)
EARLIER_TOKENS = (0, 5)


def decode_size_classes(max_num_seqs: int, num_kv_heads: int) -> list[int]:
    """The smallest decode count of each (split-KV count, == 1, multiple of 16) class up to max_num_seqs."""
    from kernels.triton_decode_attention import choose_num_kv_splits

    classes: dict[tuple[int, bool, bool], int] = {}
    for count in range(1, max_num_seqs + 1):
        classes.setdefault((choose_num_kv_splits(count, num_kv_heads), count == 1, count % 16 == 0), count)
    return sorted(classes.values())


def warm_up_batches(max_num_seqs: int, num_kv_heads: int) -> list[tuple[list[int], list[int], int]]:
    """(query lens, seq lens, num decodes) of every warm-up batch: decodes first, then prefill chunks."""
    batches = []
    for num_decodes in [0, *decode_size_classes(max_num_seqs, num_kv_heads)]:
        for num_prefills in NUM_PREFILLS:
            if num_decodes + num_prefills and num_decodes + num_prefills <= max_num_seqs:
                batches.append(_batch(num_decodes, [(17, 5)] * num_prefills))
    for chunk_len, earlier in itertools.product(CHUNK_LENS, EARLIER_TOKENS):
        if (chunk_len, earlier) != (17, 5):
            batches.append(_batch(0, [(chunk_len, earlier)]))
    return batches


def _batch(num_decodes: int, chunks: list[tuple[int, int]]) -> tuple[list[int], list[int], int]:
    query_lens = [1] * num_decodes + [length for length, _ in chunks]
    seq_lens = [3] * num_decodes + [length + earlier for length, earlier in chunks]
    return query_lens, seq_lens, num_decodes


@torch.inference_mode()
def warm_up_kernels(model, kv_caches: list[torch.Tensor], block_size: int, max_blocks_per_seq: int,
                    max_num_seqs: int, device: torch.device) -> int:
    """Runs every warm-up batch once; returns how many forward passes it ran."""
    start = time.perf_counter()
    # The cache's KV heads, not the model's: a tensor-parallel rank holds only its share (its splits differ).
    batches = warm_up_batches(max_num_seqs, kv_caches[0].shape[3])
    for query_lens, seq_lens, num_decodes in batches:
        metadata = synthetic_metadata(query_lens, seq_lens, block_size, max_blocks_per_seq, num_decodes, device)
        positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]).to(device)
        input_ids = torch.zeros(positions.shape[0], dtype=torch.long, device=device)
        model.compute_logits(model(input_ids, positions, kv_caches, metadata)[-1:])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("warmed up %d batch shapes in %.1f s", len(batches), time.perf_counter() - start)
    return len(batches)


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
