"""Every public op routes to its Triton launcher or its reference as ``use_triton`` decides."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardserve import kernels

# public name -> (reference module, reference name, Triton module, Triton name)
OPS = {
    "rms_norm": ("shardserve.kernels.norm", "rms_norm_ref", "shardserve.kernels.norm_triton", "rms_norm_triton"),
    "apply_rotary": ("shardserve.kernels.rotary", "apply_rotary_ref", "shardserve.kernels.rotary_triton", "apply_rotary_triton"),
    "silu_and_mul": ("shardserve.kernels.activation", "silu_and_mul_ref", "shardserve.kernels.activation_triton", "silu_and_mul_triton"),
    "store_kv": ("shardserve.kernels.paged_attention", "store_kv_ref", "shardserve.kernels.paged_attention_triton", "store_kv_triton"),
    "store_cache": ("shardserve.kernels.paged_attention", "store_cache_ref", "shardserve.kernels.paged_attention_triton",
                    "store_cache_triton"),
    "paged_attention": ("shardserve.kernels.paged_attention", "paged_attention_ref", "shardserve.kernels.paged_attention_triton",
                        "paged_attention_triton"),
    "mla_attention": ("shardserve.kernels.mla_attention", "mla_attention_ref", "shardserve.kernels.mla_attention_triton",
                      "mla_attention_triton"),
    "indexer_scores": ("shardserve.kernels.indexer", "indexer_scores_ref", "shardserve.kernels.indexer_triton", "indexer_scores_triton"),
    "fused_moe": ("shardserve.kernels.fused_moe", "fused_moe_ref", "shardserve.kernels.fused_moe_triton", "fused_moe_triton"),
    "hadamard_transform": ("shardserve.kernels.hadamard", "hadamard_transform_ref", "shardserve.kernels.hadamard_triton",
                           "hadamard_transform_triton"),
    "fp8_block_linear": ("shardserve.kernels.fp8_linear", "fp8_block_linear_ref", "shardserve.kernels.fp8_linear_triton",
                         "fp8_block_linear_triton"),
}


@pytest.mark.parametrize("mode,expect", [(None, "ref"), ("torch", "ref"), ("triton", "triton")],
                         ids=["cpu-default", "forced-torch", "forced-triton"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_public_op_dispatch(op, mode, expect, monkeypatch):
    ref_module, ref_name, triton_module, triton_name = OPS[op]
    calls = []
    monkeypatch.setattr(importlib.import_module(ref_module), ref_name, lambda *a, **k: calls.append("ref"))
    monkeypatch.setattr(importlib.import_module(triton_module), triton_name, lambda *a, **k: calls.append("triton"))
    if mode is None:
        monkeypatch.delenv("SHARDSERVE_KERNELS", raising=False)
    else:
        monkeypatch.setenv("SHARDSERVE_KERNELS", mode)
    x = torch.zeros(2, 4)  # a CPU tensor: the dispatcher only looks at the first argument's device
    public = getattr(kernels, op)
    required = [p for p in inspect.signature(public).parameters.values() if p.default is p.empty]
    public(*[x] * len(required))
    assert calls == [expect]


def test_unknown_kernel_mode_raises(monkeypatch):
    monkeypatch.setenv("SHARDSERVE_KERNELS", "cuda")
    with pytest.raises(ValueError, match="SHARDSERVE_KERNELS"):
        kernels.use_triton(torch.zeros(1))


def test_importing_kernels_does_not_import_triton():
    """TRITON_INTERPRET must be settable after ``import kernels`` (workers import it first)."""
    code = "import sys, kernels; assert 'triton' not in sys.modules, 'kernels imported triton'"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_triton_on_cpu_without_interpreter_fails_clearly(monkeypatch):
    from shardserve.kernels.triton_utils import check_launchable

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="need CUDA tensors"):
        check_launchable(torch.zeros(1))
