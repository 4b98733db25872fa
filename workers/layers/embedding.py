"""Vocab-parallel token embedding and LM head (Megatron-LM; DeepSeek ``ParallelEmbedding``).

Rank r holds vocab rows ``[vocab_start, vocab_start + vocab_size_local)``. The embedding zeroes
lookups of ids outside its range and all-reduces; the head computes its slice of the logits and
all-gathers them so rank 0 can sample over the whole vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.workers.checkpoint import LazyTensor
from shardserve.workers.distributed import get_tp_group
from shardserve.workers.layers.linear import _check_shape


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks.

    Shapes: ``input_ids [T] int64 -> [T, hidden_size]``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, vocab_start: int, vocab_size_local: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.vocab_start, self.vocab_size_local = vocab_start, vocab_size_local
        self.weight = nn.Parameter(torch.empty(vocab_size_local, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, tensor: LazyTensor, shard_id: int = 0) -> None:
        """Copy this rank's vocab rows."""
        _check_shape(tensor, 0, self.vocab_size)
        _check_shape(tensor, 1, self.hidden_size)
        param.data.copy_(tensor[self.vocab_start:self.vocab_start + self.vocab_size_local])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        group = get_tp_group()
        if group.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_size_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0.0)
        return group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to vocab logits, vocab split across ranks, gathered on every rank.

    ``sizes`` is every rank's ``vocab_size_local`` (uneven splits), needed for the gather.
    Shapes: ``hidden [N, hidden_size] -> logits [N, vocab_size]`` float32.
    """

    def __init__(self, vocab_size: int, hidden_size: int, vocab_start: int, vocab_size_local: int,
                 sizes: list[int], dtype: torch.dtype = torch.float32) -> None:
        super().__init__(vocab_size, hidden_size, vocab_start, vocab_size_local, dtype)
        self.sizes = sizes

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight).float()
        group = get_tp_group()
        return logits if group.tp_size == 1 else group.all_gather(logits, self.sizes)
