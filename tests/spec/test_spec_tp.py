"""Speculative decoding with a tensor-parallel target: 2 gloo CPU processes run the target's TP=2
shards (DeepSeek-V3.2 split 3+1 heads / 6+2 experts, GLM-5 split evenly); rank 0 also runs the
engine core and the MTP draft worker (whole, on a single-rank group, sharing its buffers with rank
0: in the cluster it is its own actor). Greedy output with k = 1 and 3 (fixed) and with the
adaptive policy (over an oracle that knows the answer up to chosen points, so that it keeps
drafting) equals TP=1 plain decoding token for token, for a batch and for a single request, and
every block returns to the pool; sampled output with the adaptive policy at TP=2 is distributed as
TP=1 plain sampling (chi-square on the tokens drafts decide). (The Ray path, with the draft worker
as an actor, is ``test_spec_cluster.py``.)
"""

from __future__ import annotations

from pathlib import Path

import torch
from procs import free_port, run_ranks
import torch.distributed as dist

from spec_helpers import ARCHS, BLOCK_SIZE, NUM_BLOCKS, VOCAB, greedy, make_llm, prompts, two_sample_p

SPLITS = {"deepseek_v32": [3.0, 1.0], "glm_moe_dsa": [1.0, 1.0]}
RUNS = ((1, "fixed"), (3, "fixed"), (3, "adaptive"))
NUM_SAMPLED = 600
TIMEOUT_S = 300


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


def _generate(runner, path: str, k: int, policy: str, group, batch: list[list[int]], params, truth=None
              ) -> tuple[list[list[int]], int, int]:
    """Rank 0: an engine core over the TP=2 executor; returns (tokens per prompt, free blocks,
    draft tokens verified). ``truth``: an oracle over the real MTP proposes it (wrong now and then)."""
    from shardserve.cluster.engine.request import SamplingParams
    from spec_helpers import OracleDrafter

    from shardserve.cluster.engine.engine import EngineCore
    from shardserve.cluster.engine.scheduler import SchedulerConfig
    from shardserve.cluster.engine.speculative import Speculator
    from shardserve.cluster.tokenizer import eos_token_ids, load_tokenizer
    from shardserve.workers.draft_buffers import BufferSizes
    from shardserve.workers.draft_worker import DraftWorker

    files = runner_files(path)
    speculator = None
    if k:
        drafter = _SingleRankDrafter(DraftWorker(inline=True), group)
        drafter.load(files, runner.hf_config, BufferSizes(96, 64, k), BLOCK_SIZE, NUM_BLOCKS)
        runner.attach_draft_buffers(drafter.inner.buffers)
        speculator = Speculator(drafter, k, policy)
        if policy == "adaptive":   # see drafts as cheap: the policy keeps drafting on these tiny models
            observe = speculator.policy.observe_draft
            speculator.policy.observe_draft = lambda d, rows, entries, sec: observe(d, rows, entries, sec * 0.05)
            speculator.policy._pays_at = lambda num_seqs, prompt_tokens: True   # prompts enter the draft cache
            speculator.policy._vetoed = lambda num_seqs, depth: False           # realized rates veto nothing,
            speculator.policy.verify.observe = lambda x, y: None                # verify rows look free
    tokenizer = load_tokenizer(files)
    limits = SchedulerConfig(64, 16, 256) if isinstance(params, SamplingParams) else SchedulerConfig(24, 96, 256)
    core = EngineCore(_BroadcastExecutor(runner), tokenizer, NUM_BLOCKS, BLOCK_SIZE, limits,
                      eos_token_ids(tokenizer, runner.hf_config), runner.hf_config.vocab_size, speculator=speculator)
    if truth is not None:
        speculator.drafter = OracleDrafter(speculator.drafter, core, truth, wrong=lambda index: index % 4 == 2)
    ids = [core.add_request(p, params[i] if isinstance(params, list) else params) for i, p in enumerate(batch)]
    tokens = {i: [] for i in ids}
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    verified = speculator.stats.num_draft_tokens if speculator else 0
    return [tokens[i] for i in ids], core.block_manager.num_free_blocks, verified


def runner_files(path: str):
    from shardserve.workers.model_source import ModelFiles

    return ModelFiles(Path(path).name, Path(path))


def _sampled_params(seed_base: int) -> list:
    from shardserve.cluster.engine.request import SamplingParams

    return [SamplingParams(max_tokens=3, temperature=1.0, seed=seed_base + i if i % 2 else None, ignore_eos=True)
            for i in range(NUM_SAMPLED)]


def _worker(rank: int, port: int, jobs: list[tuple[str, str, dict]], out_path: str) -> None:
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
        for arch, path, truth in jobs:
            for k, policy in RUNS:
                for name, batch in (("batch", prompts()), ("single", prompts((7,), seed=5))):
                    _broadcast(("build", path, SPLITS[arch]))
                    runner = _runner(path, SPLITS[arch])
                    results[arch, k, policy, name] = _generate(runner, path, k, policy, group, batch, greedy(),
                                                               truth if policy == "adaptive" else None)
        arch, path, _ = jobs[0]
        _broadcast(("build", path, SPLITS[arch]))
        results["sampled"] = _generate(_runner(path, SPLITS[arch]), path, 2, "adaptive", group,
                                       prompts((6,), seed=3) * NUM_SAMPLED, _sampled_params(0))
        _broadcast(("exit",))
        torch.save(results, out_path)
    finally:
        group.close()



def test_tp2_speculative_greedy_and_sampling_equal_tp1_plain(mtp_checkpoint, tmp_path):
    jobs, expected = [], {}
    for arch in ARCHS:
        path = mtp_checkpoint(arch).path
        reference = make_llm(path, 0)
        every = prompts() + prompts((7,), seed=5)
        truth = {tuple(p): d.token_ids for p, d in zip(every, reference.generate(every, greedy(24)))}
        expected[arch] = {name: [truth[tuple(p)][:20] for p in batch]
                          for name, batch in (("batch", prompts()), ("single", prompts((7,), seed=5)))}
        jobs.append((arch, str(path), truth))
    out_path = tmp_path / "tp2-spec.pt"
    run_ranks(_worker, (free_port(), jobs, str(out_path)), nprocs=2, timeout_s=TIMEOUT_S)
    results = torch.load(out_path)
    for arch, _, _ in jobs:
        for name, want in expected[arch].items():
            for k, policy in RUNS:
                tokens, free, verified = results[arch, k, policy, name]
                where = f"{arch} TP=2 k={k} {policy} {name}"
                assert verified > 0, where
                assert tokens == want, f"{where}: {tokens} != TP=1 plain {want}"
                assert free == NUM_BLOCKS, f"{where}: {free} of {NUM_BLOCKS} blocks free"
    spec, _, verified = results["sampled"]
    plain = [d.token_ids for d in make_llm(mtp_checkpoint(ARCHS[0]).path, 0, max_num_seqs=64, num_blocks=320,
                                           max_num_batched_tokens=64).generate(prompts((6,), seed=3) * NUM_SAMPLED,
                                                                              _sampled_params(10**6))]
    counts = [[torch.bincount(torch.tensor([seq[pos] for seq in seqs]), minlength=VOCAB).double() for pos in (1, 2)]
              for seqs in (spec, plain)]
    p_values = [two_sample_p(a, b) for a, b in zip(*counts)]
    print(f"TP=2 adaptive sampling vs TP=1 plain: second / third token p = {p_values}, {verified} drafts verified")
    assert verified > NUM_SAMPLED // 2 and min(p_values) > 0.01
