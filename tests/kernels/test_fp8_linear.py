"""FP8 block-scaled linear: the Triton W8A16 kernel against its torch reference, and the
reference against an independent dequantization, on odd shapes and partial edge blocks."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import DTYPES, assert_close, dtype_name
from shardserve.kernels.fp8_linear import fp8_block_linear_ref
from shardserve.kernels.fp8_linear_triton import fp8_block_linear_triton


def _quantized(rows: int, cols: int, block: tuple[int, int],
               std: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random weight as fp8 values plus per-block scales (entries of about ``std``), and its exact
    float32 value."""
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = (torch.rand(grid) + 0.5) * std / 100
    values = (torch.randn(rows, cols) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    expanded = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return values, scale, values.float() * expanded


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("num_rows,out_features,in_features,block", [
    (1, 96, 64, (32, 32)), (5, 130, 100, (32, 32)), (19, 64, 256, (128, 128)), (33, 200, 160, (64, 32)),
], ids=["decode", "partial-blocks", "deepseek-blocks", "tall"])
def test_fp8_linear_kernel_matches_reference(num_rows, out_features, in_features, block, dtype):
    weight, scale, exact = _quantized(out_features, in_features, block)
    x = torch.randn(num_rows, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    ref = fp8_block_linear_ref(x, weight, scale, block, bias)
    assert ref.dtype == dtype and ref.shape == (num_rows, out_features)
    torch.testing.assert_close(ref.float(), (x.float() @ exact.to(dtype).float().T + bias.float()),
                               atol=1e-3 if dtype == torch.float32 else 0.25, rtol=1e-3 if dtype == torch.float32 else 2e-2)
    out = fp8_block_linear_triton(x, weight, scale, block, bias)
    assert_close(out, ref, dtype, scale=4.0 if dtype == torch.bfloat16 else 10.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("num_rows,out_features,in_features,block,split_k", [
    (2, 40, 512, (32, 32), None),     # decode, few output tiles: the config splits K (4 ways here)
    (3, 70, 200, (32, 16), 3),        # forced 3 splits, partial K step in the last split, odd N
], ids=["decode-auto-split", "forced-split"])
def test_fp8_linear_split_k_matches_reference(num_rows, out_features, in_features, block, split_k, dtype):
    from shardserve.kernels.fp8_linear_triton import gemm_config

    weight, scale, _ = _quantized(out_features, in_features, block)
    x = torch.randn(num_rows, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    if split_k is None:
        assert gemm_config(num_rows, out_features, in_features, block[1], x.device)["split_k"] > 1
    ref = fp8_block_linear_ref(x, weight, scale, block, bias)
    out = fp8_block_linear_triton(x, weight, scale, block, bias, split_k=split_k)
    assert out.dtype == dtype
    assert_close(out, ref, dtype, scale=4.0 if dtype == torch.bfloat16 else 10.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("num_tokens,block", [(3, (32, 32)), (21, (16, 32))], ids=["decode", "prefill"])
def test_fp8_fused_moe_kernel_matches_reference(num_tokens, block, dtype):
    from shardserve.kernels.fused_moe import fused_moe_ref
    from shardserve.kernels.fused_moe_triton import fused_moe_triton

    experts, hidden, inter, top_k = 4, 96, 64, 2
    parts13 = [_quantized(2 * inter, hidden, block, hidden ** -0.5) for _ in range(experts)]
    parts2 = [_quantized(hidden, inter, block, inter ** -0.5) for _ in range(experts)]
    w13, s13, exact13 = (torch.stack(p) for p in zip(*parts13))
    w2, s2, exact2 = (torch.stack(p) for p in zip(*parts2))
    x = torch.randn(num_tokens, hidden).to(dtype)
    ids = torch.rand(num_tokens, experts).topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k).softmax(-1)
    ref = fused_moe_ref(x.float(), exact13, exact2, weights, ids)       # float32 on the exact weights
    out = fused_moe_triton(x, w13, w2, weights, ids, s13, s2, block)
    assert out.dtype == dtype
    assert_close(out, ref, dtype, scale=2.0 if dtype == torch.bfloat16 else 10.0)
