"""The plan against what a runner really allocates, on tiny checkpoints on CPU.

- Loading allocates, outside the checkpoint readers, exactly the final weight bytes: the model is
  built on the meta device with its final formats decided and each parameter allocated once
  (a TorchDispatchMode counts the storage bytes torch ops create: ``alloc_tracker.py``).
- The plan's weight bytes by format, cache bytes per token and KV blocks equal the loaded runner's,
  for every family, FP8 kept, packed GGUF and TP=2 ranks.
- The activation reserve (``workers/activation.py``) bounds the storage bytes a real step creates,
  for every family, at prefill, decode and mixed shapes, in float32 and bfloat16 (torch path).
- ``serve``'s start-up plan (what a rank logs) equals ``shardserve plan``'s for the same arguments.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from alloc_tracker import StorageTracker  # noqa: E402
from test_packed_model import tiny_gguf  # noqa: E402,F401 (fixture)
from test_checkpoint import TINY  # noqa: E402
from tiny_checkpoints import write_fp8_checkpoint, write_tiny_checkpoint, write_tiny_llama  # noqa: E402

from shardserve.workers.activation import StepShape, step_activation_bytes  # noqa: E402
from shardserve.workers.checkpoint import open_checkpoint  # noqa: E402
from shardserve.workers.memory_profile import run_step  # noqa: E402
from shardserve.workers.model_runner import ModelRunner, RunnerConfig, allocate_caches  # noqa: E402
from shardserve.workers.model_source import ModelFiles, load_config  # noqa: E402
from shardserve.workers.plan import PlanConfig, as_rank, plan_rank, plan_replica  # noqa: E402
from shardserve.workers.weight_loader import build_meta_model, build_model, weight_bytes_by_format  # noqa: E402

BLOCK = 4
# Host-side work of a load: checkpoint reads, FP8 dequantization, integer forms, the RoPE table's
# computation (on a GPU rank all of it happens on the host; only its results are copied over).
STAGING = ("workers/checkpoint.py", "workers/fp8.py", "workers/quantization.py", "layers/rotary.py", "safetensors")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            path = tmp_path_factory.mktemp(arch)
            write_tiny_llama(path, tokenizer=True) if arch == "llama" else write_tiny_checkpoint(arch, path,
                                                                                                 tokenizer=True)
            cache[arch] = path
        return cache[arch]

    return get


def runner(path: Path, **config) -> ModelRunner:
    files = ModelFiles(path.name, path)
    return ModelRunner(files, load_config(files), RunnerConfig(**{"block_size": BLOCK, **config}), progress=False)


def test_loading_allocates_only_the_final_weight_bytes(checkpoints, tmp_path):
    """A tiny DeepSeek-V3.2 FP8 checkpoint, FP8 kept (the GPU path) on CPU: the storage bytes torch
    ops create outside the host-side readers peak at exactly the weight bytes the model ends with."""
    fp8 = write_fp8_checkpoint(checkpoints("deepseek_v32"), tmp_path / "fp8", (32, 32))
    config = load_config(ModelFiles("fp8", fp8))
    planned = weight_bytes_by_format(build_meta_model(config, open_checkpoint(fp8), dtype=torch.bfloat16,
                                                      keep_fp8=True))
    with StorageTracker(staging=STAGING) as tracker:
        model, weight_bytes = build_model(config, open_checkpoint(fp8), dtype=torch.bfloat16, progress=False,
                                          keep_fp8=True)
    assert weight_bytes_by_format(model) == planned and planned["float8_e4m3fn"] > planned["bfloat16"]
    assert tracker.peak == weight_bytes == sum(planned.values()), (tracker.peak, weight_bytes)
    assert 0 < tracker.staging_peak < weight_bytes   # one tensor's read / dequantization at a time


@pytest.mark.parametrize("arch, config", [
    ("llama", {"num_blocks": None, "kv_cache_bytes": 1 << 20, "decode_graphs": "replay"}),
    ("deepseek_v32", {"num_blocks": None, "kv_cache_bytes": 1 << 20}),
    ("qwen3_next", {"num_blocks": None, "kv_cache_bytes": 1 << 22, "max_num_seqs": 4}),
])
def test_plan_equals_what_the_runner_holds(checkpoints, arch, config):
    run = runner(checkpoints(arch), **config)
    plan = run.plan
    run.allocate_kv_cache(run.max_num_blocks())
    assert plan.weight_bytes == run.weight_bytes and plan.weight_bytes_by_dtype == weight_bytes_by_format(run.model)
    assert plan.bytes_per_token * BLOCK == run.bytes_per_block and plan.state_bytes == run.state_bytes
    assert run.num_blocks == plan.kv_blocks and run.cache_bytes == ((plan.kv_blocks + plan.scratch_blocks)
                                                                     * run.bytes_per_block + plan.state_bytes)
    graph_buffers = sum(t.numel() * t.element_size() for _, t in run.graphs.named_tensors()) if run.graphs else 0
    assert plan.graph_bytes == graph_buffers   # the replay stand-in keeps its buffers, no pool
    assert plan.buffer_bytes == sum(b.numel() * b.element_size() for b in run.model.buffers())


def test_plan_of_packed_gguf_and_tensor_parallel_ranks(tiny_gguf, checkpoints):  # noqa: F811
    """Packed int4 / int8 layers planned from GGUF metadata (with and without their dense copies),
    and every rank of a TP=2 split, equal the models the loader builds."""
    from transformers import LlamaConfig

    from shardserve.workers.quantization import WeightFormat

    config, totals = LlamaConfig(**TINY), []
    for dense_rows in (0, 16):
        fmt = WeightFormat(torch.bfloat16, dense_rows=dense_rows)
        planned = weight_bytes_by_format(build_meta_model(config, open_checkpoint(tiny_gguf), dtype=torch.bfloat16,
                                                          weight_format=fmt))
        model, weight_bytes = build_model(config, open_checkpoint(tiny_gguf), dtype=torch.bfloat16, progress=False,
                                          weight_format=fmt)
        copies = {"int4 dense copies", "int8 dense copies"} if dense_rows else set()
        assert planned == weight_bytes_by_format(model) and set(planned) == {"int4", "int8", "bfloat16"} | copies
        assert sum(planned.values()) == weight_bytes
        totals.append(weight_bytes)
    dense = sum(m.packed.dense.numel() * 2 for m in model.modules() if getattr(m, "packed", None) is not None
                and m is not model.lm_head)   # the tied head shares its embedding's packed weight
    assert totals[1] - totals[0] == dense == planned["int4 dense copies"] + planned["int8 dense copies"] > 0
    with StorageTracker(staging=STAGING) as tracker:   # the GGUF path dequantized (a GPU rank's): no transient
        _, weight_bytes = build_model(config, open_checkpoint(tiny_gguf), dtype=torch.bfloat16, progress=False)
    assert tracker.peak == weight_bytes
    path = checkpoints("deepseek_v32")
    hf_config = load_config(ModelFiles(path.name, path))
    plan_config = PlanConfig(tensor_parallel_size=2, device="cpu", kv_cache_bytes=1 << 20, block_size=BLOCK,
                             max_model_len=256, decode_graphs="off")
    replica = plan_replica(hf_config, open_checkpoint(path), plan_config, torch.float32, tensor_split=[3, 1])
    for rank in (0, 1):
        with as_rank(rank, 2):
            model, weight_bytes = build_model(hf_config, open_checkpoint(path), tensor_split=[3, 1], progress=False)
            expected = plan_rank(model, plan_config, rank)
        assert replica.ranks[rank].weight_bytes == weight_bytes == expected.weight_bytes
        assert replica.ranks[rank].kv_blocks == expected.kv_blocks
    assert replica.ranks[0].weight_bytes > replica.ranks[1].weight_bytes   # 3 heads / experts against 1


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), ("llama", "bfloat16"), ("deepseek_v32", "bfloat16"),
                                         ("glm_moe_dsa", "float32"), ("deepseek_v3", "bfloat16"),
                                         ("qwen3_next", "float32")])
def test_activation_reserve_bounds_a_real_step(checkpoints, arch, dtype, monkeypatch):
    """A prefill chunk at the end of the context (the profile's shape), a decode batch and a mixed
    batch: the storage bytes the step creates never exceed the reserve, and the reserve stays
    within 2.5x of them. (Contexts of 96 tokens: past the tiny DSA top-k of 8, so it selects.) On the
    torch ops: the reserve bounds them, where a small bf16 decode step's C attention
    (``kernels/cpu_attention.py``) creates only its output and ~4x less in all."""
    monkeypatch.setenv("SHARDSERVE_KERNELS", "torch")
    run = runner(checkpoints(arch), num_blocks=8, dtype=dtype)
    for shape in (StepShape.prefill(64, 96, 4), StepShape.decode(4, 96), StepShape(24, 3, 8, 96, 3)):
        with StorageTracker() as tracker:
            run_step(run.model, run.device, shape, BLOCK, lambda layers, n: allocate_caches(layers, n, BLOCK))
        reserve = step_activation_bytes(run.model, shape, triton=False, block_size=BLOCK)
        assert tracker.peak <= reserve <= 2.5 * tracker.peak, (shape, tracker.peak, reserve)


def test_serve_logs_the_plan_that_plan_prints(checkpoints, caplog, capsys):
    """The single-process engine (``serve``'s runner code) logs its start-up plan; ``shardserve
    plan`` with the same arguments prints the same numbers (the host memory available, CPU ranks'
    capacity, moves between the two and is left out)."""
    from shardserve.cluster.cli import main
    from shardserve.cluster.config import EngineArgs
    from shardserve.cluster.llm import LLM

    path = checkpoints("deepseek_v32")
    args = ["--device", "cpu", "--kv-cache-gib", "0.004", "--max-model-len", "128", "--max-num-seqs", "4",
            "--dtype", "bfloat16", "--max-num-batched-tokens", "32"]
    with caplog.at_level(logging.INFO, logger="shardserve.workers.model_runner"):
        LLM(EngineArgs(model=str(path), device="cpu", kv_cache_gib=0.004, max_model_len=128, max_num_seqs=4,
                       dtype="bfloat16", max_num_batched_tokens=32), progress=False)
    logged = [r.getMessage().removeprefix("plan: ") for r in caplog.records if r.getMessage().startswith("plan: ")]
    assert main(["plan", str(path), *args, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["ranks"][0]["summary"]
    usable = re.compile(r"\(cpu, [0-9.]+ [GM]iB usable of [0-9.]+ [GM]iB\)")
    assert len(logged) == 1 and usable.sub("", logged[0]) == usable.sub("", printed), (logged, printed)
    assert "KV budget 4.10 MiB = " in printed and "bytes/token" in printed
    assert main(["plan", str(path), *args]) == 0   # the table: every quantity a row, ranks as columns
    table = capsys.readouterr().out
    for label in ("weights", "bfloat16", "float32", "KV bytes/token", "indexer bytes/token", "draft bytes/token",
                  "activation reserve", "graph reserve", "KV budget", "KV blocks", "KV tokens", "sequences of 128",
                  "rank 0", "fits"):
        assert label in table, label
