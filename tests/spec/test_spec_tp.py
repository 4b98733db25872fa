"""Speculative decoding with a tensor-parallel target: 2 gloo CPU processes run the target's TP=2
shards (DeepSeek-V3.2 split 3+1 heads / 6+2 experts, GLM-5 split evenly); rank 0 also runs the
engine core and the MTP draft worker (whole, on a single-rank group: in the cluster it is its own
actor). Greedy output with k = 1, 2, 3 equals TP=1 plain decoding token for token, for a batch
and for a single request, and every block returns to the pool. (The Ray path, with the draft
worker as an actor, is ``test_spec_cluster.py``.)
"""

from __future__ import annotations

from pathlib import Path

import torch
from procs import free_port, run_ranks
import torch.distributed as dist

from spec_helpers import ARCHS, BLOCK_SIZE, NUM_BLOCKS, greedy, make_llm, prompts

SPLITS = {"deepseek_v32": [3.0, 1.0], "glm_moe_dsa": [1.0, 1.0]}
KS = (0, 1, 2, 3)
TIMEOUT_S = 240


def _broadcast(message=None):
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class _BroadcastExecutor:
    """Rank 0's executor: every plan goes to rank 1 too, then runs here."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def execute(self, plan):
        _broadcast(("run", plan))
        return self.runner.execute(plan)


class _SingleRankDrafter:
    """The draft worker is never sharded: give it a single-rank TP group while it runs."""

    def __init__(self, inner, group) -> None:
        self.inner, self.group = inner, group

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def call(*args, **kwargs):
            from shardserve.workers.distributed import TensorParallelGroup, set_tp_group

            set_tp_group(TensorParallelGroup())
            try:
                return method(*args, **kwargs)
            finally:
                set_tp_group(self.group)

        return call


def _runner(path: str, split):
    from shardserve.workers.model_runner import ModelRunner, RunnerConfig
    from shardserve.workers.model_source import ModelFiles, load_config

    files = ModelFiles(Path(path).name, Path(path))
    return ModelRunner(files, load_config(files), RunnerConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                                                               tensor_split=split), progress=False)


def _generate(runner, path: str, k: int, group, batch: list[list[int]]) -> tuple[list[list[int]], int, int]:
    """Rank 0: an engine core over the TP=2 executor; returns (tokens per prompt, free blocks,
    draft tokens verified)."""
    from shardserve.cluster.engine.engine import EngineCore
    from shardserve.cluster.engine.scheduler import SchedulerConfig
    from shardserve.cluster.engine.speculative import Speculator
    from shardserve.cluster.tokenizer import eos_token_ids, load_tokenizer
    from shardserve.workers.draft_worker import DraftWorker

    files = runner_files(path)
    speculator = None
    if k:
        drafter = _SingleRankDrafter(DraftWorker(), group)
        drafter.load(files, runner.hf_config, BLOCK_SIZE, NUM_BLOCKS)
        speculator = Speculator(drafter, k)
    tokenizer = load_tokenizer(files)
    core = EngineCore(_BroadcastExecutor(runner), tokenizer, NUM_BLOCKS, BLOCK_SIZE, SchedulerConfig(64, 16, 256),
                      eos_token_ids(tokenizer, runner.hf_config), runner.hf_config.vocab_size, speculator=speculator)
    ids = [core.add_request(p, greedy()) for p in batch]
    tokens = {i: [] for i in ids}
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    verified = speculator.stats.num_draft_tokens if speculator else 0
    return [tokens[i] for i in ids], core.block_manager.num_free_blocks, verified


def runner_files(path: str):
    from shardserve.workers.model_source import ModelFiles

    return ModelFiles(Path(path).name, Path(path))


def _worker(rank: int, port: int, jobs: list[tuple[str, str]], out_path: str) -> None:
    torch.set_num_threads(1)
    from shardserve.workers.comm_cpu import GlooGroup
    from shardserve.workers.distributed import set_tp_group

    group = GlooGroup(rank, 2, f"tcp://127.0.0.1:{port}")
    set_tp_group(group)
    try:
        if rank == 1:   # follow rank 0: build runners, execute plans
            runner = None
            while (message := _broadcast()) != ("exit",):
                if message[0] == "build":
                    runner = _runner(*message[1:])
                else:
                    runner.execute(message[1])
            return
        results = {}
        for arch, path in jobs:
            for k in KS:
                for name, batch in (("batch", prompts()), ("single", prompts((7,), seed=5))):
                    _broadcast(("build", path, SPLITS[arch]))
                    runner = _runner(path, SPLITS[arch])
                    results[arch, k, name] = _generate(runner, path, k, group, batch)
        _broadcast(("exit",))
        torch.save(results, out_path)
    finally:
        group.close()



def test_tp2_speculative_greedy_equals_tp1_plain(mtp_checkpoint, tmp_path):
    jobs = [(arch, str(mtp_checkpoint(arch).path)) for arch in ARCHS]
    out_path = tmp_path / "tp2-spec.pt"
    run_ranks(_worker, (free_port(), jobs, str(out_path)), nprocs=2, timeout_s=TIMEOUT_S)
    results = torch.load(out_path)
    for arch, path in jobs:
        reference = make_llm(Path(path), 0)
        for name, batch in (("batch", prompts()), ("single", prompts((7,), seed=5))):
            expected = [d.token_ids for d in reference.generate(batch, greedy())]
            for k in KS:
                tokens, free, verified = results[arch, k, name]
                assert (verified > 0) == (k > 0)
                assert tokens == expected, f"{arch} TP=2 k={k} {name}: {tokens} != TP=1 plain {expected}"
                assert free == NUM_BLOCKS, f"{arch} TP=2 k={k} {name}: {free} of {NUM_BLOCKS} blocks free"
