"""No host sync and no data-dependent shape in any decode forward a CUDA graph captures, for every
model family and the MTP draft module, on both kernel paths (the torch references, and the Triton
kernels run by the interpreter: the ops CUDA would run).

The oracle is :func:`workers.sync_guard.no_host_sync`, a ``TorchDispatchMode`` that raises on
``.item()`` / ``.tolist()`` / ``bool(tensor)``, ``nonzero`` / ``torch.where(cond)``, boolean-mask
indexing, ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``, a Python number
written into one element (a host-to-device copy); the first test
shows it catches each of them. On f264366 the decode forwards fail it (``bincount`` in the MoE
alignment, ``torch.where(cond)`` in the MoE reference, ``nonzero`` in the recurrent reference).
Tiny shapes: the prefill runs on the torch path, only the decode step is interpreted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from plan_driver import PlanDriver, make_runner  # noqa: E402
from tiny_checkpoints import write_tiny_checkpoint, write_tiny_llama  # noqa: E402

from shardserve.workers.forward_context import forward_context  # noqa: E402
from shardserve.workers.sync_guard import HostSyncError, no_host_sync  # noqa: E402

FAMILIES = ["llama", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_next"]
# One layer of each kind is enough (the interpreter is slow): Qwen3-Next one DeltaNet + one attention layer.
OVERRIDES = {"qwen3_next": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                mlp_only_layers=[], decoder_sparse_step=1),
             "deepseek_v3": dict(num_hidden_layers=2)}

x = torch.arange(6.0)
FORBIDDEN = {
    "item": lambda: x.sum().item(), "bool": lambda: bool(x[0] > 0), "tolist": lambda: x.tolist(),
    "cpu": lambda: x.cpu(), "nonzero": lambda: x.nonzero(), "where(cond)": lambda: torch.where(x > 2),
    "mask index": lambda: x[x > 2], "mask assign": lambda: x.clone().__setitem__(x > 2, 0.0),
    "unique": lambda: x.unique(), "bincount": lambda: torch.bincount(x.long()),
    "repeat_interleave": lambda: x.repeat_interleave(torch.ones(6, dtype=torch.long)),
    "host list": lambda: torch.tensor([1, 2]), "masked_select": lambda: x.masked_select(x > 2),
    "argwhere": lambda: torch.argwhere(x), "equal": lambda: torch.equal(x, x),
    "element assign": lambda: x.clone().__setitem__(2, 0),   # moe_align's `padded[E] = 0` failed capture on an H200
}


@pytest.mark.parametrize("inference", [True, False], ids=["inference_mode", "grad_mode"])
@pytest.mark.parametrize("name", list(FORBIDDEN))
def test_the_guard_catches_each_host_sync(name, inference):
    """(Inference mode dispatches some composite ops undecomposed: ``aten.item``, ``aten.where``.)"""
    with torch.inference_mode(inference), pytest.raises(HostSyncError):
        with no_host_sync():
            FORBIDDEN[name]()
    with torch.inference_mode(inference), no_host_sync():   # the sync-free forms pass
        torch.where(x > 2, x, 0.0)
        x.repeat_interleave(torch.ones(6, dtype=torch.long), output_size=6)
        torch.zeros(3).scatter_add_(0, torch.zeros(6, dtype=torch.long), x)
        y = x.clone()
        y.narrow(0, 2, 1).zero_()
        y[3:4] = 0.0
        y[4] = x[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache = {}

    def get(arch: str, mtp: bool = False) -> Path:
        if (arch, mtp) not in cache:
            path = tmp_path_factory.mktemp(arch)
            if arch == "llama":
                write_tiny_llama(path)
            else:
                write_tiny_checkpoint(arch, path, seed=0, mtp=mtp, **OVERRIDES.get(arch, {}))
            cache[arch, mtp] = path
        return cache[arch, mtp]

    return get


@pytest.mark.slow   # 5-30 s each: the Triton interpreter
@pytest.mark.parametrize("arch", FAMILIES)
def test_decode_forward_has_no_host_sync(checkpoint, monkeypatch, arch):
    """One decode step of 3 sequences, on the torch references and then on the Triton kernels."""
    monkeypatch.setenv("SHARDSERVE_KERNELS", "torch")
    runner = make_runner(checkpoint(arch), block_size=4, num_blocks=32)
    driver = PlanDriver(runner)
    first = driver.step({"a": list(range(3, 12)), "b": [5, 6], "c": [7, 8, 9, 10]})
    plan = driver.plan({req: [int(logits.argmax())] for req, logits in first.items()})
    runner._apply_plan(plan)
    input_ids, meta, _ = runner._prepare_inputs(plan)
    for kernels in ("torch", "triton"):   # (a recurrent state advances twice: only the ops matter here)
        monkeypatch.setenv("SHARDSERVE_KERNELS", kernels)
        with torch.inference_mode(), forward_context(meta), no_host_sync(f"the {arch} decode forward ({kernels})"):
            hidden = runner.model(input_ids, meta.positions)
        assert hidden.shape == (3, runner.hf_config.hidden_size) and torch.isfinite(hidden).all()


def test_mtp_draft_forward_has_no_host_sync(checkpoint, monkeypatch):
    """The MTP module's forward on chained one-token entries (what drafting runs per step), on the
    torch references and then on the Triton kernels."""
    from shardserve.workers.checkpoint import open_checkpoint
    from shardserve.workers.draft_worker import draft_inputs
    from shardserve.workers.model_runner import allocate_caches
    from shardserve.workers.model_source import ModelFiles, load_config
    from shardserve.workers.models.mtp import build_mtp_model
    from shardserve.workers.step_inputs import DeviceStager

    monkeypatch.setenv("SHARDSERVE_KERNELS", "torch")
    path = checkpoint("deepseek_v32", mtp=True)
    config = load_config(ModelFiles(path.name, path))
    model, _ = build_mtp_model(config, open_checkpoint(path))
    allocate_caches(model.attention_layers(), 16, 4)
    stager, tables = DeviceStager(torch.device("cpu")), [[3, 5, 1], [7, 2]]
    hidden = torch.randn(13, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ids, meta = draft_inputs([0, 0], [9, 2], list(range(3, 14)), tables, 4, stager)
        with forward_context(meta):
            model(ids, meta.positions, hidden[:11])                                # the entries (prefill)
        ids, meta = draft_inputs([9, 2], [1, 1], [20, 21], tables, 4, stager)
        for kernels in ("torch", "triton"):
            monkeypatch.setenv("SHARDSERVE_KERNELS", kernels)
            with forward_context(meta), no_host_sync(f"the MTP draft forward ({kernels})"):
                out = model(ids, meta.positions, hidden[11:])
            assert out.shape == (2, config.hidden_size) and torch.isfinite(out).all()
