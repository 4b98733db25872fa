"""Recurrent-state slots of hybrid models (Qwen3-Next), handed out beside KV blocks.

A gated-DeltaNet layer keeps one fixed-size state per running sequence instead of a per-token
cache, so each shard worker holds a pool of state slots next to its paged KV cache
(``workers/state_cache.py``). This manager is the pool's free list on the coordinator: the
scheduler takes a slot when it admits a request (all or nothing with its blocks) and gives it
back whenever it frees the request's blocks (finish, abort, preemption). The slot id travels to
the workers once, in ``NewRequestData.state_slot``; a worker zeroes the slot when it sees a new
request on it, so no state survives its sequence (vLLM's and SGLang's Mamba pools both once let a
freed slot's state leak into the next request).

Lowest free slot first: the same few slots are reused (warm in cache), and tests can predict them.
"""

from __future__ import annotations

import heapq

from shardserve.cluster.engine.request import Request


class StateSlots:
    """Free list of ``num_slots`` recurrent-state slots.

    Args:
        num_slots: slots in every worker's pool (the runner's ``num_state_slots``).
    """

    def __init__(self, num_slots: int) -> None:
        assert num_slots >= 1, f"num_slots={num_slots}"
        self.num_slots = num_slots
        self._free = list(range(num_slots))       # a heap
        self._owner: dict[int, str] = {}          # slot -> request id holding it

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, request: Request) -> bool:
        """Give ``request`` a slot (no-op when it holds one).

        Returns:
            False (changing nothing) when every slot is taken.
        """
        if request.state_slot is not None:
            return True
        if not self._free:
            return False
        request.state_slot = heapq.heappop(self._free)
        self._owner[request.state_slot] = request.request_id
        return True

    def free(self, request: Request) -> None:
        """Return ``request``'s slot, if it holds one (idempotent)."""
        slot, request.state_slot = request.state_slot, None
        if slot is not None:
            owner = self._owner.get(slot)
            assert owner == request.request_id, f"state slot {slot} freed twice (by {request.request_id!r}, held by {owner!r})"
            del self._owner[slot]
            heapq.heappush(self._free, slot)
