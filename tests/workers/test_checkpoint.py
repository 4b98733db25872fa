"""Checkpoint readers: every promised error names the file and tensor; GGUF types dequantize."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import save_file
from transformers import LlamaConfig

from shardserve.workers.checkpoint import CheckpointError, GGUFCheckpoint, SafetensorsCheckpoint, open_checkpoint, unpermute_llama_qk
from shardserve.workers.weight_loader import build_model

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)


def tiny_llama_tensors() -> dict[str, np.ndarray]:
    """GGUF-named float32 tensors of a 1-layer Llama (numpy shapes are torch shapes)."""
    rng = np.random.default_rng(0)
    h, inter, kv = TINY["hidden_size"], TINY["intermediate_size"], 16
    shapes = {"token_embd.weight": (64, h), "output_norm.weight": (h,), "blk.0.attn_norm.weight": (h,),
              "blk.0.attn_q.weight": (h, h), "blk.0.attn_k.weight": (kv, h), "blk.0.attn_v.weight": (kv, h),
              "blk.0.attn_output.weight": (h, h), "blk.0.ffn_norm.weight": (h,),
              "blk.0.ffn_gate.weight": (inter, h), "blk.0.ffn_up.weight": (inter, h), "blk.0.ffn_down.weight": (h, inter)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def write_gguf(path, tensors: dict[str, np.ndarray], raw_types: dict[str, QT] | None = None):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    for name, array in tensors.items():
        qtype = (raw_types or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"nope\.gguf: missing file"):
        open_checkpoint(tmp_path / "nope.gguf")
    with pytest.raises(CheckpointError, match="missing file"):
        open_checkpoint(tmp_path / "nothing-here")


def test_gguf_missing_tensor_named(tmp_path):
    tensors = tiny_llama_tensors()
    del tensors["blk.0.ffn_down.weight"]
    path = write_gguf(tmp_path / "m.gguf", tensors)
    with pytest.raises(CheckpointError, match=r"m\.gguf: missing tensor 'model\.layers\.0\.mlp\.down_proj\.weight'"):
        build_model(LlamaConfig(**TINY), GGUFCheckpoint(path), progress=False)


def test_gguf_wrong_shape_named(tmp_path):
    tensors = tiny_llama_tensors()
    tensors["blk.0.ffn_up.weight"] = np.zeros((40, 32), np.float32)
    path = write_gguf(tmp_path / "m.gguf", tensors)
    with pytest.raises(CheckpointError, match=r"m\.gguf: tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has shape \[40, 32\]"):
        build_model(LlamaConfig(**TINY), GGUFCheckpoint(path), progress=False)


def test_gguf_unsupported_quantization_named(tmp_path):
    # Q8_K: 292-byte blocks of 256 values, which the gguf package cannot dequantize.
    path = write_gguf(tmp_path / "m.gguf", {"blk.0.ffn_gate.weight": np.zeros((4, 292), np.uint8)},
                      {"blk.0.ffn_gate.weight": QT.Q8_K})
    ckpt = GGUFCheckpoint(path)
    with pytest.raises(CheckpointError, match=r"m\.gguf: tensor 'blk\.0\.ffn_gate\.weight' .*Q8_K"):
        ckpt.get("model.layers.0.mlp.gate_proj.weight").load()


def test_gguf_unknown_architecture(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba9")
    writer.add_tensor("token_embd.weight", np.zeros((2, 2), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(CheckpointError, match=r"x\.gguf: .*architecture 'mamba9'"):
        GGUFCheckpoint(tmp_path / "x.gguf")


def test_gguf_truncated_named(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tiny_llama_tensors())
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: .*truncated"):
        GGUFCheckpoint(cut)


@pytest.mark.parametrize("qtype,tol", [(QT.F32, 0), (QT.F16, 1e-3), (QT.BF16, 1e-2), (QT.Q8_0, 2e-2),
                                       (QT.Q4_0, 0.35), (QT.Q4_1, 0.3)])
def test_gguf_dequantizes_against_original(tmp_path, qtype, tol):
    """Quantize known floats with the gguf package, read them back through our reader."""
    x = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    if qtype == QT.F32:
        path = write_gguf(tmp_path / "q.gguf", {"output_norm.weight": x})
    else:
        path = write_gguf(tmp_path / "q.gguf", {"output_norm.weight": gguf.quants.quantize(x, qtype)},
                          {"output_norm.weight": qtype})
    got = GGUFCheckpoint(path).get("model.norm.weight").load()
    assert got.shape == (8, 256) and got.dtype == torch.float32
    assert np.abs(got.numpy() - x).max() <= tol


@pytest.mark.parametrize("qtype,block_bytes,scale_at", [(QT.Q4_K, 144, (0, 2)), (QT.Q6_K, 210, (208,))])
def test_gguf_k_quants_read_as_the_gguf_package_decodes(tmp_path, qtype, block_bytes, scale_at):
    """No K-quant encoder in gguf-py: random blocks (finite fp16 scales) must decode to exactly what
    gguf.quants.dequantize gives, in torch shape."""
    raw = np.random.default_rng(2).integers(0, 256, (4, block_bytes), dtype=np.uint8)
    for offset in scale_at:
        raw[:, offset:offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    path = write_gguf(tmp_path / "k.gguf", {"output_norm.weight": raw}, {"output_norm.weight": qtype})
    got = GGUFCheckpoint(path).get("model.norm.weight").load()
    expected = gguf.quants.dequantize(raw, qtype)
    assert got.shape == (4, 256)
    np.testing.assert_array_equal(got.numpy(), expected)


def test_unpermute_inverts_llama_cpp_permute():
    heads, head_dim, hidden = 3, 8, 5
    w = torch.randn(heads * head_dim, hidden)
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    permuted = w.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_llama_qk(permuted, heads), w)


def _save_tiny_safetensors(folder, drop=None):
    tensors = {"model.norm.weight": torch.ones(32), "model.embed_tokens.weight": torch.randn(64, 32)}
    tensors = {k: v for k, v in tensors.items() if k != drop}
    save_file(tensors, str(folder / "model.safetensors"))


def test_safetensors_missing_and_wrong_shape(tmp_path):
    _save_tiny_safetensors(tmp_path)
    ckpt = SafetensorsCheckpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"missing tensor 'lm_head\.weight'"):
        ckpt.require("lm_head.weight")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has shape \[32\], expected \[16\]"):
        ckpt.require("model.norm.weight", (16,))
    assert torch.equal(ckpt.get("model.embed_tokens.weight")[4:6], ckpt.get("model.embed_tokens.weight").load()[4:6])


def test_safetensors_truncated_and_missing_shard(tmp_path):
    _save_tiny_safetensors(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read .*truncated"):
        SafetensorsCheckpoint(tmp_path)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors: missing file"):
        SafetensorsCheckpoint(sharded)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors", "..", "",
                                  "link.safetensors", 7])
def test_index_shard_names_stay_in_the_checkpoint_folder(tmp_path, name):
    """Issue 27: an index cannot make the loader (or the reload check) open a file outside its folder,
    and the error is the same whether or not that file exists."""
    from shardserve.workers.checkpoint_compat import check_complete

    folder = tmp_path / "ckpt"
    folder.mkdir()
    _save_tiny_safetensors(tmp_path)                           # a real file outside the folder
    (tmp_path / "outside.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes())
    (folder / "link.safetensors").symlink_to(tmp_path / "model.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": name}}))
    for read in (SafetensorsCheckpoint, check_complete):
        with pytest.raises(CheckpointError, match="checkpoint folder"):
            read(folder)


def test_gguf_keeps_no_file_mapped_after_loading(tmp_path):
    """A loaded rank holds none of the GGUF file's pages: the reader (and its map of the whole
    file) is dropped when the checkpoint opens, and each tensor is mapped only while it is read
    (on SmolLM2 the kept reader held 93 MiB of file pages and 140 MiB of metadata objects)."""
    import gc

    path = write_gguf(tmp_path / "m.gguf", tiny_llama_tensors())

    def mapped() -> bool:
        return str(path) in open("/proc/self/maps").read()

    ckpt = GGUFCheckpoint(path)
    assert not mapped()
    model, _ = build_model(LlamaConfig(**TINY), ckpt, progress=False)
    gc.collect()
    assert not mapped()
    expected = torch.from_numpy(tiny_llama_tensors()["blk.0.ffn_up.weight"])
    torch.testing.assert_close(model.model.layers[0].mlp.gate_up_proj.weight[TINY["intermediate_size"]:], expected,
                               rtol=0, atol=0)


def test_gguf_metadata_is_parsed_once_per_process_and_file(tmp_path, monkeypatch):
    """Config, tokenizer and checkpoint of one GGUF file cost one full metadata parse
    (``gguf.GGUFReader``, through transformers' conversion) per process, and equal what transformers
    loads with ``gguf_file=``; a file changed on disk is read again; a later process reads the
    conversion back from the disk cache."""
    from transformers import AutoConfig, AutoTokenizer

    from shardserve.workers.gguf_file import _converted

    from shardserve.cluster.tokenizer import load_tokenizer
    from shardserve.workers.model_source import ModelFiles, load_config

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *"abcdefghijklmnopqrstuvwxyzĠ", "hi", "Ġh", "Ġhi"]
    path = tmp_path / "tiny.gguf"

    def write(rms_eps: float) -> None:
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_context_length(64), writer.add_embedding_length(32), writer.add_feed_forward_length(48)
        writer.add_block_count(1), writer.add_head_count(4), writer.add_head_count_kv(2)
        writer.add_rope_freq_base(10000.0), writer.add_layer_norm_rms_eps(rms_eps)
        writer.add_tokenizer_model("gpt2"), writer.add_tokenizer_pre("smollm"), writer.add_token_list(tokens)
        writer.add_token_merges(["h i", "Ġ h", "Ġh i"]), writer.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
        writer.add_bos_token_id(1), writer.add_eos_token_id(2), writer.add_unk_token_id(0)
        writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
        writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()

    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path / "cache"))
    write(1e-5)
    parses = []
    reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *args, **kwargs: parses.append(args) or reader(*args, **kwargs))
    files = ModelFiles("tiny", path)
    config, tokenizer = load_config(files), load_tokenizer(files)
    config.shardserve_switch = True   # callers set switches on their copy
    again = load_config(files)
    ckpt = GGUFCheckpoint(path)
    assert len(parses) == 1, f"{len(parses)} full parses of one file"
    assert not hasattr(again, "shardserve_switch") and ckpt.num_heads == 4 and ckpt.tied_embeddings
    oracle_config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    oracle_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert again.to_dict() == oracle_config.to_dict()
    assert type(tokenizer) is type(oracle_tokenizer) and tokenizer.eos_token == oracle_tokenizer.eos_token == "<|im_end|>"
    assert tokenizer("hi hi")["input_ids"] == oracle_tokenizer("hi hi")["input_ids"] == [30, 29, 30]
    parsed = len(parses)   # with the oracle's (unpatched) parses
    write(1e-3)   # replaced on disk (a new size or mtime): read again
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    changed = load_config(files)
    assert changed.rms_norm_eps == pytest.approx(1e-3) and len(parses) == parsed + 1
    _converted.cache_clear()   # as in a new process: the conversion comes back from the disk, unparsed
    assert load_config(files).to_dict() == changed.to_dict() and len(parses) == parsed + 1
    assert load_tokenizer(files)("hi hi")["input_ids"] == [30, 29, 30] and len(parses) == parsed + 1
    entries = list((tmp_path / "cache" / "gguf-metadata").glob("*.json"))
    assert len(entries) == 2
    copy = tmp_path / "copy" / "tiny.gguf"   # the same file elsewhere: the entry is keyed by the header's bytes
    copy.parent.mkdir()
    shutil.copy(path, copy)
    assert load_config(ModelFiles("tiny", copy)).to_dict() == {**changed.to_dict(), "_name_or_path": str(copy.parent)}
    assert len(parses) == parsed + 1
    for entry in entries:   # JSON, but not a conversion (an old or foreign writer): parsed again, replaced
        entry.write_text("[]")
    _converted.cache_clear()
    assert load_config(files).to_dict() == changed.to_dict() and len(parses) == parsed + 2
    assert sum(isinstance(json.loads(entry.read_text()), dict) for entry in entries) == 1
