"""Recurrent-state slot pool of one rank (hybrid models: Qwen3-Next's gated-DeltaNet layers).

Beside the paged KV cache, every recurrent layer owns two tensors allocated by the runner's cache
allocator (so they live where the KV cache lives): a causal-conv window ``[num_slots, C, W - 1]``
and a matrix state ``[num_slots, Hv, K, V]`` float32. One slot holds one running sequence's state
in every layer; the coordinator's :class:`cluster.state_slots.StateSlots` assigns it (sent in
:class:`NewRequestData`) and frees it with the request's blocks, like a block id.

Invariants kept here, per step (vLLM's and SGLang's hybrid pools both had bugs on each):

- *Zeroed on reuse*: a slot is zeroed in every layer when a request is assigned to it, so a
  finished (or preempted) sequence's state never leaks into the next one.
- *Position check*: a slot's state has folded in exactly the tokens before the step's
  ``start_pos``; anything else is a bookkeeping bug and raises instead of computing garbage.
- *Speculative rollback* (ik_llama.cpp's "spec checkpoints for recurrent models"): a step that
  verifies drafts runs its sequences token by token and keeps the state after every token
  (matrix states from the recurrent kernel; conv windows as the window before the step plus the
  step's conv inputs). Acceptance is decided on rank 0 only, but every rank learns it from the
  request's next ``start_pos`` (the engine rolls ``num_computed_tokens`` back to the last accepted
  token), and restores the kept state of that position before running anything, so rejected
  drafts leave no trace. The sampler needs no checkpoint: a request's random streams are keyed
  by output index (``workers/sampler.py``), so a rejected draft consumes nothing a later token uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
    keep: bool                       # some sequence verifies drafts: record per-token states
    # filled by the layers when ``keep``: state index -> (conv windows before the step of the
    # recurrent group [B_r, C, W-1], conv inputs [T_r, C], matrix state after each token [T_r, Hv, K, V])
    snapshots: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass(slots=True)
class _Verify:
    """A verify step's kept states, until the request's next step says how much was accepted."""

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
            already allocated (``[num_slots, C, W - 1]`` and ``[num_slots, Hv, K, V]``) and gets
            ``state_index`` (its key in :attr:`StateMetadata.snapshots`).
    """

    def __init__(self, layers) -> None:
        self.layers = list(layers)
        for index, layer in enumerate(self.layers):
            layer.state_index = index
        conv, ssm = self.layers[0].kv_cache
        self.num_slots, self.device = conv.shape[0], conv.device
        self.seqs: dict[str, _SlotState] = {}
        self._owner: dict[int, str] = {}     # slot -> request id holding it here

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

    def _rollback(self, req_id: str, seq: _SlotState, start_pos: int) -> None:
        """Restore the state of position ``start_pos`` kept by the request's verify step."""
        verify, seq.verify = seq.verify, None
        accepted = start_pos - verify.start_pos        # tokens of the verify step that stay
        if not 1 <= accepted <= verify.num_tokens:
            raise RuntimeError(f"request {req_id!r}: resumes at {start_pos} after verifying positions "
                               f"{verify.start_pos}..{verify.start_pos + verify.num_tokens - 1}")
        if accepted == verify.num_tokens:
            return
        row = verify.token_offset + accepted - 1
        for layer in self.layers:
            conv_before, conv_inputs, ssm_after = verify.snapshots[layer.state_index]
            conv_state, ssm_state = layer.kv_cache
            width = conv_state.shape[-1]
            inputs = conv_inputs[verify.token_offset:verify.token_offset + accepted].transpose(0, 1)
            conv_state[seq.slot] = torch.cat((conv_before[verify.group_row], inputs), dim=-1)[:, -width:]
            ssm_state[seq.slot] = ssm_after[row]
        seq.num_tokens = start_pos

    def begin_step(self, plan: StepPlan) -> StateMetadata:
        """Apply the plan's request diff to the pool (forget finished requests, zero the slots of new
        ones, roll verified requests back to their accepted tokens) and lay out the step.

        Raises:
            ValueError: a new request without a valid slot.
            RuntimeError: a slot's state does not hold exactly the tokens before its step.
        """
        for req_id in plan.finished_req_ids:
            self._forget(req_id)
        for new in plan.new_requests:
            self._assign(new.req_id, new.state_slot)
        slots, lens, chunked, recurrent = [], [], [], []
        verifies: list[tuple[_SlotState, int]] = []
        for i, sched in enumerate(plan.scheduled):
            seq = self.seqs[sched.req_id]
            if seq.verify is not None:
                self._rollback(sched.req_id, seq, sched.start_pos)
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
