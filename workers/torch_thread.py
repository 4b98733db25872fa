"""One thread per rank process runs all of its torch work.

Ray runs an actor's calls on its task thread, but a Compiled Graph runs the actor's part of the
graph (here: ``execute`` every step) on a thread of its own. With the weights loaded on one thread
and steps run on another, the process has two OpenMP masters, hence two OpenMP thread teams; GNU
OpenMP then counts more managed threads than CPUs and throttles its spin-wait (``GOMP_SPINCOUNT``
drops to 1000), so every one of a step's few hundred parallel regions pays a sleeping worker's
wake-up. Measured on SmolLM2 TP=1 with 2 threads: rank compute 25.5 ms per decode step with
compiled dispatch against 14.4 ms with actor calls; and in a bare process, a bf16 576x1536
matmul 39 us from the loading thread against 87 us from a second one.

Methods decorated with :func:`on_torch_thread` run on this process's single torch thread (the
caller waits), so every call sees the same OpenMP team, whichever Ray thread it came from. An
object whose ``torch_inline`` attribute is true runs them on the caller's thread instead: in the
single-process engine the caller's thread is the one that does all torch work (a draft model there
on a thread of its own made every decode step of the target, speculating or not, pay the second
team's throttled spin-waits: 3x slower on the demo model, issue 31).
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_thread_id: int | None = None


def _torch_executor() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardserve-torch",
                                           initializer=_remember_thread)
        return _executor


def _remember_thread() -> None:
    global _thread_id
    _thread_id = threading.get_ident()


def torch_thread_submit(fn, *args) -> None:
    """Run ``fn(*args)`` on the torch thread later, after everything submitted before (calls
    there run first in first out); its result and exceptions are dropped (``fn`` reports them)."""
    _torch_executor().submit(fn, *args)


def on_torch_thread(method):
    """Run ``method`` on the process's torch thread and return its result (its exceptions are
    raised in the caller). A call made from the torch thread itself, or on an object with
    ``torch_inline = True``, runs at once. Put it outside
    thread-local decorators (``torch.inference_mode()``, ``torch.no_grad()``): those must be
    entered on the torch thread."""

    @functools.wraps(method)
    def run_there(self, *args, **kwargs):
        if getattr(self, "torch_inline", False) or threading.get_ident() == _thread_id:
            return method(self, *args, **kwargs)
        return _torch_executor().submit(method, self, *args, **kwargs).result()

    return run_there
