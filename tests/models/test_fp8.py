"""FP8 block-scaled checkpoints: dequantized at load == transformers on the dequantized weights."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from plan_driver import PlanDriver, hf_logits, make_runner
from tiny_checkpoints import ARCHS, dequantize_reference, load_hf_model, quantize_block_fp8, write_fp8_checkpoint
from shardserve.workers.checkpoint import CheckpointError, SafetensorsCheckpoint
from shardserve.workers.fp8 import Fp8DequantCheckpoint, dequantizing_checkpoint
from shardserve.workers.weight_loader import checkpoint_sources

BLOCK = (32, 32)   # small blocks so the tiny weights span several, with partial edge blocks


@pytest.fixture(scope="module")
def fp8_models(tiny_model, tmp_path_factory):
    """``arch -> (fp8 folder, transformers model on the dequantized weights, original tiny model)``."""
    cache = {}

    def get(arch):
        if arch not in cache:
            tiny = tiny_model(arch)
            root = tmp_path_factory.mktemp(f"{arch}_fp8")
            fp8 = write_fp8_checkpoint(tiny.path, root / "fp8", BLOCK, dequantized_dst=root / "dequantized")
            cache[arch] = fp8, load_hf_model(root / "dequantized"), tiny
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_checkpoint_matches_dequantized_reference(fp8_models, arch):
    """Logits (prefill + 8 greedy steps) == transformers on the dequantized weights, and every
    loaded weight is within FP8 e4m3 rounding of the original unquantized one."""
    fp8_path, hf_dequantized, tiny = fp8_models(arch)
    prompt = torch.randint(2, 128, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    runner = make_runner(fp8_path)
    driver = PlanDriver(runner)
    prefill = driver.step_all_rows({"a": prompt})["a"]
    generated, decode = driver.greedy({"a": prefill[-1]}, 8)
    ours = torch.cat((prefill, decode["a"]))
    assert (ours - hf_logits(hf_dequantized, prompt + generated["a"][:-1])).abs().max().item() < 1e-4

    original = load_file(str(tiny.path / "model.safetensors"))
    quantized = load_file(str(fp8_path / "model.safetensors"))
    checked = 0
    for name, param in runner.model.named_parameters():
        sources = [src for src, _ in checkpoint_sources(runner.model, name, SafetensorsCheckpoint(tiny.path), param)]
        if not all(quantized[src].dtype == torch.float8_e4m3fn for src in sources):
            continue
        reference = torch.cat([original[src] for src in sources])
        param = param.reshape(reference.shape)          # stacked experts [E, rows, cols] -> [E * rows, cols]
        scales = torch.cat([quantized[src.replace("weight", "weight_scale_inv")]
                            .repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[:original[src].shape[0],
                                                                                           :original[src].shape[1]]
                            for src in sources])
        # e4m3 rounding: half an ulp = 2^-4 relative for normals, 2^-10 * scale for subnormals.
        bound = reference.abs() * 2.0 ** -4 + scales * 2.0 ** -10 + 1e-7
        assert ((param - reference).abs() <= bound).all(), name
        assert not torch.equal(param, reference), f"{name} was not quantized"
        checked += 1
    assert checked >= 5, checked


def test_fp8_slices_match_full_dequantization(fp8_models):
    """Row/column windows (what a TP rank reads) at offsets inside a block == the full weight's."""
    fp8_path, _, _ = fp8_models("deepseek_v32")
    config = SimpleNamespace(**json.loads((fp8_path / "config.json").read_text()))
    ckpt = dequantizing_checkpoint(SafetensorsCheckpoint(fp8_path), config)
    assert isinstance(ckpt, Fp8DequantCheckpoint) and ckpt.block_size == BLOCK
    raw = load_file(str(fp8_path / "model.safetensors"))
    name = "model.layers.1.self_attn.q_b_proj.weight"            # [4 heads * 32, 48]
    full = dequantize_reference(raw[name], raw[name.replace("weight", "weight_scale_inv")], BLOCK)
    tensor = ckpt.require(name)
    assert torch.equal(tensor.load(), full)
    for rows, cols in [(slice(40, 104), slice(None)), (slice(0, 128), slice(5, 47)), (slice(96, 128), slice(31, 33))]:
        assert torch.equal(tensor[rows, cols], full[rows, cols]), (rows, cols)
    assert torch.equal(tensor[7], full[7])


def test_quantize_roundtrip_error_is_small():
    weight = torch.randn(70, 45)
    quant, scale = quantize_block_fp8(weight, BLOCK)
    assert quant.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    relative = (dequantize_reference(quant, scale, BLOCK) - weight).abs().max() / weight.abs().max()
    assert relative < 0.07   # e4m3 has 3 mantissa bits


def _rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_wrong_scale_shape_is_a_clear_checkpoint_error(fp8_models, tmp_path):
    fp8_path, _, _ = fp8_models("deepseek_v32")
    scale_name = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"

    def corrupt(tensors):
        tensors[scale_name] = tensors[scale_name][:, :-1].contiguous() if tensors[scale_name].shape[1] > 1 \
            else torch.ones(tensors[scale_name].shape[0], 2)

    bad = _rewrite(fp8_path, tmp_path / "bad", corrupt)
    with pytest.raises(CheckpointError) as info:
        make_runner(bad)
    message = str(info.value)
    assert str(bad / "model.safetensors") in message and scale_name in message and "expected" in message


def test_fp8_weight_without_scale_is_a_checkpoint_error(fp8_models, tmp_path):
    fp8_path, _, _ = fp8_models("deepseek_v32")
    scale_name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    bad = _rewrite(fp8_path, tmp_path / "noscale", lambda tensors: tensors.pop(scale_name))
    with pytest.raises(CheckpointError, match="o_proj.weight.*has no"):
        make_runner(bad)
