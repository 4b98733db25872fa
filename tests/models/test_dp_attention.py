"""Data-parallel attention at the worker level (issue 29): two CPU processes, one attention group
each (D = N = 2, G = 1), every routed expert on one of them, the MoE exchanging tokens through the
shared-memory collectives, both ``--moe-a2a`` modes, for DeepSeek-V3.2, GLM-5 (IndexShare) and
DeepSeek-V3. Each group runs its own requests (a chunked prefill, a group idle in some steps,
concurrent decodes); every logits row equals transformers' on the same checkpoint.
"""

from __future__ import annotations

import torch
from procs import run_ranks

from plan_driver import PlanDriver, hf_logits, make_runner
from shardserve.workers.comm_cpu import SharedMemoryGroup, SharedMemorySegment
from shardserve.workers.distributed import TensorParallelGroup, get_expert_group, set_tp_group
from shardserve.workers.messages import DataParallelPlan

TIMEOUT_S = 240
MAX_FLOATS = 2 * 64 * 64   # [N, rows, hidden] reduce-scatter buffers of this script's steps

_gen = torch.Generator().manual_seed(29)
PROMPTS = {"a": torch.randint(2, 128, (11,), generator=_gen).tolist(),   # group 0, chunked 6 + 5
           "b": torch.randint(2, 128, (7,), generator=_gen).tolist(),    # group 1
           "c": torch.randint(2, 128, (3,), generator=_gen).tolist()}    # group 1
# Per step: (group 0 work, group 1 work); "decode" = each running request's last greedy token.
SCRIPT = [({"a": PROMPTS["a"][:6]}, {"b": PROMPTS["b"], "c": PROMPTS["c"]}),
          ({"a": PROMPTS["a"][6:]}, {}),                 # group 1 idle: joins the exchange with 0 rows
          ("decode", "decode"), ("decode", {}), ("decode", "decode"), ({}, "decode")]


def run_script(runner) -> dict[str, list[torch.Tensor]]:
    """Drive both groups' plans through ``runner`` (the plans are the same on every rank; the rank
    computes its own group's). Returns each of its group's requests' last-token logits per step."""
    drivers = [PlanDriver(runner, seed=g) for g in range(2)]
    last: dict[str, int] = {}
    out: dict[str, list[torch.Tensor]] = {}
    for step in SCRIPT:
        works = [{req: [last[req]] for req in drivers[g].tokens} if w == "decode" else w for g, w in enumerate(step)]
        logits = runner.compute_logits(DataParallelPlan([d.plan(w) for d, w in zip(drivers, works)]))
        mine = works[runner.dp_group]
        for i, req in enumerate(mine):
            out.setdefault(req, []).append(logits[i])
        # both ranks need every request's greedy token to build the next plans: share them
        tokens = torch.full((8,), -1.0)
        for i, req in enumerate(mine):
            tokens[i] = float(logits[i].argmax())
        parts = get_expert_group().all_gather_equal(tokens)
        for g, work in enumerate(works):
            for i, req in enumerate(work):
                last[req] = int(parts[g][i])
    return out


JOBS = [(arch, mode) for arch in ("deepseek_v32", "glm_moe_dsa", "deepseek_v3") for mode in ("allgather", "alltoall")]


def _worker(rank: int, name: str, paths: dict[str, str], out_path: str) -> None:
    torch.set_num_threads(1)
    experts = SharedMemoryGroup(rank, 2, name, MAX_FLOATS, timeout_s=120)
    try:
        set_tp_group(TensorParallelGroup(), experts)    # G = 1: the attention group is the rank itself
        out = {}
        for arch, mode in JOBS:
            runner = make_runner(paths[arch], attention_dp_size=2, moe_a2a=mode)
            moe = next(layer.mlp for layer in runner.model.model.layers if hasattr(layer.mlp, "experts"))
            out[arch, mode] = {"logits": run_script(runner), "experts": (moe.experts.first, moe.experts.count),
                               "heads": runner.model.attention_layers()[0].num_heads}
        torch.save(out, f"{out_path}.{rank}")
    finally:
        set_tp_group(TensorParallelGroup())
        experts.close()


def test_dp2_worker_logits_match_transformers(tiny_model, tmp_path):
    paths = {arch: str(tiny_model(arch).path) for arch, _ in JOBS}
    segment = SharedMemorySegment(2, MAX_FLOATS)
    out_path = tmp_path / "dp2.pt"
    try:
        run_ranks(_worker, (segment.name, paths, str(out_path)), nprocs=2, timeout_s=TIMEOUT_S)
    finally:
        segment.close()
    ranks = [torch.load(f"{out_path}.{rank}") for rank in range(2)]
    for arch, mode in JOBS:
        worst = check_against_transformers(tiny_model(arch).hf, [r[arch, mode] for r in ranks])
        print(f"{arch} D=2 {mode}: max |logits - transformers| = {worst:.2e}")
        assert worst < 1e-4, (arch, mode, worst)


def check_against_transformers(hf, ranks: list[dict]) -> float:
    """Each group's rows against transformers' teacher-forced logits; the largest difference."""
    assert [r["experts"] for r in ranks] == [(0, 4), (4, 4)]   # routed experts split over both ranks
    assert [r["heads"] for r in ranks] == [4, 4]               # attention replicated (G = 1)
    worst = 0.0
    for rank, requests in ((0, ["a"]), (1, ["b", "c"])):
        for req in requests:
            rows = torch.stack(ranks[rank]["logits"][req])                   # [steps, vocab]
            prompt = PROMPTS[req]
            first = [5] if req == "a" else []                                # "a": its first chunk's last row
            generated = rows[len(first):].argmax(-1).tolist()
            reference = hf_logits(hf, prompt + generated[:-1])                # teacher forcing
            expected = reference[first + list(range(len(prompt) - 1, len(prompt) + len(generated) - 1))]
            assert rows.shape == expected.shape, (req, rows.shape, expected.shape)
            worst = max(worst, (rows - expected).abs().max().item())
    return worst
