"""The token embedding and the LM head split over the tensor-parallel ranks by vocabulary rows.

Each rank holds rows [vocab_start, vocab_start + per_rank) of the (padded) vocabulary. A lookup masks the ids
outside this rank's rows to zero vectors and one all-reduce sums the ranks' vectors (exactly one rank holds
each id, so the sum is that row). As the LM head, each rank multiplies by its rows and the shards are
all-gathered, so every rank has the whole logits: every rank samples identically and the next step's input
token is on every rank without a broadcast (worker.py). The padding rows (vocab not divisible by N) are zero
and cut off the gathered logits. With one rank: plain `F.embedding` and `F.linear`, as before.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from worker_svc.layers.checkpoint_tensor import CheckpointTensor
from worker_svc.tensor_parallel import TensorParallel


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.linear = F.linear  # the loader sets LayerOps.linear (a batch-invariant one with --batch-invariant)
        self.tp = tp
        self.vocab_size = vocab_size
        per_rank = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * per_rank
        self.num_rows = max(0, min(per_rank, vocab_size - self.vocab_start))  # rows from the checkpoint
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [T, hidden] of token ids [T]."""
        if not self.tp.is_parallel:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_rows)
        vectors = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(vectors.masked_fill(outside.unsqueeze(-1), 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] of hidden states [N, hidden] (the product in the model dtype, as HF's), whole on
        every rank."""
        local = self.linear(hidden, self.weight, None)
        if not self.tp.is_parallel:
            return local
        return self.tp.all_gather_last_dim(local)[:, : self.vocab_size]

    def load(self, kind: str, checkpoint: CheckpointTensor, part: int = 0) -> None:
        rows = checkpoint.rows(self.vocab_start, self.num_rows)
        if rows.shape[1:] != self.weight.shape[1:] or checkpoint.shape[0] != self.vocab_size:
            raise ValueError(f"{kind}: checkpoint shape {tuple(checkpoint.shape)} != "
                             f"({self.vocab_size}, {self.weight.shape[1]})")
        with torch.no_grad():
            self.weight[: self.num_rows].copy_(rows)
            self.weight[self.num_rows :].zero_()
