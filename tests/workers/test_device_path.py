"""The device-generic runner, exercised on CPU: bfloat16 runs the whole path within the bf16 error
of the transformers reference, a step leaves nothing off the runner's device, decode graphs (the
CPU stand-in of CUDA graphs) give the eager tokens, FP8 weights kept in FP8 give the dequantized
logits, and the device and dtype rules (the memory rule: ``tests/workers/test_plan.py``).

The bf16 bound: transformers itself, run in bf16, moves the logits away from its float32 logits
by ``e_ref = max_rows max|l_bf16 - l_fp32| / max|l_fp32|`` (teacher-forced rows). Ours may move
by at most ``1.25 * e_ref + 0.02``. The tiny random checkpoints are sensitive (a bf16 rounding flips
an MoE routing or DSA top-k choice), which is why the bound is relative to the reference's own
bf16 error and not a fixed constant: both flip the same way.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from plan_driver import PlanDriver  # noqa: E402
from tiny_checkpoints import write_fp8_checkpoint, write_tiny_checkpoint, write_tiny_llama  # noqa: E402

from shardserve.workers.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from shardserve.workers.model_source import ModelFiles, load_config, resolve_model  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``arch -> (folder, transformers model)``, each written once per module."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = tmp_path_factory.mktemp(arch)
            hf = write_tiny_llama(path) if arch == "llama" else write_tiny_checkpoint(arch, path, seed=0)
            cache[arch] = path, hf
        return cache[arch]

    return get


def make_runner(path, **config) -> ModelRunner:
    files = ModelFiles(Path(path).name, Path(path)) if Path(path).is_dir() else resolve_model(str(path))
    return ModelRunner(files, load_config(files), RunnerConfig(**{"block_size": 4, "num_blocks": 64, **config}),
                       progress=False)


def forced_logits(runner: ModelRunner, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Float32 logits of every position: the prompt in one step, then one given token per step."""
    driver = PlanDriver(runner)
    rows = [driver.step_all_rows({"a": tokens[:prompt_len]})["a"]]
    rows += [driver.step_all_rows({"a": [token]})["a"] for token in tokens[prompt_len:]]
    return torch.cat(rows).float()


def relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return ((logits - reference).abs().amax(-1) / reference.abs().amax(-1)).max().item()


@torch.no_grad()
def reference_bf16_error(hf, tokens: list[int]) -> float:
    full = hf(torch.tensor([tokens])).logits[0].float()
    half = copy.deepcopy(hf).to(torch.bfloat16)(torch.tensor([tokens])).logits[0].float()
    return relative_error(half, full)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v32", "qwen3_next"])
def test_bf16_logits_stay_within_the_references_bf16_error(checkpoints, arch):
    """qwen3_next: its ``1 + w`` norms in bf16 gave 3x the reference's error (an H200 run found it)."""
    path, hf = checkpoints(arch)
    tokens = torch.randint(2, 90, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    full = make_runner(path, dtype="float32")
    half = make_runner(path, dtype="bfloat16")
    assert half.dtype == torch.bfloat16 and full.dtype == torch.float32
    # float32 by design: routers, the indexer's head weights (as in HF), DeltaNet's decay
    # parameters, Qwen3-Next's 1 + w norms (HF computes both in float32)
    kept_fp32 = ("gate.weight", "e_score_correction_bias", "weights_proj.weight", "A_log", "dt_bias")
    kept_fp32 += tuple(f"{name}.weight" for name, m in half.model.named_modules() if type(m).__name__ == "OffsetRMSNorm")
    assert all(p.dtype == torch.bfloat16 for name, p in half.model.named_parameters() if not name.endswith(kept_fp32))
    assert all(c.dtype == torch.bfloat16 for layer in half.model.attention_layers() for c in layer.kv_cache)
    ours = relative_error(forced_logits(half, tokens, 12), forced_logits(full, tokens, 12))
    bound = 1.25 * reference_bf16_error(hf, tokens) + 0.02
    assert 0 < ours <= bound, f"bf16 relative logit error {ours:.4f} > bound {bound:.4f}"


@pytest.mark.slow
def test_bf16_smollm2_gguf_stays_within_the_references_bf16_error(smollm2_files, smollm2_hf):
    tokens = [1, 504, 3458, 282, 260, 1345, 28, 19, 422, 2165, 314, 253, 1976, 30, 216, 2]
    half = make_runner(smollm2_files.path, dtype="bfloat16")
    full = make_runner(smollm2_files.path, dtype="float32")
    ours = relative_error(forced_logits(half, tokens, 12), forced_logits(full, tokens, 12))
    bound = 1.25 * reference_bf16_error(smollm2_hf, tokens) + 0.02
    assert 0 < ours <= bound, f"bf16 relative logit error {ours:.4f} > bound {bound:.4f}"


def test_a_step_leaves_no_tensor_off_the_runners_device(checkpoints):
    path, _ = checkpoints("deepseek_v32")
    runner = make_runner(path, decode_graphs="replay", max_num_seqs=2)
    driver = PlanDriver(runner)
    first = driver.step({"a": list(range(3, 14)), "b": [5, 6]})
    driver.greedy(first, 2)                                           # graphed decode steps
    input_ids, meta, rows = runner._prepare_inputs(driver.plan({"a": [7]}))
    inputs = [("input_ids", input_ids), ("logits_rows", rows)] + [
        (name, getattr(meta, name)) for name in ("slot_mapping", "positions", "query_start_loc", "seq_lens",
                                                 "block_tables")]
    assert runner.tensors_off_device(*inputs) == []
    names = {name for name, _ in runner.named_tensors()}
    num_layers = len(runner.model.attention_layers())
    assert {f"cache.{i}.{j}" for i in range(num_layers) for j in (0, 1)} <= names   # latent + indexer caches
    assert {"graphs.incoming", "graphs.tables"} <= names
    layer = runner.model.attention_layers()[1]                         # the walk reaches the caches
    layer.kv_cache = (layer.latent_cache.to("meta"), layer.indexer.k_cache)
    assert runner.tensors_off_device() == ["cache.1.0: meta"]


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_next"])
def test_decode_graphs_give_the_eager_tokens(checkpoints, arch):
    """Padded decode batches replayed from fixed buffers (the CPU stand-in of CUDA graphs: same
    padding, layout, size choice and slicing, run under the host-sync guard) == eager steps, for
    every model family (Qwen3-Next: recurrent states at fixed slots, padded rows on the scratch
    slot); a batch above the largest captured size runs eagerly in the same runner."""
    path, _ = checkpoints(arch)
    runs = {}
    for mode in ("off", "replay"):
        runner = make_runner(path, decode_graphs=mode, max_num_seqs=4)
        driver = PlanDriver(runner, seed=2)
        prompts = {"a": list(range(3, 14)), "b": [5, 6], "c": [9, 8, 7, 6, 5]}
        first = driver.step({"a": prompts["a"][:6], "b": prompts["b"], "c": prompts["c"]})
        first.update(driver.step({"a": prompts["a"][6:]}))
        tokens, logits = driver.greedy(first, 5)                      # 3 sequences: padded to 4
        driver.finish("a", "b", "c")                                  # (their state slots, for Qwen3-Next)
        more = driver.greedy({f"x{i}": logits["a"][-1] for i in range(5)}, 1)   # 5 new ones: eager
        runs[mode] = tokens, logits, more[0]
        assert (runner.graphs is not None) == (mode == "replay")
    assert runs["off"][0] == runs["replay"][0]
    for req in ("a", "b", "c"):
        torch.testing.assert_close(runs["replay"][1][req], runs["off"][1][req], atol=1e-4, rtol=1e-4)
    assert runs["off"][2] == runs["replay"][2]


def test_fp8_weights_kept_in_fp8_give_the_dequantized_logits(checkpoints, tmp_path):
    """The GPU path's FP8 storage (block-scaled weights, the FP8 linear kernel; its torch reference
    on CPU) == the CPU path's load-time dequantization."""
    from shardserve.workers.checkpoint import open_checkpoint
    from shardserve.workers.weight_loader import build_model

    path, _ = checkpoints("deepseek_v32")
    fp8 = write_fp8_checkpoint(path, tmp_path / "fp8", (32, 32))
    dequantized = make_runner(fp8)
    kept = make_runner(fp8)
    kept.model, _ = build_model(kept.hf_config, open_checkpoint(fp8), keep_fp8=True, progress=False)
    kept.allocate_kv_cache(kept.num_blocks)
    fp8_layers = [name for name, p in kept.model.named_parameters() if p.dtype == torch.float8_e4m3fn]
    assert any("q_b_proj" in n for n in fp8_layers) and any("o_proj" in n for n in fp8_layers)
    assert any(n.endswith("experts.w13_weight") for n in fp8_layers)        # routed experts too
    assert not any("kv_b_proj" in n for n in fp8_layers)              # absorbed decode reads it directly
    tokens = torch.randint(2, 120, (14,), generator=torch.Generator().manual_seed(5)).tolist()
    torch.testing.assert_close(forced_logits(kept, tokens, 10), forced_logits(dequantized, tokens, 10),
                               atol=1e-4, rtol=1e-4)


def test_device_and_dtype_rules():
    from shardserve.workers.device import resolve_device, resolve_dtype

    assert resolve_device("auto", num_gpus=0) == "cpu" and resolve_device("auto", num_gpus=2) == "cuda"
    with pytest.raises(ValueError, match="--device cuda: no CUDA GPU is visible"):
        resolve_device("cuda", num_gpus=0)
    assert resolve_dtype("auto", "cuda") == torch.bfloat16 and resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("float16", "cpu") == torch.float16


@pytest.mark.parametrize("limit, current, stat, expected_gib", [
    (None, None, None, 20),                                        # no cgroup: MemAvailable
    ("max", 30, "active_file 0\n", 20),                             # no limit set
    (24, 23.5, "anon 3\nactive_file 12\ninactive_file 8.5\n", 20),  # page cache fills the limit: reclaimable
    (24, 23.5, "anon 23\nactive_file 0.25\ninactive_file 0.25\n", 1),  # anonymous memory does not come back
    (24, 20, None, 4),                                             # no memory.stat: max - current
])
def test_host_memory_available_counts_the_cgroups_page_cache(tmp_path, limit, current, stat, expected_gib):
    from shardserve.workers.device import GIB, host_memory_available

    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    cgroup.mkdir()
    (proc / "meminfo").write_text(f"MemTotal: {32 * GIB // 1024} kB\nMemAvailable: {20 * GIB // 1024} kB\n")
    gib = lambda value: str(int(float(value) * GIB))  # noqa: E731
    if limit is not None:
        (cgroup / "memory.max").write_text("max\n" if limit == "max" else gib(limit) + "\n")
        (cgroup / "memory.current").write_text(gib(current) + "\n")
    if stat is not None:
        (cgroup / "memory.stat").write_text("".join(f"{key} {gib(value)}\n" for key, value in
                                                    (line.split() for line in stat.splitlines())))
    assert host_memory_available(str(proc), str(cgroup)) == expected_gib * GIB
