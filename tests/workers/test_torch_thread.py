"""Every torch call of a rank runs on one thread, whichever thread calls (workers/torch_thread.py)."""

import threading

import pytest

from shardserve.workers.torch_thread import on_torch_thread


class Rank:
    @on_torch_thread
    def where(self) -> int:
        return threading.get_ident()

    @on_torch_thread
    def nested(self) -> tuple[int, int]:
        return threading.get_ident(), self.where()   # a call from the torch thread runs at once

    @on_torch_thread
    def fail(self) -> None:
        raise ValueError("bad plan")


def test_calls_from_any_thread_run_on_the_one_torch_thread_and_raise_in_the_caller():
    rank, seen = Rank(), []
    threads = [threading.Thread(target=lambda: seen.append(rank.where())) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    outer, inner = rank.nested()
    assert len(set(seen + [rank.where(), outer, inner])) == 1
    assert seen[0] != threading.get_ident()
    with pytest.raises(ValueError, match="bad plan"):
        rank.fail()


def test_inference_mode_inside_the_decorator_holds_on_the_torch_thread():
    import torch

    class Drafter:
        @on_torch_thread
        @torch.inference_mode()
        def propose(self) -> bool:
            return torch.is_inference_mode_enabled()

    assert Drafter().propose()
