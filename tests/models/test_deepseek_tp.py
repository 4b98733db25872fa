"""Tensor parallel: 2 gloo CPU processes == one process, for all three architectures.

Splits: DeepseekV32 ``[3, 1]`` (3 + 1 heads, 6 + 2 experts, uneven vocab / MLP / shared-expert
slices), GlmMoeDsa ``[1, 1]``, DeepseekV3 ``[1, 3]``. Each run is a batch of three sequences (two
prefilled in two chunks) followed by greedy decode steps, so prefill, absorbed decode, the
indexer, IndexShare and the MoE all-reduce all cross ranks. One more DeepseekV32 run uses
``--dsa-sink 1`` and the fp8 indexer cache and queries on a checkpoint whose indexer ranks
position 0 last (``crafted_indexer.py``): every rank keeps it in the same top-k. The third
sequence is a 92-token prompt (top-k 8, so DSA prefill is sparse in both chunks; V3 expands its
60-token chunk): its logits on 2 ranks also equal transformers'.
"""

from __future__ import annotations

import shutil

import torch
from procs import free_port, run_ranks

from crafted_indexer import craft_marker_checkpoint
from plan_driver import PlanDriver, hf_logits, make_runner
from shardserve.workers.comm_cpu import GlooGroup
from shardserve.workers.distributed import set_tp_group

SPLITS = {"deepseek_v32": [3.0, 1.0], "glm_moe_dsa": [1.0, 1.0], "deepseek_v3": [1.0, 3.0]}
SINK_SWITCHES = {"dsa_sink": 1, "indexer_cache_dtype": "fp8"}
TIMEOUT_S = 240


LONG_PROMPT = torch.randint(2, 128, (92,), generator=torch.Generator().manual_seed(92)).tolist()


def run_script(runner) -> torch.Tensor:
    """Three sequences (13 tokens in chunks of 6 + 7; 4 tokens; a 92-token prompt in chunks of 60
    + 32, whose every chunk selects under DSA and whose first chunk V3 expands), then 6 greedy
    decode steps.

    Returns:
        ``[num_steps * 3, vocab]`` logits of every step and request (rows x, y, z per step).
    """
    gen = torch.Generator().manual_seed(0)
    long_prompt, short_prompt = [0] + torch.randint(2, 128, (12,), generator=gen).tolist(), [0, 9, 2, 77]
    driver = PlanDriver(runner, seed=3)
    rows = []
    first = driver.step({"x": long_prompt[:6], "y": short_prompt, "z": LONG_PROMPT[:60]})
    last = {"x": long_prompt[6:], "y": [int(first["y"].argmax())], "z": LONG_PROMPT[60:]}
    rows += [first["x"], first["y"], first["z"]]
    for _ in range(7):
        out = driver.step(last)
        rows += [out["x"], out["y"], out["z"]]
        last = {req: [int(logits.argmax())] for req, logits in out.items()}
    return torch.stack(rows)


def _worker(rank: int, world_size: int, port: int, jobs: list[tuple[str, str, str, dict]], out_path: str) -> None:
    torch.set_num_threads(1)
    group = GlooGroup(rank, world_size, f"tcp://127.0.0.1:{port}")
    try:
        set_tp_group(group)
        results, layout = {}, {}
        for name, arch, path, switches in jobs:
            runner = make_runner(path, tensor_split=SPLITS[arch], **switches)
            results[name] = run_script(runner)
            moe = next(layer.mlp for layer in runner.model.model.layers if hasattr(layer.mlp, "experts"))
            layout[name] = (runner.model.attention_layers()[0].num_heads, moe.experts.count)
        torch.save({"logits": results, "layout": layout}, f"{out_path}.{rank}")
    finally:
        group.close()



def test_tp2_matches_tp1(tiny_model, tmp_path):
    sink_path = shutil.copytree(tiny_model("deepseek_v32").path, tmp_path / "v32-sink")
    craft_marker_checkpoint(sink_path, marker_ids=set(range(1, 128)), never_emit={0})
    jobs = [(arch, arch, str(tiny_model(arch).path), {}) for arch in SPLITS]
    jobs.append(("deepseek_v32 sink fp8", "deepseek_v32", str(sink_path), SINK_SWITCHES))
    out_path = tmp_path / "tp2.pt"
    run_ranks(_worker, (2, free_port(), jobs, str(out_path)), nprocs=2, timeout_s=TIMEOUT_S)
    ranks = [torch.load(f"{out_path}.{rank}") for rank in range(2)]
    # (local heads, local routed experts) per rank: the uneven splits really are uneven.
    assert [r["layout"]["deepseek_v32"] for r in ranks] == [(3, 6), (1, 2)]
    assert [r["layout"]["deepseek_v3"] for r in ranks] == [(1, 2), (3, 6)]
    assert [r["layout"]["glm_moe_dsa"] for r in ranks] == [(2, 4), (2, 4)]
    for name, arch, path, switches in jobs:
        tp1 = run_script(make_runner(path, **switches))
        assert torch.equal(ranks[0]["logits"][name], ranks[1]["logits"][name]), f"{name}: ranks disagree"
        diff = (tp1 - ranks[0]["logits"][name]).abs().max().item()
        print(f"{name} split {SPLITS[arch]}: max |TP2 - TP1| = {diff:.2e}")
        assert diff < 1e-4, f"{name} split {SPLITS[arch]}: max |TP2 - TP1| = {diff}"
        if not switches:   # the long prompt's greedy tokens are transformers' (teacher forcing)
            z_rows = ranks[0]["logits"][name][2::3]                       # [8, vocab]
            generated = z_rows[1:].argmax(-1).tolist()
            reference = hf_logits(tiny_model(arch).hf, LONG_PROMPT + generated[:-1])
            expected = torch.cat((reference[59:60], reference[len(LONG_PROMPT) - 1:]))  # after each chunk, then decode
            assert (z_rows - expected).abs().max().item() < 1e-4, f"{name}: TP2 long prompt vs transformers"
