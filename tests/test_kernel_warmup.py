"""The start-up kernel warm-up runs every mixed decode/prefill shape it promises and leaves the KV cache as
it found it (it must not write K/V into blocks the scheduler is about to hand out)."""

from __future__ import annotations

import torch

from kernels.triton_decode_attention import choose_num_kv_splits
from pagedserve.testing.paged_runner import make_kv_caches
from pagedserve.testing.tiny_models import make_tiny_model
from worker_svc import kernel_warmup
from worker_svc.models.model_loader import load_model


def test_decode_size_classes_cover_every_split_count_and_alignment():
    counts = kernel_warmup.decode_size_classes(256, num_kv_heads=2)
    assert {choose_num_kv_splits(n, 2) for n in counts} == {choose_num_kv_splits(n, 2) for n in range(1, 257)}
    assert 1 in counts and any(n % 16 == 0 for n in counts) and any(n % 16 and n > 1 for n in counts)
    assert counts == sorted(set(counts)) and max(counts) <= 256


def test_warm_up_runs_each_batch_shape_and_writes_no_kv(tmp_path):
    model, config = load_model(make_tiny_model(tmp_path, arch="llama", seed=0), torch.float32, "cpu")
    kv_caches = [torch.randn_like(cache) for cache in make_kv_caches(config, num_blocks=4, block_size=16)]
    before = [cache.clone() for cache in kv_caches]
    shapes = []
    forward = model.forward

    def recording_forward(input_ids, positions, caches, metadata):
        query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).tolist()
        shapes.append((metadata.num_decode_seqs, tuple(query_lens), tuple(metadata.seq_lens.tolist())))
        assert (metadata.slot_mapping == -1).all() and len(input_ids) == len(positions) == sum(query_lens)
        assert all(q == 1 for q in query_lens[: metadata.num_decode_seqs])
        return forward(input_ids, positions, caches, metadata)

    model.forward = recording_forward
    count = kernel_warmup.warm_up_kernels(model, kv_caches, 16, 4, 32, torch.device("cpu"))
    decode_counts = kernel_warmup.decode_size_classes(32, config.num_key_value_heads)
    fitting = [(d, p) for d in [0, *decode_counts] for p in (0, 1, 2, 16) if 0 < d + p <= 32]
    assert count == len(shapes) == len(set(shapes)) == len(fitting) + 3
    assert {(shape[0], len(shape[1]) - shape[0]) for shape in shapes} == set(fitting)
    assert {q for shape in shapes for q in shape[1][shape[0]:]} == {16, 17}
    assert all(torch.equal(a, b) for a, b in zip(kv_caches, before))


def test_warm_up_launches_every_attention_variant_a_windowed_model_serves(tmp_path):
    """Each (window, soft-cap) variant is its own compile of the Triton kernels: warm-up runs the whole model,
    so each layer's variant meets every decode split class and the prefill kernel before serving. Qwen2 with
    layer 0 full and layers 1-2 sliding; serving = greedy decoding with chunked prefills, mixed batches."""
    from kernels.attention_backend import TorchReferenceBackend
    from kernels.kv_quant import UNIT_KV_SCALES
    from pagedserve.testing.paged_runner import greedy_generate_paged
    from pagedserve.testing.tiny_models import QWEN2_SLIDING_WINDOW

    launched: set[tuple] = set()

    class RecordingBackend(TorchReferenceBackend):
        def paged_attention(self, query, kv_cache, metadata, scale, sliding_window=None, logit_softcap=None,
                            kv_scales=UNIT_KV_SCALES):
            query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).tolist()
            decodes = metadata.num_decode_seqs
            if decodes is None:
                decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
            if decodes:
                splits = choose_num_kv_splits(decodes, kv_cache.shape[3])
                launched.add(("decode", splits, sliding_window, logit_softcap))
            if decodes < len(query_lens):
                launched.add(("prefill", sliding_window, logit_softcap))
            return super().paged_attention(query, kv_cache, metadata, scale, sliding_window, logit_softcap,
                                           kv_scales)

    path = make_tiny_model(tmp_path, arch="qwen2", seed=0, **QWEN2_SLIDING_WINDOW)
    model, config = load_model(path, torch.float32, "cpu", attention_backend=RecordingBackend())
    kv_caches = make_kv_caches(config, num_blocks=4, block_size=16)
    kernel_warmup.warm_up_kernels(model, kv_caches, 16, 8, 8, torch.device("cpu"))
    warmed = set(launched)
    launched.clear()
    prompts = [[3 + i] * length for i, length in enumerate((5, 30, 47, 2, 19, 26, 40, 11))]
    greedy_generate_paged(model, config, prompts, 4, prefill_chunk=13)
    assert {variant[-2] for variant in launched} == {None, 12}
    assert launched <= warmed, launched - warmed
