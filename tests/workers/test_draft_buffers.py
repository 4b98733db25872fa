"""The buffers rank 0 and the MTP draft worker share (workers/draft_buffers.py): on CPU another
process maps the same memory from the handle (exchanged once), sees what the owner wrote and writes
back; once the name is released nothing is left in /dev/shm."""

from __future__ import annotations

import multiprocessing as mp
import os

import torch

from shardserve.workers.draft_buffers import BufferLayout, DraftBuffers


def _rank0(handle: dict, queue) -> None:
    buffers = DraftBuffers.attach(handle)
    seen = buffers.probs[1, 2].clone()                       # what the draft wrote
    buffers.hidden[:3].copy_(torch.arange(3 * buffers.layout.hidden_size).view(3, -1).to(buffers.hidden.dtype))
    queue.put(seen.tolist())


def test_another_process_maps_the_same_buffers():
    layout = BufferLayout(max_tokens=8, hidden_size=5, hidden_dtype="bfloat16", max_rows=3, max_drafts=3, vocab=7)
    owner = DraftBuffers.allocate(layout, "cpu")
    assert owner.hidden.shape == (8, 5) and owner.hidden.dtype == torch.bfloat16
    assert owner.probs.shape == (3, 3, 7) and owner.probs.dtype == torch.float32
    assert owner.hidden.untyped_storage().data_ptr() == owner.probs.untyped_storage().data_ptr()   # one mapping
    owner.probs[1, 2] = torch.linspace(0, 1, 7)
    handle = owner.handle()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_rank0, args=(handle, queue))
    child.start()
    try:
        seen = queue.get(timeout=120)
    finally:
        child.join(timeout=60)
    assert child.exitcode == 0
    assert seen == torch.linspace(0, 1, 7).tolist()
    assert torch.equal(owner.hidden[:3], torch.arange(15).view(3, 5).to(torch.bfloat16))
    path = handle["path"]
    assert os.path.exists(path)
    owner.release_name()
    owner.release_name()                                   # idempotent
    assert not os.path.exists(path)
    owner.probs[0, 0, 0] = 3.0                             # still mapped after the name is gone
    assert owner.probs[0, 0, 0] == 3.0
