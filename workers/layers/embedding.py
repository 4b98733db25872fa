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
from shardserve.workers.compilation import tp_all_reduce
from shardserve.workers.distributed import get_tp_group
from shardserve.workers.layers.linear import _check_shape


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks.

    Shapes: ``input_ids [T] int64 -> [T, hidden_size]``. With a packed weight (int8, one scale
    per vocab row: a Q8_0 GGUF embedding or ``--quantization``) rows are dequantized on lookup.
    """

    packable = True
    is_embedding = True

    def __init__(self, vocab_size: int, hidden_size: int, vocab_start: int, vocab_size_local: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.vocab_start, self.vocab_size_local = vocab_start, vocab_size_local
        self.weight = nn.Parameter(torch.empty(vocab_size_local, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.staging = None
        self.packed = None

    def weight_loader(self, param: nn.Parameter, tensor: LazyTensor, shard_id: int = 0) -> None:
        """Copy this rank's vocab rows."""
        _check_shape(tensor, 0, self.vocab_size)
        _check_shape(tensor, 1, self.hidden_size)
        start, size = self.vocab_start, self.vocab_size_local
        if self.staging is not None and self.staging.take(shard_id, tensor, lambda q: q.rows(start, size)):
            return
        param.data.copy_(tensor[start:start + size])

    def dense_slot(self, shard_id: int) -> torch.Tensor:
        return self.weight.data

    def checkpoint_shape(self, shard_id: int) -> tuple[int, int]:
        """Full shape of the checkpoint tensor (the whole vocabulary)."""
        return self.vocab_size, self.hidden_size

    def set_packed(self, packed) -> None:
        """Use ``packed`` instead of ``weight``; a head tied to this weight picks it up too."""
        if self.weight is not None:
            self.weight.packed_as = packed
        self.packed = packed
        self.weight = None

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.packed is None else self.packed.lookup(ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        group = get_tp_group()
        if group.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_size_local)
        out = self._lookup(local.masked_fill(outside, 0))
        out = out.masked_fill(outside[:, None], 0.0)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to vocab logits, vocab split across ranks, gathered on every rank.

    ``sizes`` is every rank's ``vocab_size_local`` (uneven splits), needed for the gather.
    Shapes: ``hidden [N, hidden_size] -> logits [N, vocab_size]`` float32.
    """

    def __init__(self, vocab_size: int, hidden_size: int, vocab_start: int, vocab_size_local: int,
                 sizes: list[int], dtype: torch.dtype = torch.float32) -> None:
        super().__init__(vocab_size, hidden_size, vocab_start, vocab_size_local, dtype)
        self.sizes = sizes

    is_embedding = True   # the same int8-per-vocab-row form as the embedding it may be tied to

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = (F.linear(hidden, self.weight) if self.packed is None else self.packed.matmul(hidden)).float()
        group = get_tp_group()
        return logits if group.tp_size == 1 else group.all_gather(logits, self.sizes)
