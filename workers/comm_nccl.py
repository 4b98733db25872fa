"""NCCL through CuPy for GPU ranks (rendezvous: rank 0's NCCL unique id, passed through Ray)."""

from __future__ import annotations

import torch

from shardserve.workers.distributed import TensorParallelGroup


def nccl_unique_id() -> tuple:
    """A fresh NCCL unique id (call on one rank; send the tuple to all ranks)."""
    from cupy.cuda import nccl

    return nccl.get_unique_id()


def _nccl_dtype(dtype: torch.dtype) -> int:
    from cupy.cuda import nccl

    table = {torch.float32: nccl.NCCL_FLOAT32, torch.float16: nccl.NCCL_FLOAT16,
             torch.bfloat16: nccl.NCCL_BFLOAT16, torch.int32: nccl.NCCL_INT32, torch.int64: nccl.NCCL_INT64}
    if dtype not in table:
        raise TypeError(f"NCCL collectives do not support {dtype}")
    return table[dtype]


class CupyNcclGroup(TensorParallelGroup):
    """TP group over one NCCL communicator on the current CUDA stream.

    Args:
        tp_rank, tp_size: this rank; the process must already have selected its GPU.
        unique_id: from :func:`nccl_unique_id` on one rank.
    """

    def __init__(self, tp_rank: int, tp_size: int, unique_id: tuple) -> None:
        super().__init__(tp_rank, tp_size)
        from cupy.cuda import nccl

        self._nccl = nccl
        self.comm = nccl.NcclCommunicator(tp_size, unique_id, tp_rank)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        stream = torch.cuda.current_stream().cuda_stream
        self.comm.allReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), _nccl_dtype(tensor.dtype),
                            self._nccl.NCCL_SUM, stream)
        return tensor

    def _all_gather_equal(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = torch.empty((self.tp_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        stream = torch.cuda.current_stream().cuda_stream
        self.comm.allGather(tensor.data_ptr(), out.data_ptr(), tensor.numel(), _nccl_dtype(tensor.dtype), stream)
        return list(out.unbind(0))
