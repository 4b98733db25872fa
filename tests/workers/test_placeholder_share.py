"""Async scheduling at TP=2 (2 gloo CPU ranks, tiny Llama): a decode whose token is a placeholder
gets rank 0's last sample on every rank through one all-reduce of the uploaded input ids, with no
host read on any rank (the share runs under ``workers/sync_guard.py``'s guard), eagerly and through
the decode graphs' stand-in; the tokens equal a TP=1 run given the real tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from procs import free_port, run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from plan_driver import PlanDriver, make_runner  # noqa: E402
from tiny_checkpoints import write_tiny_llama  # noqa: E402

from shardserve.workers.messages import PLACEHOLDER_TOKEN  # noqa: E402
from shardserve.workers.model_runner import ModelRunner  # noqa: E402

PROMPTS = {"a": [0, 5, 9, 17, 33, 2], "b": [0, 40, 41]}


def decode(runner, placeholders: bool) -> tuple[list[int], list[int], torch.Tensor]:
    """Prefill, then two decode steps; ``(first tokens, second tokens, second step's logits)``. With
    ``placeholders`` the first decode's tokens are placeholders (the plan was sent before the
    prefill's result was back)."""
    driver = PlanDriver(runner, seed=1)
    first = runner.execute(driver.plan(PROMPTS))
    sampled = [t.token_id for t in first.sampled] if first is not None else [0, 0]
    work = {req: [PLACEHOLDER_TOKEN if placeholders else token] for req, token in zip(PROMPTS, sampled)}
    logits = runner.compute_logits(driver.plan(work))
    return sampled, logits.argmax(-1).tolist(), logits


def _rank(rank: int, port: int, path: str, out_path: str) -> None:
    from shardserve.workers.comm_cpu import GlooGroup
    from shardserve.workers.distributed import set_tp_group
    from shardserve.workers.sync_guard import no_host_sync

    torch.set_num_threads(1)
    group = GlooGroup(rank, 2, f"tcp://127.0.0.1:{port}")
    share = ModelRunner._share_placeholders
    shared: list[int] = []

    def guarded(input_ids, rows):
        with no_host_sync("the placeholder share"):
            share(input_ids, rows)
        shared.append(rows.numel())

    ModelRunner._share_placeholders = staticmethod(guarded)
    try:
        set_tp_group(group)
        results = {mode: decode(make_runner(path, decode_graphs=mode), placeholders=True)
                   for mode in ("off", "replay")}
        torch.save({"results": results, "shared": shared}, f"{out_path}.{rank}")
    finally:
        group.close()


def test_placeholders_are_shared_on_the_device(tmp_path):
    write_tiny_llama(tmp_path / "llama")
    out_path = tmp_path / "out.pt"
    run_ranks(_rank, (free_port(), str(tmp_path / "llama"), str(out_path)), nprocs=2, timeout_s=240)
    ranks = [torch.load(f"{out_path}.{rank}") for rank in range(2)]
    expected_first, expected_second, expected_logits = decode(make_runner(tmp_path / "llama"), placeholders=False)
    for rank in ranks:
        assert rank["shared"] == [2, 2]                       # one share per run (eager, graphs), 2 rows
        for mode, (first, second, logits) in rank["results"].items():
            assert second == expected_second, (mode, second, expected_second)
            torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    assert ranks[0]["results"]["off"][0] == expected_first
