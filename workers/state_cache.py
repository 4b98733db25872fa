"""Recurrent-state slot pool of one rank (hybrid models: Qwen3-Next's gated-DeltaNet layers).

Beside the paged KV cache, every recurrent layer owns two tensors allocated by the runner's cache
allocator (so they live where the KV cache lives): a causal-conv window ``[num_slots, C, W - 1]``
and a matrix state ``[num_slots, Hv, K, V]`` float32. One slot holds one running sequence's state
in every layer; the coordinator's :class:`cluster.engine.state_slots.StateSlots` assigns it (sent in
:class:`NewRequestData`) and frees it with the request's blocks, like a block id.

Invariants kept here, per step (vLLM's and SGLang's hybrid pools both had bugs on each):

- *Zeroed on reuse*: a slot is zeroed in every layer when a request is assigned to it, so a
  finished (or preempted) sequence's state never leaks into the next one.
- *Position check*: a slot's state has folded in exactly the tokens before the step's
  ``start_pos``; anything else is a bookkeeping bug and raises instead of computing garbage.
- *Speculative rollback* (ik_llama.cpp's "spec checkpoints for recurrent models"): a step that
  verifies drafts runs its sequences token by token and checkpoints, per layer, their conv windows
  and matrix states from before the step plus the step's conv and delta-rule inputs (one state per
  sequence, not one per draft position). Acceptance is decided on rank 0 only, but every rank
  learns it from the request's next ``start_pos`` (the engine rolls ``num_computed_tokens`` back to
  the last accepted token): before anything runs, the slot is reset to the checkpoint and the
  accepted tokens are folded in again by the same recurrent kernel (and the conv window rebuilt
  from the kept inputs), which reproduces the state after the last accepted token, so rejected
  drafts leave no trace. The sampler needs no checkpoint: a request's random streams are keyed by
  output index (``workers/sampler.py``), so a rejected draft consumes nothing a later token uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardserve.kernels import gated_delta_recurrent
from shardserve.workers.messages import StepPlan


@dataclass(slots=True)
class SeqGroup:
    """A subset of the step's sequences run by one gated-delta evaluation."""

    token_idx: torch.Tensor | None   # [T_g] int64 rows of the packed tokens; None = all, in order
    cu_seqlens: torch.Tensor         # [B_g + 1] int32
    slots: torch.Tensor              # [B_g] int32


@dataclass(slots=True)
class StateMetadata:
    """Where this step's sequences keep their recurrent states (``AttentionMetadata.state``).

    Sequences with a prefill chunk run the chunked rule; decodes and speculative verifies the
    recurrent one (each group None when empty).
    """

    cu_seqlens: torch.Tensor         # [B + 1] int32, all sequences (the conv runs over every token)
    slots: torch.Tensor              # [B] int32
    chunked: SeqGroup | None
    recurrent: SeqGroup | None
    keep: bool                       # some sequence verifies drafts: the layers checkpoint the recurrent group
    # filled by the layers when ``keep``: state index -> (conv windows [B_r, C, W-1] and matrix states
    # [B_r, Hv, K, V] of the recurrent group before the step, its conv inputs [T_r, C], its delta-rule
    # inputs (q, k, v, g, beta) per token)
    snapshots: dict[int, tuple] = field(default_factory=dict)


@dataclass(slots=True)
class _Verify:
    """A verify step's checkpoint, until the request's next step says how much was accepted."""

    start_pos: int                   # position of the step's first token
    num_tokens: int                  # tokens it computed (last real token + drafts)
    group_row: int                   # the request's row in the recurrent group
    token_offset: int                # its first token's row in the recurrent group
    snapshots: dict                  # StateMetadata.snapshots of that step (shared by its requests)


@dataclass(slots=True)
class _SlotState:
    slot: int
    num_tokens: int = 0              # tokens folded into the slot's state
    verify: _Verify | None = None


class StateCache:
    """The recurrent layers' slot pool on this rank and the per-request bookkeeping around it.

    Args:
        layers: recurrent modules in model order; each has ``kv_cache = (conv_state, ssm_state)``
            already allocated (``[S, C, W - 1]`` and ``[S, Hv, K, V]``) and gets
            ``state_index`` (its key in :attr:`StateMetadata.snapshots`).
        num_slots: slots requests may hold (default ``S``; with decode graphs the pool has one more,
            the graphs' scratch slot for padded rows, which no request gets).
    """

    def __init__(self, layers, num_slots: int | None = None) -> None:
        self.layers = list(layers)
        for index, layer in enumerate(self.layers):
            layer.state_index = index
        conv, ssm = self.layers[0].kv_cache
        self.num_slots, self.device = num_slots or conv.shape[0], conv.device
        assert self.num_slots <= conv.shape[0], f"{self.num_slots} slots in a pool of {conv.shape[0]}"
        self.seqs: dict[str, _SlotState] = {}
        self._owner: dict[int, str] = {}     # slot -> request id holding it here

    def reset(self) -> None:
        """Forget every sequence and zero every slot in place (a peer rank was replaced, or the
        weights changed): the pool is as freshly allocated, at the same addresses."""
        for layer in self.layers:
            for tensor in layer.kv_cache:
                tensor.zero_()
        self.seqs.clear()
        self._owner.clear()

    def _forget(self, req_id: str) -> None:
        seq = self.seqs.pop(req_id, None)
        if seq is not None and self._owner.get(seq.slot) == req_id:
            del self._owner[seq.slot]

    def _assign(self, req_id: str, slot: int | None) -> None:
        if slot is None or not 0 <= slot < self.num_slots:
            raise ValueError(f"request {req_id!r}: state slot {slot} outside the pool of {self.num_slots}")
        stale = self._owner.get(slot)
        if stale is not None:   # its finish notice never reached us (e.g. an unexecuted empty plan)
            self._forget(stale)
        for layer in self.layers:
            for tensor in layer.kv_cache:
                tensor[slot].zero_()
        self.seqs[req_id] = _SlotState(slot)
        self._owner[slot] = req_id

    def _accepted(self, req_id: str, seq: _SlotState, start_pos: int) -> int:
        """Tokens of the request's verify step that stay (it resumes at ``start_pos``)."""
        verify, seq.verify = seq.verify, None
        accepted = start_pos - verify.start_pos
        if not 1 <= accepted <= verify.num_tokens:
            raise RuntimeError(f"request {req_id!r}: resumes at {start_pos} after verifying positions "
                               f"{verify.start_pos}..{verify.start_pos + verify.num_tokens - 1}")
        seq.num_tokens = start_pos
        return accepted

    def _roll_back(self, verify_snapshots: dict, rollbacks: list[tuple[int, _Verify, int]]) -> None:
        """Reset slots to one verify step's checkpoint and fold the accepted tokens in again, every
        layer at once for all ``(slot, verify, accepted)`` of that step."""
        device = self.device
        slots = torch.tensor([slot for slot, _, _ in rollbacks], dtype=torch.int32, device=device)
        rows = torch.tensor([v.group_row for _, v, _ in rollbacks], device=device)
        offsets = torch.tensor([v.token_offset for _, v, _ in rollbacks], device=device)
        accepted = torch.tensor([n for _, _, n in rollbacks], device=device)
        tokens = torch.cat([torch.arange(v.token_offset, v.token_offset + n) for _, v, n in rollbacks]).to(device)
        cu_seqlens = torch.tensor([0, *torch.tensor([n for _, _, n in rollbacks]).cumsum(0).tolist()],
                                  dtype=torch.int32, device=device)
        for layer in self.layers:
            conv_before, ssm_before, conv_inputs, delta_inputs = verify_snapshots[layer.state_index]
            conv_state, ssm_state = layer.kv_cache
            width = conv_state.shape[-1]
            # window entry j after n accepted tokens = entry n + j of [window before, the step's inputs]
            ext = accepted[:, None] + torch.arange(width, device=device)[None, :]                # [R, W-1]
            before = conv_before[rows[:, None], :, ext.clamp(max=width - 1)]                     # [R, W-1, C]
            inputs = conv_inputs[(offsets[:, None] + ext - width).clamp(min=0)]                  # [R, W-1, C]
            conv_state[slots.long()] = torch.where((ext < width)[..., None], before, inputs).transpose(1, 2)
            ssm_state[slots.long()] = ssm_before[rows]
            gated_delta_recurrent(*(x[tokens] for x in delta_inputs), cu_seqlens, ssm_state, slots)

    def begin_step(self, plan: StepPlan) -> StateMetadata:
        """Apply the plan's request diff to the pool (forget finished requests, zero the slots of new
        ones, roll verified requests back to their accepted tokens) and lay out the step.

        Raises:
            ValueError: a new request without a valid slot.
            RuntimeError: a slot's state does not hold exactly the tokens before its step.
        """
        slots, lens, chunked, recurrent, verifies = self._advance(plan)
        starts = [0]
        for length in lens:
            starts.append(starts[-1] + length)
        meta = StateMetadata(self._tensor(starts), self._tensor(slots), self._group(chunked, starts, slots),
                             self._group(recurrent, starts, slots), keep=bool(verifies))
        offsets = [0]
        for i in recurrent:
            offsets.append(offsets[-1] + lens[i])
        for seq, row in verifies:
            seq.verify = _Verify(seq.num_tokens - lens[recurrent[row]], lens[recurrent[row]], row, offsets[row],
                                 meta.snapshots)
        return meta

    def begin_decode(self, plan: StepPlan) -> list[int]:
        """:meth:`begin_step` for a step in which every sequence decodes one token and none verifies
        drafts (the step decode graphs replay): the bookkeeping only; returns each sequence's slot
        (the graph reads them from its fixed buffer).

        Raises:
            as :meth:`begin_step`.
        """
        slots, lens, chunked, _, verifies = self._advance(plan)
        assert not chunked and not verifies and all(n == 1 for n in lens), \
            f"not a plain decode step: lens {lens}, {len(verifies)} verifying"
        return slots

    def _advance(self, plan: StepPlan) -> tuple[list[int], list[int], list[int], list[int], list]:
        """The bookkeeping of a step: ``(slots, token counts, chunked rows, recurrent rows,
        [(seq, row in the recurrent group)] of verify steps)``."""
        for req_id in plan.finished_req_ids:
            self._forget(req_id)
        for new in plan.new_requests:
            self._assign(new.req_id, new.state_slot)
        rollbacks: dict[int, tuple[dict, list]] = {}   # verify step -> (its snapshots, [(slot, verify, accepted)])
        for sched in plan.scheduled:
            seq = self.seqs[sched.req_id]
            if seq.verify is not None:
                verify = seq.verify
                accepted = self._accepted(sched.req_id, seq, sched.start_pos)
                if accepted < verify.num_tokens:
                    rollbacks.setdefault(id(verify.snapshots), (verify.snapshots, []))[1].append(
                        (seq.slot, verify, accepted))
        for snapshots, members in rollbacks.values():
            self._roll_back(snapshots, members)
        slots, lens, chunked, recurrent = [], [], [], []
        verifies: list[tuple[_SlotState, int]] = []
        for i, sched in enumerate(plan.scheduled):
            seq = self.seqs[sched.req_id]
            if seq.num_tokens != sched.start_pos:
                raise RuntimeError(f"request {sched.req_id!r}: state slot {seq.slot} holds {seq.num_tokens} tokens "
                                   f"but the step starts at position {sched.start_pos}")
            seq.num_tokens += len(sched.token_ids)
            slots.append(seq.slot)
            lens.append(len(sched.token_ids))
            if len(sched.token_ids) > 1 and not sched.num_spec_tokens:
                chunked.append(i)
            else:
                if sched.num_spec_tokens:
                    verifies.append((seq, len(recurrent)))
                recurrent.append(i)
        return slots, lens, chunked, recurrent, verifies

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def _group(self, members: list[int], starts: list[int], slots: list[int]) -> SeqGroup | None:
        if not members:
            return None
        cu = [0]
        for i in members:
            cu.append(cu[-1] + starts[i + 1] - starts[i])
        token_idx = None
        if len(members) < len(slots):
            token_idx = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in members]).to(self.device)
        return SeqGroup(token_idx, self._tensor(cu), self._tensor([slots[i] for i in members]))
