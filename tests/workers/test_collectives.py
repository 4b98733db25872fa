"""CPU collectives across real processes: the shared-memory group and gloo give the reference sums,
gathers (uneven sizes), reduce-scatters and all-to-alls (uneven row counts, data-parallel
attention's MoE exchange), bitwise equal on every rank; an aborted segment unblocks waiters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from procs import free_port
from shardserve.workers.comm_cpu import GlooGroup, SharedMemoryGroup, SharedMemorySegment
from shardserve.workers.distributed import TensorParallelGroup, collective_kind

WORLD = 3
SIZES = [3, 1, 2]  # uneven all-gather widths per rank
COUNTS = [[(2 * src + dst) % 3 for dst in range(WORLD)] for src in range(WORLD)]   # all-to-all rows src -> dst


def a2a_rows(src: int, dst: int) -> torch.Tensor:
    """The ``[COUNTS[src][dst], 2]`` rows rank ``src`` sends rank ``dst`` (values name both)."""
    return torch.tensor([[100.0 * src + dst, row] for row in range(COUNTS[src][dst])]).view(-1, 2)


def rank_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(5, 7, generator=gen), torch.randn(4, SIZES[rank], generator=gen)


def _run(rank: int, kind: str, info: dict, out: dict) -> None:
    torch.set_num_threads(1)
    if kind == "shm":
        group = SharedMemoryGroup(rank, WORLD, info["name"], info["max_floats"], timeout_s=60)
    else:
        group = GlooGroup(rank, WORLD, info["init_method"], timeout_s=60)
    try:
        reduce_in, gather_in = rank_inputs(rank)
        results = []
        for _ in range(5):  # several calls: both alternating slot sets get used
            results.append(group.all_reduce(reduce_in.clone()))
        scatter_in = torch.arange(WORLD * 4, dtype=torch.float32).view(WORLD, 4) * (rank + 1)
        send = torch.cat([a2a_rows(rank, dst) for dst in range(WORLD)])
        out[rank] = (torch.stack(results), group.all_gather(gather_in, SIZES), group.reduce_scatter(scatter_in),
                     group.all_to_all(send, COUNTS))
    finally:
        group.close()



@pytest.mark.parametrize("kind", ["shm", "gloo"])
def test_all_reduce_and_uneven_all_gather(kind):
    segment = SharedMemorySegment(WORLD, max_floats=64) if kind == "shm" else None
    info = {"name": segment.name, "max_floats": 64} if segment else {"init_method": f"tcp://127.0.0.1:{free_port()}"}
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        procs = [ctx.Process(target=_run, args=(r, kind, info, out)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        results = dict(out)
    if segment:
        segment.close()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    inputs = [rank_inputs(r) for r in range(WORLD)]
    expected_sum = sum(x for x, _ in inputs)
    expected_gather = torch.cat([g for _, g in inputs], dim=-1)
    for rank in range(WORLD):
        reduced, gathered, scattered, exchanged = results[rank]
        torch.testing.assert_close(reduced, expected_sum.expand(5, 5, 7), rtol=1e-6, atol=1e-6)
        assert torch.equal(reduced, results[0][0])  # bitwise identical on every rank
        assert torch.equal(gathered, expected_gather)
        # sum over ranks r of arange * (r + 1), this rank's row: arange * 6
        assert torch.equal(scattered, torch.arange(rank * 4, rank * 4 + 4, dtype=torch.float32) * 6)
        assert torch.equal(exchanged, torch.cat([a2a_rows(src, rank) for src in range(WORLD)]))


def _wait_alone(name: str, out: dict) -> None:
    group = SharedMemoryGroup(1, 2, name, 16, timeout_s=60)
    try:
        group.all_reduce(torch.ones(4))
        out["result"] = "returned"
    except RuntimeError as exc:
        out["result"] = str(exc)
    finally:
        group.close()


def test_abort_unblocks_a_rank_waiting_for_a_dead_peer_after_the_name_is_gone():
    segment = SharedMemorySegment(2, max_floats=16)
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        proc = ctx.Process(target=_wait_alone, args=(segment.name, out))
        proc.start()
        import time

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _flag(segment, 1) == 0:  # rank 1 entered its collective
            time.sleep(0.01)
        # Once every rank is attached the name goes (as WorkerGroup does): nothing can outlive the
        # processes in /dev/shm, and the mapping still works (the abort below reaches rank 1).
        segment.unlink()
        assert not (Path("/dev/shm") / segment.name).exists()
        segment.abort()
        proc.join(timeout=30)
        result = out.get("result")
    segment.close()
    assert proc.exitcode == 0 and "aborted" in result


def test_close_from_another_thread_waits_for_the_collective_reading_the_segment():
    """A rank leaves its group from a Ray thread while its step may still be inside a collective
    (the draft worker or a peer died mid-step). The segment is unmapped only once that collective
    has ended: before, it was unmapped under the step's views of the slots (SIGSEGV in all_reduce)."""
    import threading

    segment = SharedMemorySegment(2, max_floats=16)
    group = SharedMemoryGroup(0, 2, segment.name, max_floats=16)
    errors = []

    def step():   # rank 0's all-reduce; rank 1 died and never arrives
        try:
            group.all_reduce(torch.ones(4))
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=step)
    thread.start()
    try:
        while _flag(segment, 0) == 0:   # rank 0 has published and waits for rank 1
            thread.join(0.001)
        group.close(timeout_s=0.2)      # the collective still runs: the segment stays mapped
        assert group._shm is not None and thread.is_alive()
        segment.abort()                 # what the coordinator does before the ranks leave
        group.close()
        thread.join(30)
        assert not thread.is_alive() and errors and "aborted" in errors[0] and group._shm is None
        with pytest.raises(RuntimeError, match="closed group"):
            group.all_reduce(torch.ones(4))
    finally:
        segment.abort()
        thread.join(30)
        group.close()
        segment.close()


def _flag(segment: SharedMemorySegment, rank: int) -> int:
    import numpy as np

    flags = np.ndarray((3 * 8,), np.int64, buffer=segment.shm.buf)
    value = int(flags[rank * 8])
    del flags
    return value


def test_single_rank_group_is_identity_and_backend_choice():
    group = TensorParallelGroup()
    x = torch.randn(2, 3)
    assert group.all_reduce(x) is x and group.all_gather(x, [3]) is x
    assert collective_kind("cpu", same_node=True) == "shm"
    assert collective_kind("cpu", same_node=False) == "gloo"
    assert collective_kind("cuda:0", same_node=True) == "nccl"
    with pytest.raises(ValueError, match="needs every rank on one node"):
        collective_kind("cpu", same_node=False, requested="shm")


def test_nccl_backend_imports_without_cupy():
    import shardserve.workers.comm_nccl as nccl  # cupy is imported lazily, on first use on a GPU

    assert issubclass(nccl.CupyNcclGroup, TensorParallelGroup)
