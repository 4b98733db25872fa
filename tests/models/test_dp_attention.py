"""Data-parallel attention at the worker level (issue 29): CPU processes in attention groups, the
routed experts split over all of them, the MoE exchanging tokens through the shared-memory
collectives (``--moe-a2a`` allgather and alltoall), for DeepSeek-V3.2, GLM-5 (IndexShare) and
DeepSeek-V3. Each group runs its own requests (a chunked prefill, a group idle in some steps,
concurrent decodes); every logits row equals transformers' on the same checkpoint (teacher forcing).

``make test`` runs N = D = 2 (G = 1) for three (architecture, mode) pairs; the ``extended`` test
runs the other three and N = 4 as D = 4 (G = 1) and D = 2 (G = 2: heads, dense MLP, shared experts
and vocabulary split inside each group as plain TP=2).
"""

from __future__ import annotations

import pytest
import torch
from procs import run_ranks

from plan_driver import PlanDriver, hf_logits, make_runner
from shardserve.workers.comm_cpu import SharedMemoryGroup, SharedMemorySegment
from shardserve.workers.distributed import TensorParallelGroup, get_expert_group, get_tp_group, set_tp_group
from shardserve.workers.messages import DataParallelPlan

TIMEOUT_S = 300
MAX_FLOATS = 5 * 64 * 64   # [N, rows, hidden] reduce-scatter buffers of this script's steps (N <= 4)

_gen = torch.Generator().manual_seed(29)
PROMPTS = {"a": torch.randint(2, 128, (11,), generator=_gen).tolist(),   # even groups, chunked 6 + 5
           "b": torch.randint(2, 128, (7,), generator=_gen).tolist(),    # odd groups
           "c": torch.randint(2, 128, (3,), generator=_gen).tolist()}    # odd groups
# Per step: (even groups' work, odd groups' work); "decode" = each running request's last greedy token.
SCRIPT = [({"a": PROMPTS["a"][:6]}, {"b": PROMPTS["b"], "c": PROMPTS["c"]}),
          ({"a": PROMPTS["a"][6:]}, {}),                 # odd groups idle: join the exchange with 0 rows
          ("decode", "decode"), ("decode", {}), ("decode", "decode"), ({}, "decode")]
ARCHS = ("deepseek_v32", "glm_moe_dsa", "deepseek_v3")
# DeepSeek-V3.2 with allgather also runs through the cluster (tests/e2e/test_dp_attention_cluster.py)
FAST_JOBS = [("deepseek_v32", "alltoall"), ("glm_moe_dsa", "alltoall"), ("deepseek_v3", "allgather")]
OTHER_JOBS = [("deepseek_v32", "allgather"), ("glm_moe_dsa", "allgather"), ("deepseek_v3", "alltoall")]


def run_script(runner, num_groups: int) -> dict[str, list[torch.Tensor]]:
    """Drive every group's plans through ``runner`` (the plans are the same on every rank; the rank
    computes its own group's). Returns its group's requests' last-token logits per step."""
    drivers = [PlanDriver(runner, seed=g) for g in range(num_groups)]
    size = get_tp_group().tp_size
    last: dict[tuple[int, str], int] = {}
    out: dict[str, list[torch.Tensor]] = {}
    for step in SCRIPT:
        works = []
        for g, driver in enumerate(drivers):
            work = step[g % 2]
            works.append({req: [last[g, req]] for req in driver.tokens} if work == "decode" else work)
        logits = runner.compute_logits(DataParallelPlan([d.plan(w) for d, w in zip(drivers, works)]))
        mine = works[runner.dp_group]
        for i, req in enumerate(mine):
            out.setdefault(req, []).append(logits[i])
        # every rank needs every request's greedy token to build the next plans: share them
        tokens = torch.full((8,), -1.0)
        for i, req in enumerate(mine):
            tokens[i] = float(logits[i].argmax())
        parts = get_expert_group().all_gather_equal(tokens)
        for g, work in enumerate(works):
            for i, req in enumerate(work):
                last[g, req] = int(parts[g * size][i])
    return out


def _worker(rank: int, world: int, num_groups: int, names: list[str], paths: dict[str, str], jobs: list,
            out_path: str) -> None:
    torch.set_num_threads(1)
    size = world // num_groups
    experts = SharedMemoryGroup(rank, world, names[0], MAX_FLOATS, timeout_s=120)
    attention = (SharedMemoryGroup(rank % size, size, names[1 + rank // size], MAX_FLOATS, timeout_s=120)
                 if size > 1 else TensorParallelGroup())
    try:
        set_tp_group(attention, experts)
        out = {}
        for arch, mode in jobs:
            runner = make_runner(paths[arch], attention_dp_size=num_groups, moe_a2a=mode)
            moe = next(layer.mlp for layer in runner.model.model.layers if hasattr(layer.mlp, "experts"))
            out[arch, mode] = {"logits": run_script(runner, num_groups),
                               "experts": (moe.experts.first, moe.experts.count),
                               "heads": runner.model.attention_layers()[0].num_heads}
        torch.save(out, f"{out_path}.{rank}")
    finally:
        set_tp_group(TensorParallelGroup())
        experts.close()
        attention.close()


def run_layout(tiny_model, tmp_path, world: int, num_groups: int, jobs: list) -> None:
    """Run ``jobs`` on ``world`` ranks in ``num_groups`` attention groups; check every group's
    leader's logits against transformers and the weight layout of every rank."""
    size = world // num_groups
    paths = {arch: str(tiny_model(arch).path) for arch, _ in jobs}
    segments = [SharedMemorySegment(world, MAX_FLOATS)]
    segments += [SharedMemorySegment(size, MAX_FLOATS) for _ in range(num_groups)] if size > 1 else []
    out_path = tmp_path / f"dp{world}x{num_groups}.pt"
    try:
        run_ranks(_worker, (world, num_groups, [s.name for s in segments], paths, jobs, str(out_path)), nprocs=world,
                  timeout_s=TIMEOUT_S)
    finally:
        for segment in segments:
            segment.close()
    ranks = [torch.load(f"{out_path}.{rank}") for rank in range(world)]
    per_rank = 8 // world
    for arch, mode in jobs:
        results = [r[arch, mode] for r in ranks]
        assert [r["experts"] for r in results] == [(per_rank * i, per_rank) for i in range(world)]   # over all ranks
        assert [r["heads"] for r in results] == [4 // size] * world   # attention split inside the group only
        for rank in range(0, world, size):   # every rank of a group holds the same logits
            for peer in range(rank + 1, rank + size):
                for req, rows in results[rank]["logits"].items():
                    assert torch.equal(torch.stack(rows), torch.stack(results[peer]["logits"][req]))
        leaders = [results[g * size] for g in range(num_groups)]
        worst = max(check_against_transformers(tiny_model(arch).hf, leader, ["a"] if g % 2 == 0 else ["b", "c"])
                    for g, leader in enumerate(leaders))
        print(f"{arch} N={world} D={num_groups} {mode}: max |logits - transformers| = {worst:.2e}")
        assert worst < 1e-4, (arch, mode, worst)


def check_against_transformers(hf, result: dict, requests: list[str]) -> float:
    """One group's rows against transformers' teacher-forced logits; the largest difference."""
    worst = 0.0
    for req in requests:
        rows = torch.stack(result["logits"][req])                          # [steps, vocab]
        prompt = PROMPTS[req]
        first = [5] if req == "a" else []                                  # "a": its first chunk's last row
        generated = rows[len(first):].argmax(-1).tolist()
        reference = hf_logits(hf, prompt + generated[:-1])                 # teacher forcing
        expected = reference[first + list(range(len(prompt) - 1, len(prompt) + len(generated) - 1))]
        assert rows.shape == expected.shape, (req, rows.shape, expected.shape)
        worst = max(worst, (rows - expected).abs().max().item())
    return worst


def test_dp2_worker_logits_match_transformers(tiny_model, tmp_path):
    run_layout(tiny_model, tmp_path, world=2, num_groups=2, jobs=FAST_JOBS)


@pytest.mark.extended
@pytest.mark.parametrize("world, num_groups, jobs", [
    (2, 2, OTHER_JOBS),
    (4, 4, [("deepseek_v32", "allgather"), ("glm_moe_dsa", "alltoall")]),
    (4, 2, [("deepseek_v32", "alltoall"), ("deepseek_v3", "allgather")]),
], ids=["N2-D2-rest", "N4-D4", "N4-D2-G2"])
def test_dp_worker_layouts_extended(tiny_model, tmp_path, world, num_groups, jobs):
    run_layout(tiny_model, tmp_path, world, num_groups, jobs)
