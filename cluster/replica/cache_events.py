"""A replica's prefix-cache events for the router (llm-d's KV events; vLLM's ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared``).

The block manager records every change of its hash map while someone listens
(:meth:`cluster.engine.block_manager.BlockManager.listen`); :class:`CacheEventHub` hands the
recorded events to each listener after every engine step, and a listener's stream
(:meth:`CacheEventHub.stream`) coalesces what arrived within ``min_interval_s`` into one message:

``{"reset": bool, "stored": [hash, ...], "removed": [hash, ...], "block_size": int}``

The first message is the snapshot (``reset`` true, every cached hash in ``stored``); after that
each message is the net change since the previous one (a hash stored and removed again in between
appears once, in its final state). Applying messages in order keeps an exact copy of the set of
cached hashes (:class:`cluster.routing.CacheDigest`). Nothing is recorded while nobody listens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from shardserve.cluster.engine.block_manager import CLEARED, STORED, BlockManager

DEFAULT_MIN_INTERVAL_S = 0.02   # coalesce events for this long: at most ~50 messages per second per listener


def merge_events(events: list[tuple[int, int]]) -> dict:
    """The net change of ``events`` (in order) as ``{"reset", "stored", "removed"}``."""
    reset, last = False, {}
    for kind, digest in events:
        if kind == CLEARED:
            reset, last = True, {}
        else:
            last[digest] = kind
    return {"reset": reset, "stored": [d for d, kind in last.items() if kind == STORED],
            "removed": [d for d, kind in last.items() if kind != STORED]}


class CacheEventHub:
    """Fans a block manager's events out to listeners.

    Args:
        block_manager: the replica's block manager (touched on the engine loop only).
    """

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.listeners: list[asyncio.Queue] = []

    def flush(self) -> None:
        """Hand the events recorded since the last flush to every listener (after an engine step,
        a weight swap or a repair). Cheap when nobody listens."""
        if self.listeners:
            events = self.block_manager.take_events()
            if events:
                for queue in self.listeners:
                    queue.put_nowait(events)

    async def stream(self, min_interval_s: float = DEFAULT_MIN_INTERVAL_S) -> AsyncIterator[dict]:
        """The snapshot, then the net changes, until the consumer stops iterating."""
        queue: asyncio.Queue = asyncio.Queue()
        self.flush()   # earlier events belong to the other listeners' streams, not after this snapshot
        snapshot = self.block_manager.listen()
        self.listeners.append(queue)
        block_size = self.block_manager.block_size
        try:
            yield {"reset": True, "stored": snapshot, "removed": [], "block_size": block_size}
            while True:
                events = await queue.get()
                await asyncio.sleep(min_interval_s)
                while not queue.empty():
                    events = events + queue.get_nowait()
                yield dict(merge_events(events), block_size=block_size)
        finally:
            self.listeners.remove(queue)
            if not self.listeners:
                self.block_manager.events = None
