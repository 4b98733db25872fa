"""One step's input tensors: laid out on the host from the plan, moved to the device in one copy.

The runner turns a :class:`StepPlan` into a :class:`HostBatch` (plain Python lists: token ids,
positions, slot mapping, ``cu_seqlens``, sequence lengths, block tables, the rows that need
logits). :class:`DeviceStager` then packs every integer of the step into one int64 tensor and
copies it to the runner's device at once (through a pinned staging buffer on CUDA), so a step
costs one host-to-device transfer whatever its size; the tensors the model sees are views of it.
On CPU the packed tensor is used as is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shardserve.workers.forward_context import AttentionMetadata
from shardserve.workers.messages import PLACEHOLDER_TOKEN


@dataclass(slots=True)
class HostBatch:
    """A step's inputs on the host. ``T`` tokens, ``B`` sequences, ``W`` block-table width."""

    input_ids: list[int]          # [T]
    positions: list[int]          # [T]
    slot_mapping: list[int]       # [T] flat cache slot of each token
    query_start_loc: list[int]    # [B + 1] cu_seqlens of the packed queries
    seq_lens: list[int]           # [B] context length after this step
    block_tables: list[list[int]]  # [B][W] padded with block 0
    logits_rows: list[int]        # rows of the packed tokens whose logits are computed
    max_query_len: int
    max_seq_len: int
    placeholder_rows: list[int] = field(default_factory=list)  # rows whose token rank 0 shares (async
                                                                # scheduling); input_ids holds 0 there
                                                                # except on rank 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence computes one token and samples it (the step decode graphs replay)."""
        return self.max_query_len == 1 and len(self.logits_rows) == self.num_seqs


def build_host_batch(plan, block_ids: dict[str, list[int]], block_size: int) -> HostBatch:
    """Lay out ``plan``'s scheduled work (``block_ids``: each request's block table).

    The last row of every sampling request needs logits, plus one more per draft token it verifies.
    A token still :data:`PLACEHOLDER_TOKEN` (a rank other than 0 under async scheduling) is laid
    out as 0 and its row listed in ``placeholder_rows``.
    """
    input_ids, positions, slots, query_start, seq_lens, logits_rows, tables = [], [], [], [0], [], [], []
    placeholder_rows = []
    for sched in plan.scheduled:
        num = len(sched.token_ids)
        table = block_ids[sched.req_id]
        span = range(sched.start_pos, sched.start_pos + num)
        if sched.token_ids[-1] == PLACEHOLDER_TOKEN:
            placeholder_rows.append(query_start[-1] + num - 1)
            input_ids.extend(sched.token_ids[:-1])
            input_ids.append(0)
        else:
            input_ids.extend(sched.token_ids)
        positions.extend(span)
        slots.extend(table[pos // block_size] * block_size + pos % block_size for pos in span)
        query_start.append(query_start[-1] + num)
        seq_lens.append(sched.start_pos + num)
        tables.append(table)
        if sched.sample:
            logits_rows.extend(range(query_start[-1] - 1 - sched.num_spec_tokens, query_start[-1]))
    width = max(len(t) for t in tables)
    return HostBatch(input_ids, positions, slots, query_start, seq_lens,
                     [t + [0] * (width - len(t)) for t in tables], logits_rows,
                     max(len(s.token_ids) for s in plan.scheduled), max(seq_lens), placeholder_rows)


class DeviceStager:
    """Copies a step's integers to ``device`` in one transfer.

    On CUDA the data goes through a pinned host buffer and an asynchronous copy; before the buffer
    is reused, the previous copy is waited for (an event), so a rank that never synchronizes with
    the host (ranks other than 0 return nothing) cannot overwrite data still in flight.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._staging: torch.Tensor | None = None
        self._copied = None

    def upload(self, values: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """``values`` as an int64 tensor on the device (written into ``out[:len(values)]`` when given)."""
        host = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return host if out is None else out[:host.numel()].copy_(host)
        count = host.numel()
        if self._copied is not None:
            self._copied.synchronize()
        if self._staging is None or self._staging.numel() < count:
            with torch.inference_mode(False):   # a normal tensor: written in and outside inference mode
                self._staging = torch.empty(max(count, 1 << 16), dtype=torch.int64, pin_memory=True)
        staging = self._staging[:count]
        staging.copy_(host)
        dst = torch.empty(count, dtype=torch.int64, device=self.device) if out is None else out[:count]
        dst.copy_(staging, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()
        return dst


def device_batch(host: HostBatch, stager: DeviceStager,
                 share_tokens: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                 ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
    """The model's inputs on the stager's device: ``(input_ids [T], metadata, logits_rows [R])``,
    all views of one uploaded tensor (block tables as int32). ``share_tokens(input_ids, rows)``, when
    given, is called with the device rows of ``host.placeholder_rows`` (async scheduling at TP > 1)."""
    num_tokens, num_seqs, width = len(host.input_ids), host.num_seqs, len(host.block_tables[0])
    flat = (host.input_ids + host.positions + host.slot_mapping + host.query_start_loc + host.seq_lens
            + host.logits_rows + [block for table in host.block_tables for block in table] + host.placeholder_rows)
    packed = stager.upload(flat)
    sizes = [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, len(host.logits_rows), num_seqs * width,
             len(host.placeholder_rows)]
    input_ids, positions, slot_mapping, query_start_loc, seq_lens, logits_rows, tables, holes = packed.split(sizes)
    if share_tokens is not None and host.placeholder_rows:
        share_tokens(input_ids, holes)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, positions=positions, query_start_loc=query_start_loc, seq_lens=seq_lens,
        block_tables=tables.view(num_seqs, width).to(torch.int32),
        max_query_len=host.max_query_len, max_seq_len=host.max_seq_len,
        query_start_host=host.query_start_loc, seq_lens_host=host.seq_lens)
    return input_ids, meta, logits_rows
