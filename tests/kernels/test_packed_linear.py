"""Packed CPU matmuls (``kernels/packed_linear.py``) against the dequantized float32 matmul.

GGUF Q4_0 / Q4_1 / Q8_0 tensors are made with the ``gguf`` package's own quantizer and its own
dequantizer is the oracle (independent of our block decoder); each packed matmul, and every
tensor-parallel slice of it (output rows for column-parallel layers, whole groups of input
columns for row-parallel ones), must stay within :func:`error_bound` of ``x @ W^T`` in float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardserve.kernels.packed_linear import (DENSE_ROWS, dense_rows_auto, int4_linear, int4_linear_ref, int4_supported,
                                              int8_linear, int8_linear_ref, int8_supported, pack_int4)
from shardserve.workers.layers.quantized import PackedWeight, packed_nbytes
from shardserve.workers.quantization import decode_gguf, quantize_int4, quantize_int8

BF16_U = 2.0 ** -8   # unit roundoff of bfloat16 (8 significand bits): |round(v) - v| <= u |v|


def error_bound(x: torch.Tensor, weight: torch.Tensor, weight_error: torch.Tensor) -> torch.Tensor:
    """Largest ``|packed(x) - x @ W^T|`` per output, first-order rounding analysis.

    The packed path differs from the float32 matmul by (1) whatever its stored weight differs
    from ``W`` by, ``weight_error [N, K]`` (bf16 rounding of the scales and zeros, plus int8
    requantization of Q8_0), giving ``|x| @ weight_error^T``; (2) rounding ``x`` to bf16 and the
    weight to bf16 inside the kernel, ``u`` each, so ``2u |x| @ |W|^T``; (3) float32 accumulation
    over K terms, ``K 2^-24 |x| @ |W|^T``; (4) rounding the result to bf16, ``u |y|``. A 1 % margin
    covers the second-order terms. ``x [M, K]``, ``weight [N, K]``; returns ``[M, N]``.
    """
    abs_x = x.abs().double()
    magnitude = abs_x @ weight.abs().double().t()
    first = abs_x @ weight_error.double().t() + (2 * BF16_U + x.shape[1] * 2.0 ** -24) * magnitude
    result = (x.double() @ weight.double().t()).abs()
    return (1.01 * (first + BF16_U * (result + first)) + 1e-6).float()


def packed_weight_error(qw) -> torch.Tensor:
    """``(1)`` of :func:`error_bound`: bf16 rounding of scales / zeros, per weight ``[N, K]``."""
    if qw.kind == "int8":
        return BF16_U * qw.codes.float().abs() * qw.scales[:, None]
    num_out, num_in = qw.codes.shape
    steps = (qw.codes.float() - 8).abs().view(num_out, -1, qw.group_size)
    return (BF16_U * (steps * qw.scales[..., None].abs() + qw.zeros[..., None].abs())).view(num_out, num_in)


def gguf_tensor(qtype: str, shape: tuple[int, int], seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """A random weight quantized by ``gguf``: raw blocks and ``gguf``'s own float32 dequantization."""
    import gguf
    from gguf import quants

    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal(shape) * 0.05 + rng.standard_normal((shape[0], 1)) * 0.02).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    raw = quants.quantize(weight, kind)
    return raw, torch.from_numpy(quants.dequantize(raw, kind).astype(np.float32)).reshape(shape)


# (out_features, in_features), rows / column slices of a TP split: column-parallel slices are whole
# rows (multiples of 16 for the int4 tile), row-parallel slices whole groups of 32 columns.
SHAPE = (96, 192)
SLICES = [("whole", slice(None), slice(None)), ("col-parallel", slice(32, 80), slice(None)),
          ("row-parallel", slice(None), slice(64, 160))]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("name,rows,cols", SLICES, ids=[s[0] for s in SLICES])
def test_packed_gguf_matmul_matches_dequantized_float32(qtype, name, rows, cols):
    raw, dequantized = gguf_tensor(qtype, SHAPE, seed=len(name))
    qw = decode_gguf(raw, qtype, SHAPE)
    if qtype != "Q8_0":   # the integer form is the file's values exactly
        torch.testing.assert_close(qw.dequantize(), dequantized, rtol=0, atol=0)
    start_row = rows.start or 0
    part = qw.rows(start_row, (rows.stop or SHAPE[0]) - start_row)
    start_col = cols.start or 0
    part = part.cols(start_col, (cols.stop or SHAPE[1]) - start_col)
    weight = dequantized[rows, cols]
    x = torch.randn(5, weight.shape[1])
    actual = PackedWeight(part, torch.bfloat16).matmul(x).float()
    error = packed_weight_error(part)
    if qtype == "Q8_0":   # re-rounded to one scale per row: at most half a step from the file's value
        error = error + part.scales[:, None] / 2
    bound = error_bound(x, weight, error)
    excess = (actual - x @ weight.t()).abs() - bound
    assert excess.max() <= 0, f"{qtype} {name}: error exceeds the bound by {excess.max():.3g}"


def test_int4_slices_cut_whole_groups_only():
    raw, _ = gguf_tensor("Q4_1", SHAPE, seed=3)
    qw = decode_gguf(raw, "Q4_1", SHAPE)
    assert qw.cols(16, 64) is None and qw.cols(32, 48) is None
    assert qw.cols(32, 64).scales.shape == (SHAPE[0], 2)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_float_quantizers_and_kernels_match_references(kind):
    """``--quantization``: round-to-nearest codes are within half a step of the weight, and each
    aten kernel matches its torch reference on the same codes (same bound, no requantization)."""
    weight = torch.randn(48, 160) * 0.05
    x = torch.randn(3, 160)
    if kind == "int4":
        qw = quantize_int4(weight)
        step = qw.scales.repeat_interleave(32, dim=1)
        packed, scale_zeros = pack_int4(qw.codes, qw.scales, qw.zeros, torch.bfloat16)
        actual = int4_linear(x, packed, scale_zeros, 32).float()
        reference = int4_linear_ref(x, qw.codes, qw.scales, qw.zeros)
    else:
        qw = quantize_int8(weight)
        step = qw.scales[:, None].expand_as(weight)
        actual = int8_linear(x, qw.codes, qw.scales.bfloat16()).float()
        reference = int8_linear_ref(x, qw.codes, qw.scales)
    assert ((qw.dequantize() - weight).abs() <= step / 2 * (1 + 1e-5)).all()
    bound = error_bound(x, qw.dequantize(), packed_weight_error(qw))
    assert ((actual - reference).abs() <= bound).all()


def test_kernel_shape_rules():
    assert int4_supported(48, 96, 32) and not int4_supported(40, 96, 32) and not int4_supported(48, 80, 32)
    assert int8_supported(7, 48) and not int8_supported(16, 40)
    with pytest.raises(ValueError, match="N % 16"):
        pack_int4(torch.zeros(40, 64, dtype=torch.uint8), torch.ones(40, 2), torch.zeros(40, 2), torch.bfloat16)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_dense_copy_takes_inputs_from_its_row_count(kind):
    """``--packed-dense-rows``: inputs below the threshold run the packed kernel (bit for bit the
    weight without a copy), inputs from it the dense bf16 copy, which holds the weight the kernel
    computes with (scales and zeros rounded to bf16) and stays within the same error bound of the
    float32 matmul; the copy's bytes are what the plan counts."""
    weight = torch.randn(48, 160) * 0.05
    qw = quantize_int4(weight) if kind == "int4" else quantize_int8(weight)
    plain, with_copy = PackedWeight(qw, torch.bfloat16), PackedWeight(qw, torch.bfloat16, dense_rows=4)
    assert plain.dense is None and with_copy.dense.shape == (48, 160) and with_copy.dense.dtype == torch.bfloat16
    # bf16 scales and zeros (the kernel's), then the weight itself rounded to bf16
    off = (with_copy.dense.float() - qw.dequantize()).abs()
    assert (off <= 1.01 * (packed_weight_error(qw) + BF16_U * qw.dequantize().abs()) + 1e-9).all()
    assert with_copy.nbytes == plain.nbytes + 48 * 160 * 2 == packed_nbytes(kind, (48, 160), torch.bfloat16) + 48 * 160 * 2
    reference = qw.dequantize()
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, 160).bfloat16()
        actual = with_copy.matmul(x)
        if rows < 4:
            assert torch.equal(actual, plain.matmul(x))
        else:
            assert torch.equal(actual, torch.nn.functional.linear(x, with_copy.dense))
        bound = error_bound(x.float(), reference, packed_weight_error(qw))
        assert ((actual.float() - x.float() @ reference.t()).abs() <= bound).all(), rows


def test_the_row_test_is_no_recompilation_under_torch_compile():
    """Under ``torch.compile`` (dynamic token count) the packed matmul is one opaque op: crossing
    the dense-copy threshold recompiles nothing, and the compiled results equal eager ones."""
    from torch._dynamo.testing import CompileCounter

    weight = PackedWeight(quantize_int4(torch.randn(64, 96) * 0.05), torch.bfloat16, dense_rows=8)
    counter = CompileCounter()
    compiled = torch.compile(lambda x: torch.relu(weight.matmul(x)), backend=counter, dynamic=False, fullgraph=True)
    for rows in (2, 5, 8, 13, 3, 32):
        x = torch.randn(rows, 96).bfloat16()
        torch._dynamo.mark_dynamic(x, 0)   # as the compiled forward marks its token count
        assert torch.equal(compiled(x), torch.relu(weight.matmul(x))), rows
    assert counter.frame_count == 1


def test_dense_rows_auto_keeps_copies_only_for_low_precision_compute():
    assert dense_rows_auto(torch.float32) == 0
    assert dense_rows_auto(torch.bfloat16) in (0, DENSE_ROWS)   # measured on this CPU
