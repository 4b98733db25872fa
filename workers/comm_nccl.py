"""NCCL through CuPy for GPU ranks.

Rendezvous: rank 0 makes an NCCL unique id (:func:`nccl_unique_id`), the coordinator passes it
to every rank through Ray, and each rank builds its communicator bound to its own GPU. One
communicator per tensor-parallel group; ranks on different nodes work the same way (NCCL picks the
network transport; ``NCCL_SOCKET_IFNAME`` and friends apply as usual).

Collectives are enqueued on torch's *current* stream and never synchronize with the host, so they
order correctly with the surrounding kernels and are recorded into a CUDA graph when the forward is
being captured (NCCL >= 2.9 supports stream capture). ``collective_s`` then counts launch time only.
"""

from __future__ import annotations

import math

import torch

from shardserve.workers.distributed import TensorParallelGroup

# NCCL's ncclDataType_t values (nccl.h); CuPy releases do not all export NCCL_BFLOAT16 (= 9, NCCL >= 2.10).
_NCCL_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
                torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
_NCCL_SUM = 0


def nccl_unique_id() -> tuple:
    """A fresh NCCL unique id (call on one rank; send the tuple to all ranks)."""
    from cupy.cuda import nccl

    return nccl.get_unique_id()


def nccl_dtype(dtype: torch.dtype) -> int:
    """NCCL's data type code of ``dtype``.

    Raises:
        TypeError: NCCL has no such type (e.g. float8).
    """
    if dtype not in _NCCL_DTYPES:
        raise TypeError(f"NCCL collectives do not support {dtype}")
    return _NCCL_DTYPES[dtype]


class CupyNcclGroup(TensorParallelGroup):
    """TP group over one NCCL communicator on torch's current CUDA stream.

    Args:
        tp_rank, tp_size: this rank.
        unique_id: from :func:`nccl_unique_id` on one rank (the same tuple on every rank).
        device: this rank's GPU (default: torch's current device); the communicator is bound to it.

    Every rank must call the constructor concurrently (NCCL's init is collective).
    """

    def __init__(self, tp_rank: int, tp_size: int, unique_id: tuple, device: torch.device | int | None = None) -> None:
        super().__init__(tp_rank, tp_size)
        import cupy
        from cupy.cuda import nccl

        if device is None:
            index = torch.cuda.current_device()
        else:
            index = device if isinstance(device, int) else (torch.device(device).index or 0)
        self.device = torch.device("cuda", index)
        with cupy.cuda.Device(index):
            self.comm = nccl.NcclCommunicator(tp_size, unique_id, tp_rank)

    def _stream(self, tensor: torch.Tensor) -> int:
        assert tensor.device == self.device, f"{tensor.device} tensor on the communicator of {self.device}"
        return torch.cuda.current_stream(self.device).cuda_stream

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over the group (on a contiguous copy when ``tensor`` is not contiguous)."""
        tensor = tensor.contiguous()
        self.comm.allReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_dtype(tensor.dtype), _NCCL_SUM,
                            self._stream(tensor))
        return tensor

    def _all_gather_equal(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        tensor = tensor.contiguous()
        out = torch.empty((self.tp_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        self.comm.allGather(tensor.data_ptr(), out.data_ptr(), tensor.numel(), nccl_dtype(tensor.dtype),
                            self._stream(tensor))
        return list(out.unbind(0))

    def _reduce_scatter_equal(self, tensor: torch.Tensor) -> torch.Tensor:
        """``ncclReduceScatter`` (sum) of ``tensor [tp_size, ...]``; this rank's part ``[...]``."""
        out = torch.empty(tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
        self.comm.reduceScatter(tensor.data_ptr(), out.data_ptr(), out.numel(), nccl_dtype(tensor.dtype), _NCCL_SUM,
                                self._stream(tensor))
        return out

    def _all_to_all(self, send: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """Grouped ``ncclSend`` / ``ncclRecv`` with every peer (NCCL >= 2.7), on the current stream."""
        from cupy.cuda import nccl

        me, width = self.tp_rank, math.prod(send.shape[1:])
        recv = send.new_empty(sum(row[me] for row in counts), *send.shape[1:])
        dtype, stream = nccl_dtype(send.dtype), self._stream(send)
        send_at, recv_at = 0, 0
        nccl.groupStart()
        for peer in range(self.tp_size):
            out_rows, in_rows = counts[me][peer], counts[peer][me]
            if out_rows:
                self.comm.send(send[send_at:].data_ptr(), out_rows * width, dtype, peer, stream)
            if in_rows:
                self.comm.recv(recv[recv_at:].data_ptr(), in_rows * width, dtype, peer, stream)
            send_at, recv_at = send_at + out_rows, recv_at + in_rows
        nccl.groupEnd()
        return recv

    def close(self) -> None:
        comm, self.comm = getattr(self, "comm", None), None
        if comm is not None:
            comm.destroy()
