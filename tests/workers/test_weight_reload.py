"""Hot-swap of changed weights in the single-process engine (the same rank code the cluster runs):
a tiny DeepSeek-V3.2 checkpoint with DSA and an MTP layer, one tensor changed on disk at a time;
transformers on the changed files is the oracle. Refused checkpoints leave every byte in place."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.llm import LLM
from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.replica.weight_swap import InvalidCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_checkpoints import load_hf_model, write_tiny_checkpoint, write_tiny_llama  # noqa: E402

ARCH = "deepseek_v32"
PROMPT = [5, 17, 33, 60, 71, 90, 12, 44, 101, 7, 66, 23, 88, 3]   # 14 tokens > index_topk (8): DSA selects
NUM_TOKENS = 12


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny tensors: OpenMP fork/join would dominate
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("v32-reload")
    write_tiny_checkpoint(ARCH, path, seed=3, mtp=True, mtp_own_head=True, tokenizer=True)
    return path


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(EngineArgs(model=str(folder), block_size=4, num_blocks=64, speculative_tokens=2), progress=False)


def greedy_ids(llm) -> list[int]:
    (done,) = llm.generate([PROMPT], SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))
    return done.token_ids


def hf_greedy(folder) -> list[int]:
    model = load_hf_model(folder)
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def rewrite_tensor(folder: Path, name: str, change) -> None:
    """Replace tensor ``name`` of ``folder/model.safetensors`` by ``change(tensor)``."""
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def model_bytes(llm) -> dict[str, tuple[int, torch.Tensor]]:
    """Every parameter of the target and the draft model: (storage pointer, a copy of its values)."""
    params = list(llm.runner.model.named_parameters())
    params += [("mtp." + name, param) for name, param in llm.drafter.model.named_parameters()]
    return {name: (p.data_ptr(), p.detach().clone()) for name, p in params}


@pytest.mark.parametrize("tensor", [
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",    # every cached latent of layer 0
    "model.layers.1.self_attn.indexer.wk.weight",            # the DSA indexer keys of layer 1
    "model.layers.1.mlp.experts.5.down_proj.weight",         # one expert of the stacked MoE weights
    "model.layers.2.eh_proj.weight",                         # the MTP draft model
])
def test_one_changed_tensor_is_swapped_in_place_and_caches_are_dropped(llm, folder, tensor):
    before = greedy_ids(llm)
    hits = llm.core.block_manager.prefix_hits
    assert greedy_ids(llm) == before and llm.core.block_manager.prefix_hits > hits   # a prefix-cache hit
    params, version = model_bytes(llm), llm.weights_version
    rewrite_tensor(folder, tensor, lambda t: t * 1.5 + 0.01)

    result = llm.reload_weights()
    assert (result.changed_tensors, result.weights_version) == (1, version + 1)
    assert result.unchanged_tensors > 100
    after = model_bytes(llm)
    changed = [name for name in params if not torch.equal(params[name][1], after[name][1])]
    assert len(changed) == 1 and all(params[n][0] == after[n][0] for n in params)   # same storage
    hits = llm.core.block_manager.prefix_hits
    assert greedy_ids(llm) == hf_greedy(folder)   # greedy with MTP == plain greedy on the new weights
    assert llm.core.block_manager.prefix_hits == hits, "the old prefix cache must be gone"
    if "kv_a_proj" in tensor:
        assert greedy_ids(llm) != before   # so stale latents in the prefix cache would have shown


def test_unchanged_files_change_nothing(llm):
    version = llm.weights_version
    result = llm.reload_weights()
    assert result.changed_tensors == 0 and result.weights_version == version


def _truncated(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    os.truncate(file, file.stat().st_size - 1000)


def _other_architecture(src: Path, dst: Path) -> None:
    write_tiny_checkpoint("deepseek_v3", dst, seed=3, tokenizer=True)


def _other_vocab(src: Path, dst: Path) -> None:
    write_tiny_checkpoint(ARCH, dst, seed=3, mtp=True, mtp_own_head=True, tokenizer=True, vocab_size=130)


def _other_shape(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    rewrite_tensor(dst, "model.layers.1.mlp.gate.e_score_correction_bias", lambda t: torch.zeros(t.shape[0] + 1))


def _other_config(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (dst / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("make,message", [
    (_truncated, "tensor 'model."),
    (_other_architecture, "another architecture"),
    (_other_vocab, "vocab_size 130"),
    (_other_shape, "tensor 'model.layers.1.mlp.gate.e_score_correction_bias' has shape [9]"),
    (_other_config, "config field 'rms_norm_eps'"),
    (lambda src, dst: None, "no such file or folder"),
], ids=["truncated", "architecture", "vocab", "shape", "config", "missing"])
def test_a_bad_checkpoint_is_refused_and_nothing_changes(llm, folder, tmp_path, make, message):
    before, params, version = greedy_ids(llm), model_bytes(llm), llm.weights_version
    make(folder, tmp_path / "new")
    with pytest.raises(InvalidCheckpoint, match=message.replace("[", r"\[").replace("]", r"\]")):
        llm.reload_weights(str(tmp_path / "new"))
    after = model_bytes(llm)
    assert all(torch.equal(params[n][1], after[n][1]) and params[n][0] == after[n][0] for n in params)
    assert greedy_ids(llm) == before and llm.weights_version == version


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["smollm2_llm", "smollm2_llm_packed"])
def test_gguf_slices_digest_the_same_twice(engine, request):
    """GGUF reads (dequantized, Llama Q/K un-permuted; or kept packed, the CPU default) give the
    same digests on a second read, so a reload of unchanged GGUF files changes nothing (the
    rank-side half of a reload, without the coordinator's checks: each GGUF parse costs seconds)."""
    from shardserve.workers.weight_reload import ReadRecorder, stage_weights

    runner = request.getfixturevalue(engine).runner
    runner.checkpoint.reopen(runner.checkpoint.path)
    runner.checkpoint.observer = ReadRecorder()
    staged = stage_weights(runner.model, runner.checkpoint, runner.hf_config, runner.weight_record)
    assert not staged.changed and not staged.updates
    assert staged.read == set(runner.weight_record.shapes) and len(staged.read) == 272


def test_fp8_checkpoint_reload_equals_a_fresh_load(tmp_path):
    """FP8 block-scaled weights: digests cover the stored FP8 bytes and scales; a changed scale is
    one changed tensor, and the reloaded engine answers as one started on the new files."""
    from tiny_checkpoints import write_fp8_checkpoint

    write_tiny_checkpoint(ARCH, tmp_path / "bf16", seed=4, tokenizer=True)
    fp8 = write_fp8_checkpoint(tmp_path / "bf16", tmp_path / "fp8")
    for extra in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tmp_path / "bf16" / extra).is_file():
            shutil.copy(tmp_path / "bf16" / extra, fp8 / extra)
    args = dict(model=str(fp8), block_size=4, num_blocks=64)
    llm = LLM(EngineArgs(**args), progress=False)
    before = greedy_ids(llm)
    rewrite_tensor(fp8, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv", lambda t: 1.5 * t)
    result = llm.reload_weights()
    assert result.changed_tensors == 1
    after = greedy_ids(llm)
    assert after == greedy_ids(LLM(EngineArgs(**args), progress=False)) and after != before


@pytest.mark.parametrize("dense_rows", ["0", "2"])
def test_packed_weights_reload_equals_a_fresh_load(tmp_path, dense_rows):
    """``--quantization int8`` keeps the linear weights packed (no float parameter left): a changed
    tensor is read again through its layer's loader, packed again and copied into the same packed
    storage (with ``--packed-dense-rows``, its dense copy too: prefill runs on it); the result
    equals a fresh load of the changed files."""
    write_tiny_llama(tmp_path, seed=5, tokenizer=True, vocab_size=128)   # PROMPT ids < 128
    args = EngineArgs(model=str(tmp_path), block_size=4, num_blocks=64, quantization="int8",
                      packed_dense_rows=dense_rows)
    llm = LLM(args, progress=False)
    packed = {name: m.packed for name, m in llm.runner.model.named_modules() if getattr(m, "packed", None)}
    assert "model.layers.1.mlp.down_proj" in packed
    assert all((p.dense is not None) == (dense_rows != "0") for p in packed.values())
    before = {name: [(t.data_ptr(), t.clone()) for t in p.tensors()] for name, p in packed.items()}
    rewrite_tensor(tmp_path, "model.layers.1.mlp.down_proj.weight", lambda t: t * 1.5 + 0.01)

    result = llm.reload_weights()
    assert result.changed_tensors == 1
    changed = [name for name, p in packed.items()
               if any(not torch.equal(old, new) for (_, old), new in zip(before[name], p.tensors()))]
    assert changed == ["model.layers.1.mlp.down_proj"]
    assert all(ptr == new.data_ptr() for name, p in packed.items() for (ptr, _), new in zip(before[name], p.tensors()))
    assert greedy_ids(llm) == greedy_ids(LLM(args, progress=False))
