"""Async scheduling at TP=2 (2 gloo CPU ranks, tiny Llama): a decode whose token is a placeholder
gets rank 0's last sample on every rank through one all-reduce of the uploaded input ids, with no
host read on any rank (the share runs under ``workers/sync_guard.py``'s guard), through the decode
graphs' stand-in (a pure decode step) and eagerly (a step mixing it with a prefill); the logits
equal a TP=1 run given the real tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from procs import free_port, run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from plan_driver import PlanDriver, make_runner  # noqa: E402
from tiny_checkpoints import write_tiny_llama  # noqa: E402

from shardserve.workers.messages import PLACEHOLDER_TOKEN  # noqa: E402
from shardserve.workers.model_runner import ModelRunner  # noqa: E402

PROMPTS = {"a": [0, 5, 9, 17, 33, 2], "b": [0, 40, 41], "c": [0, 7, 8, 9]}


def decode(runner, placeholders: bool) -> tuple[list[int], torch.Tensor]:
    """Prefill a and b; decode both (a graphed step); decode a beside c's prefill (an eager step).
    With ``placeholders`` each decode's token is a placeholder (its plan was sent before the last
    result was back). Returns rank 0's sampled tokens and the last step's logits."""
    driver = PlanDriver(runner, seed=1)
    sampled = []

    def step(work):
        result = runner.execute(driver.plan(work))
        sampled.extend(t.token_id for t in result.sampled) if result is not None else None
        return {t.req_id: t.token_id for t in result.sampled} if result is not None else {}

    last = step({"a": PROMPTS["a"], "b": PROMPTS["b"]})
    last = step({req: [PLACEHOLDER_TOKEN if placeholders else last[req]] for req in ("a", "b")})
    logits = runner.compute_logits(driver.plan({"a": [PLACEHOLDER_TOKEN if placeholders else last["a"]],
                                                "c": PROMPTS["c"]}))
    return sampled, logits


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
        runner = make_runner(path, decode_graphs="replay")
        sampled, logits = decode(runner, placeholders=True)
        torch.save({"sampled": sampled, "logits": logits, "shared": shared, "graphs": runner.graphs is not None},
                   f"{out_path}.{rank}")
    finally:
        group.close()


@pytest.mark.slow   # two gloo rank processes, each loading the model: ~65 s
def test_placeholders_are_shared_on_the_device(tmp_path):
    write_tiny_llama(tmp_path / "llama")
    out_path = tmp_path / "out.pt"
    run_ranks(_rank, (free_port(), str(tmp_path / "llama"), str(out_path)), nprocs=2, timeout_s=240)
    ranks = [torch.load(f"{out_path}.{rank}") for rank in range(2)]
    expected_sampled, expected_logits = decode(make_runner(tmp_path / "llama"), placeholders=False)
    for rank in ranks:
        assert rank["graphs"] and rank["shared"] == [2, 1]    # the graphed decode's 2 rows, the mixed step's 1
        torch.testing.assert_close(rank["logits"], expected_logits, atol=1e-4, rtol=1e-4)
    assert ranks[0]["sampled"] == expected_sampled and ranks[1]["sampled"] == []
