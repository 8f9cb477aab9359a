"""The worker's paged KV pool on the device and its swap pool in host memory, and the block ops on them.

Owned by the worker process alone; the scheduler only ever sees block ids. Layout per layer: one tensor
`[2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]` (this rank's KV heads under tensor parallel;
block ids mean the same slots on every rank), the same in both pools, so a swap or a copy is
one indexed copy per layer over all moved blocks at once.

The pools' dtype is the KV cache's (`--kv-cache-dtype`: the model's, or float8_e4m3fn, kernels/kv_quant.py);
bytes per block follow its element size, so an fp8 pool holds twice the blocks of a bf16 one in the same
memory. Swaps and copies move an fp8 pool's raw bytes (a uint8 view), so every move keeps the bits.
"""

from __future__ import annotations

import torch

from kernels.kv_quant import is_fp8
from worker_svc.model_config import ModelConfig
from worker_svc.tensor_parallel import SINGLE_RANK, TensorParallel


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                    tensor_parallel: TensorParallel = SINGLE_RANK) -> int:
    """Bytes of one block of this rank's pool (its KV heads only)."""
    element_size = torch.tensor([], dtype=dtype).element_size()
    num_kv_heads = tensor_parallel.kv_heads(config.num_key_value_heads)
    return 2 * config.num_hidden_layers * block_size * num_kv_heads * config.head_dim * element_size


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        num_swap_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        tensor_parallel: TensorParallel = SINGLE_RANK,
    ):
        shape = (2, num_blocks, block_size, tensor_parallel.kv_heads(config.num_key_value_heads), config.head_dim)
        swap_shape = (2, num_swap_blocks) + shape[2:]
        # Zeroed so that a padded read of a never-written slot yields finite values.
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        pin = device.type == "cuda"
        # Not zeroed: swap blocks are always written (swap_out) before they are read (swap_in).
        self.swap_layers = [
            torch.empty(swap_shape, dtype=dtype, pin_memory=pin) for _ in range(config.num_hidden_layers)
        ]
        self.device = device
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks

    def swap_out(self, moves: list[tuple[int, int]]) -> None:
        """Device blocks -> swap blocks, (src device block, dst swap block) pairs."""
        if not moves:
            return
        src, dst = _indices(moves, self.device)
        dst_cpu = dst.cpu()
        for layer, swap_layer in zip(self.layers, self.swap_layers):
            _raw(swap_layer)[:, dst_cpu] = _raw(layer)[:, src].to("cpu")

    def swap_in(self, moves: list[tuple[int, int]]) -> None:
        """Swap blocks -> device blocks, (src swap block, dst device block) pairs."""
        if not moves:
            return
        src, dst = _indices(moves, self.device)
        src_cpu = src.cpu()
        for layer, swap_layer in zip(self.layers, self.swap_layers):
            _raw(layer)[:, dst] = _raw(swap_layer)[:, src_cpu].to(self.device, non_blocking=True)

    def copy(self, moves: list[tuple[int, int]]) -> None:
        """Device block -> device block (copy-on-write of a shared partial block)."""
        if not moves:
            return
        src, dst = _indices(moves, self.device)
        for layer in self.layers:
            _raw(layer)[:, dst] = _raw(layer)[:, src]


def _raw(pool: torch.Tensor) -> torch.Tensor:
    """The pool itself, or an fp8 pool's bytes: indexed copies of float8 tensors are not implemented on every
    device and torch version, byte copies are (and keep the bits)."""
    return pool.view(torch.uint8) if is_fp8(pool.dtype) else pool


def _indices(moves: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = torch.tensor(moves, dtype=torch.long)
    return pairs[:, 0].to(device), pairs[:, 1].to(device)
