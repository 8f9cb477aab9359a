"""Which kernels a worker runs: Triton on a GPU, the pure-torch references on the CPU (attention there by
kernels/cpu_paged_attention.py unless `--attention-backend torch` asks for the reference itself).

`--attention-backend` picks the whole set: the attention backend and the layer ops (RMSNorm, rotary,
SiLU-and-mul) always come from the same side, so "torch" on a GPU is the all-reference path to compare
against. `--batch-invariant` picks that side's batch-invariant set (kernels/batch_invariant_ref.py on the
CPU, kernels/batch_invariant_layer_ops.py on a GPU).
"""

from __future__ import annotations

import logging

from kernels.attention_backend import AttentionBackend, TorchReferenceBackend
from kernels.cpu_paged_attention import CpuAttentionBackend
from kernels.batch_invariant_ref import BatchInvariantTorchBackend, batch_invariant_torch_layer_ops
from kernels.layer_ops import LayerOps, torch_layer_ops, triton_layer_ops
from worker_svc.config import WorkerConfig

logger = logging.getLogger(__name__)


def kernel_set(config: WorkerConfig) -> str:
    """"triton" or "torch": the flag, with "auto" resolved by the device."""
    if config.attention_backend == "auto":
        return "triton" if config.device.startswith("cuda") else "torch"
    return config.attention_backend


def make_layer_ops(config: WorkerConfig) -> LayerOps:
    if config.batch_invariant:
        if kernel_set(config) == "torch":
            return batch_invariant_torch_layer_ops()
        from kernels.batch_invariant_layer_ops import batch_invariant_triton_layer_ops

        return batch_invariant_triton_layer_ops(config.device)
    return triton_layer_ops() if kernel_set(config) == "triton" else torch_layer_ops()


def make_attention_backend(config: WorkerConfig) -> AttentionBackend:
    if config.batch_invariant:
        if kernel_set(config) == "torch":
            return BatchInvariantTorchBackend()
        from kernels.triton_batch_invariant_attention import BatchInvariantTritonBackend, segments_agree

        # Decodes split over KV segments only where the device gives them the one-program merge's bits.
        agree = segments_agree(config.device)
        logger.info("batch-invariant attention on %s: %s", config.device,
                    "small decode batches split over KV segments" if agree
                    else "every decode in one program (the split programs' bits differ)")
        return BatchInvariantTritonBackend(split_decodes=None if agree else False)
    if kernel_set(config) == "torch":
        # On the CPU by default the batched-decode backend; "torch" asked for by name is the pure reference.
        return CpuAttentionBackend() if config.attention_backend == "auto" else TorchReferenceBackend()
    from kernels.triton_backend import TritonAttentionBackend  # triton is imported only when used

    return TritonAttentionBackend()
