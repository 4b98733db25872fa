"""What a weight reload may touch, and when: the allowed model root, and one reload at a time in
the whole Ray cluster.

- Paths: a reload reads only under ``--allowed-model-root`` (default: the served model's folder).
  A path is checked lexically first and then with every symlink resolved, the checkpoint folder's
  files included, so a link cannot lead out of the root. A path outside the root gets the same
  answer whether or not it exists (no existence oracle); the checkpoint index's file names are
  contained in their folder by :class:`workers.checkpoint.SafetensorsCheckpoint`.
- Lock: a reload holds a named Ray actor's lock (namespace ``shardserve``, one per served model)
  while it drains and swaps, so direct gRPC callers cannot take every replica out of service at
  once; a second reload is refused (FAILED_PRECONDITION / HTTP 409), not queued. A holder that
  dies frees the lock after ``ttl_s``.
- Drain: ``drain`` waits at most ``--reload-drain-timeout`` for running requests; then the reload
  is refused and admission resumes (:meth:`cluster.replica.coordinator.Coordinator.reload_weights`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import time
import uuid
from pathlib import Path

from shardserve.cluster.frontend.security import contained_path
from shardserve.cluster.replica.weight_swap import InvalidCheckpoint
from shardserve.workers.model_source import ModelFiles

LOCK_NAMESPACE = "shardserve"
SWAP_ALLOWANCE_S = 600.0    # lock lifetime past the drain timeout, should its holder die mid-swap


class ReloadRefused(RuntimeError):
    """The reload did not start or was called off before anything changed: another one holds the
    cluster's lock, or running requests outlasted the drain timeout."""


def allowed_root(files: ModelFiles, configured: str | None) -> Path:
    """The folder reloads may read: ``configured`` or the served model's folder."""
    return Path(configured).expanduser() if configured else files.folder


def checkpoint_under_root(model: str, root: Path) -> str:
    """``model`` (a ``.gguf`` file or checkpoint folder) resolved, when it and every file of the
    folder lie under ``root``.

    Raises:
        InvalidCheckpoint: outside the root (the same message whether or not it exists), or a
            file of the folder is a link that leaves the root.
    """
    refusal = InvalidCheckpoint(f"model {model!r} is not under the allowed model root {root} "
                                "(--allowed-model-root)")
    resolved = contained_path(model, root)
    if resolved is None:
        raise refusal
    if resolved.is_dir():
        for entry in os.scandir(resolved):
            if contained_path(entry.path, root) is None:
                raise InvalidCheckpoint(f"model {model!r}: {entry.name} links outside the allowed model root {root}")
    return str(resolved)


@functools.cache
def _lock_actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class ReloadLock:
        """One owner at a time; an owner that does not release within its ``ttl_s`` loses it."""

        def __init__(self) -> None:
            self.owner, self.expires = None, 0.0

        def acquire(self, owner: str, ttl_s: float) -> str | None:
            """None when ``owner`` holds the lock now; else the current owner."""
            now = time.time()
            if self.owner is not None and self.owner != owner and now < self.expires:
                return self.owner
            self.owner, self.expires = owner, now + ttl_s
            return None

        def release(self, owner: str) -> None:
            if self.owner == owner:
                self.owner = None

    return ReloadLock


def lock_name(served_path: Path) -> str:
    return "shardserve-reload-" + hashlib.sha256(str(served_path).encode()).hexdigest()[:16]


@contextlib.asynccontextmanager
async def cluster_reload_lock(name: str, owner_label: str, ttl_s: float):
    """Hold the cluster-wide reload lock ``name`` (a detached named actor, made on first use).

    Raises:
        ReloadRefused: someone else holds it.
    """
    import asyncio

    def get_actor():
        return _lock_actor_class().options(name=name, namespace=LOCK_NAMESPACE, lifetime="detached",
                                           get_if_exists=True).remote()

    actor = await asyncio.to_thread(get_actor)
    owner = f"{owner_label}:{uuid.uuid4().hex[:8]}"
    holder = await actor.acquire.remote(owner, ttl_s)
    if holder is not None:
        raise ReloadRefused(f"another reload is in progress ({holder.rsplit(':', 1)[0]}); retry when it is done")
    try:
        yield
    finally:
        await actor.release.remote(owner)
