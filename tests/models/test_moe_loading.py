"""Stacked routed-expert weights (``FusedExperts``) read from the per-expert checkpoint layout.

transformers' ``save_pretrained`` writes ``mlp.experts.{e}.{gate,up,down}_proj.weight``; the engine
keeps ``w13_weight [E_local, 2I, H]`` / ``w2_weight [E_local, H, I]`` for :func:`kernels.fused_moe`.
The oracle is the safetensors file itself, read with ``safetensors.torch.load_file``.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from plan_driver import make_runner
from shardserve.workers.checkpoint import CheckpointError, SafetensorsCheckpoint
from shardserve.workers.models.moe import FusedExperts
from shardserve.workers.weight_loader import checkpoint_sources

LAYER = "model.layers.1.mlp.experts"       # layer 1 is an MoE layer in every tiny config


def _load(experts: FusedExperts, path) -> None:
    """Fill ``experts`` as the weight loader does, under the checkpoint name of layer 1."""
    ckpt = SafetensorsCheckpoint(path)
    for name, param in experts.named_parameters():
        for ckpt_name, shard_id in checkpoint_sources(experts, f"{LAYER}.{name}", ckpt, param):
            param.weight_loader(param, ckpt.require(ckpt_name), shard_id)


def test_rank_reads_exactly_its_experts(tiny_model):
    """A rank holding experts 2..4 of 8 gets their gate/up/down weights, stacked in order."""
    tiny = tiny_model("deepseek_v32")
    config = tiny.hf.config
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    experts = FusedExperts(hidden, inter, (2, 3), torch.float32)
    _load(experts, tiny.path)
    tensors = load_file(str(tiny.path / "model.safetensors"))
    for local, expert in enumerate(range(2, 5)):
        prefix = f"{LAYER}.{expert}"
        assert torch.equal(experts.w13_weight[local, :inter], tensors[f"{prefix}.gate_proj.weight"])
        assert torch.equal(experts.w13_weight[local, inter:], tensors[f"{prefix}.up_proj.weight"])
        assert torch.equal(experts.w2_weight[local], tensors[f"{prefix}.down_proj.weight"])


def test_experts_of_other_ranks_contribute_nothing(tiny_model):
    """Routing to experts outside this rank's range adds zero; inside, it equals the per-expert math."""
    tiny = tiny_model("deepseek_v32")
    config = tiny.hf.config
    experts = FusedExperts(config.hidden_size, config.moe_intermediate_size, (2, 3), torch.float32)
    _load(experts, tiny.path)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, config.hidden_size, generator=gen)
    ids = torch.tensor([[0, 3], [5, 7], [2, 4], [1, 6]])       # rows 1 and 3: no local expert
    weights = torch.rand(4, 2, generator=gen)
    out = experts(hidden, weights, ids)
    tensors = load_file(str(tiny.path / "model.safetensors"))

    def expert_mlp(e: int, x: torch.Tensor) -> torch.Tensor:
        p = f"{LAYER}.{e}"
        gate, up = x @ tensors[f"{p}.gate_proj.weight"].T, x @ tensors[f"{p}.up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ tensors[f"{p}.down_proj.weight"].T

    expected = torch.zeros_like(hidden)
    expected[0] = weights[0, 1] * expert_mlp(3, hidden[0])
    expected[2] = weights[2, 0] * expert_mlp(2, hidden[2]) + weights[2, 1] * expert_mlp(4, hidden[2])
    assert (out - expected).abs().max().item() < 1e-5
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[3], torch.zeros_like(out[3]))


def _broken_copy(src, dst, edit) -> None:
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_missing_expert_tensor_is_named(tiny_model, tmp_path):
    tiny = tiny_model("deepseek_v32")
    name = f"{LAYER}.5.up_proj.weight"
    _broken_copy(tiny.path, tmp_path / "ckpt", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=re.escape(name)):
        make_runner(tmp_path / "ckpt")


def test_wrong_expert_shape_is_named(tiny_model, tmp_path):
    tiny = tiny_model("deepseek_v32")
    name = f"{LAYER}.3.down_proj.weight"

    def transpose(tensors):
        tensors[name] = tensors[name].T.contiguous()

    _broken_copy(tiny.path, tmp_path / "ckpt", transpose)
    with pytest.raises(CheckpointError, match=re.escape(name) + ".*expected"):
        make_runner(tmp_path / "ckpt")
