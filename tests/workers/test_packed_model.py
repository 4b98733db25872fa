"""Loading a GGUF Llama with packed weights (``workers/layers/quantized.py``): which layers pack,
which fall back to floats, tensor-parallel slices, the tied int8 embedding / LM head, and
``--quantization`` of a float checkpoint. Tiny models, no engine: fast."""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from safetensors.torch import save_file
from test_checkpoint import TINY, tiny_llama_tensors, write_gguf
from transformers import LlamaConfig

from shardserve.workers.checkpoint import GGUFCheckpoint, SafetensorsCheckpoint
from shardserve.workers.distributed import TensorParallelGroup, set_tp_group
from shardserve.workers.layers.linear import linear
from shardserve.workers.device import resolve_dtype
from shardserve.workers.quantization import WeightFormat, weight_format_for
from shardserve.workers.weight_loader import build_model

# Q/K/V: Q4_0 + Q4_1 (both int4: packed together); gate Q4_1 + up Q8_0 (two kinds: floats);
# down: F16 (no integer form: floats); embedding Q8_0 (int8, tied LM head).
RAW_TYPES = {"blk.0.attn_q.weight": QT.Q4_0, "blk.0.attn_k.weight": QT.Q4_0, "blk.0.attn_v.weight": QT.Q4_1,
             "blk.0.attn_output.weight": QT.Q4_1, "blk.0.ffn_gate.weight": QT.Q4_1,
             "blk.0.ffn_up.weight": QT.Q8_0, "blk.0.ffn_down.weight": QT.F16, "token_embd.weight": QT.Q8_0}
BF16 = WeightFormat(torch.bfloat16)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    tensors = {name: gguf.quants.quantize(array * 0.1, RAW_TYPES[name]) if name in RAW_TYPES else array
               for name, array in tiny_llama_tensors().items()}
    return write_gguf(tmp_path_factory.mktemp("packed") / "tiny.gguf", tensors, RAW_TYPES)


@pytest.fixture(autouse=True)
def single_rank():
    yield
    set_tp_group(TensorParallelGroup())


def build(path, rank: int = 0, size: int = 1, fmt: WeightFormat | None = BF16):
    set_tp_group(TensorParallelGroup(rank, size))
    dtype = torch.float32 if fmt is None else fmt.dtype
    return build_model(LlamaConfig(**TINY), GGUFCheckpoint(path), dtype=dtype, progress=False, weight_format=fmt)[0]


def test_layers_pack_where_the_kernels_can_and_load_floats_elsewhere(tiny_gguf):
    model = build(tiny_gguf)
    exact = build(tiny_gguf, fmt=None)   # float32, dequantized by the gguf package
    layer, ref = model.model.layers[0], exact.model.layers[0]
    assert layer.self_attn.qkv_proj.packed.kind == "int4" and layer.self_attn.qkv_proj.weight is None
    assert layer.self_attn.o_proj.packed.kind == "int4"
    assert layer.mlp.gate_up_proj.packed is None and layer.mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert layer.mlp.down_proj.packed is None
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight.float(), ref.mlp.gate_up_proj.weight,
                               rtol=2 ** -8, atol=0.02 * 0.1 / 2)   # bf16 rounding; Q8_0 up: half a row step
    assert model.model.embed_tokens.packed.kind == "int8" and model.lm_head.packed is model.model.embed_tokens.packed
    x = torch.randn(3, TINY["hidden_size"])
    for ours, theirs in ((layer.self_attn.qkv_proj, ref.self_attn.qkv_proj), (model.lm_head, exact.lm_head)):
        expected = F.linear(x, theirs.weight)
        out = ours(x.bfloat16()).float()
        assert (out - expected).abs().max() <= 0.03 * expected.abs().max(), type(ours).__name__
    ids = torch.tensor([0, 5, 63])
    looked_up = model.model.embed_tokens(ids).float()
    torch.testing.assert_close(looked_up, exact.model.embed_tokens(ids), rtol=0.02, atol=0.01 * 0.1)


def test_tensor_parallel_ranks_hold_whole_rows_and_groups(tiny_gguf):
    """Column-parallel rank outputs are the TP=1 output's rows, bit for bit (each output row only
    reads its own packed row). Here each rank's o_proj slice is 16 input columns, half a group:
    it falls back to floats, and the partial sums still add up to the TP=1 output."""
    whole = build(tiny_gguf).model.layers[0].self_attn
    ranks = [build(tiny_gguf, rank, 2).model.layers[0].self_attn for rank in (0, 1)]
    x = torch.randn(4, TINY["hidden_size"]).bfloat16()
    qkv = whole.qkv_proj(x)
    q_size, kv_size = whole.num_heads * whole.head_dim, whole.num_kv_heads * whole.head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    parts = [r.qkv_proj(x).split([q_size // 2, kv_size // 2, kv_size // 2], dim=-1) for r in ranks]
    for index, full in enumerate((q, k, v)):
        assert torch.equal(torch.cat([p[index] for p in parts], dim=-1), full)
    attn_out = torch.randn(4, q_size).bfloat16()
    partial = [linear(r.o_proj, attn_out[:, i * q_size // 2:(i + 1) * q_size // 2], None).float()
               for i, r in enumerate(ranks)]
    full = linear(whole.o_proj, attn_out, None).float()
    assert whole.o_proj.packed.kind == "int4" and all(r.o_proj.packed is None for r in ranks)
    torch.testing.assert_close(partial[0] + partial[1], full, rtol=0.02, atol=0.02 * full.abs().max().item())


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantization_of_a_float_checkpoint(tmp_path, quantization):
    config = dict(TINY, hidden_size=64, intermediate_size=128, tie_word_embeddings=False)
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(**config)).eval()
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(tmp_path / "model.safetensors"))
    fmt = weight_format_for(resolve_dtype("auto", "cpu", None, quantization), quantization, is_gguf=False)
    model = build_model(LlamaConfig(**config), SafetensorsCheckpoint(tmp_path), dtype=fmt.dtype, progress=False,
                        weight_format=fmt)[0]
    layer = model.model.layers[0]
    assert layer.mlp.down_proj.packed.kind == quantization and layer.self_attn.qkv_proj.packed.kind == quantization
    assert model.lm_head.packed.kind == "int8" and model.model.embed_tokens.packed.kind == "int8"
    x = torch.randn(5, 128)
    expected = F.linear(x, reference.model.layers[0].mlp.down_proj.weight)
    error = (linear(layer.mlp.down_proj, x, None).float() - expected).abs().max() / expected.abs().max()
    assert error < (0.02 if quantization == "int8" else 0.15), error


def test_dtype_auto_rule():
    assert resolve_dtype("auto", "cpu", {"Q4_1": 90, "Q8_0": 30, "Q6_K": 10}) == torch.bfloat16
    assert resolve_dtype("auto", "cpu", {"Q4_K": 90, "Q8_0": 30}) == torch.float32   # mostly K-quants
    assert resolve_dtype("auto", "cpu", None) == torch.float32                       # float checkpoint
    assert resolve_dtype("auto", "cpu", None, "int4") == torch.bfloat16
    assert resolve_dtype("float32", "cpu", {"Q4_0": 1}) == torch.float32
    assert resolve_dtype("auto", "cuda", None) == torch.bfloat16
    assert weight_format_for(torch.float32, "none", is_gguf=True) is None          # the exact path
    assert weight_format_for(torch.bfloat16, "none", is_gguf=True) == WeightFormat(torch.bfloat16)
    with pytest.raises(ValueError, match="--dtype"):
        resolve_dtype("fp8", "cpu")


def test_dense_copies_auto_stay_within_the_hosts_memory(tiny_gguf, monkeypatch):
    """``--packed-dense-rows auto`` keeps no copies that would take over a quarter of the host's
    available memory (they roughly quadruple a Q4 model's weights); an explicit row count is kept."""
    import psutil

    from shardserve.kernels.packed_linear import dense_rows_auto
    from shardserve.workers import quantization
    from shardserve.workers.quantization import dense_copy_bytes

    ckpt = GGUFCheckpoint(tiny_gguf)
    matrices = [ckpt.get(name).shape for name in ckpt.names() if len(ckpt.get(name).shape) == 2]
    assert dense_copy_bytes(ckpt, torch.bfloat16) == sum(rows * cols * 2 for rows, cols in matrices)
    assert weight_format_for(torch.bfloat16, "none", True, "auto", ckpt).dense_rows == dense_rows_auto(torch.bfloat16)
    # the same copies on a host whose available memory is under 2x their size
    monkeypatch.setattr(quantization, "DENSE_COPY_SHARE", dense_copy_bytes(ckpt, torch.bfloat16)
                        / psutil.virtual_memory().available / 2)
    assert weight_format_for(torch.bfloat16, "none", True, "auto", ckpt).dense_rows == 0
    assert weight_format_for(torch.bfloat16, "none", True, "16", ckpt).dense_rows == 16
