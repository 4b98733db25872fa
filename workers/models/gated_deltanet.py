"""Gated DeltaNet token mixer (Qwen3-Next's linear-attention layers) over the recurrent-state pool.

Math follows transformers' ``Qwen3NextGatedDeltaNet`` (``models/qwen3_next/modeling_qwen3_next.py``,
the parity oracle):

1. ``in_proj_qkvz`` / ``in_proj_ba`` project the input; per key head ``i`` their rows are
   ``[q_i (K), k_i (K), v (r*V), z (r*V)]`` and ``[b (r), a (r)]``, ``r = Hv / Hk`` value heads per
   key head (``fix_query_key_value_ordering``).
2. ``[q, k, v]`` (all q, then all k, then all v channels) go through a causal depthwise conv1d
   (width ``W``, SiLU) that continues from the sequence's window state.
3. ``q, k`` are L2-normalized (eps 1e-6), ``q`` scaled by ``K ** -0.5``; ``beta = sigmoid(b)``,
   ``g = -exp(A_log) * softplus(a + dt_bias)`` (log decay per value head).
4. The gated delta rule (``kernels/gated_delta.py``) from the slot's matrix state: chunked for
   prefill chunks, token by token for decodes and speculative verifies.
5. Gated RMSNorm per value head: ``weight * rmsnorm(o) * silu(z)``; ``out_proj`` (row-parallel).

Tensor parallel: key heads are the unit (each with its ``r`` value heads, channels, ``A_log`` /
``dt_bias`` entries and state slices); a rank holds a contiguous range of whole key heads, so
every projection slice is contiguous and states are sharded with the heads. One all-reduce, in
``out_proj``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.kernels import causal_conv1d, gated_delta_chunk, gated_delta_recurrent
from shardserve.workers.checkpoint import LazyTensor
from shardserve.workers.compilation import opaque_call
from shardserve.workers.forward_context import get_attention_metadata
from shardserve.workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from shardserve.workers.state_cache import SeqGroup


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' ``l2norm`` (float32)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _sliced_loader(ranges: list[tuple[int, int]], full: int):
    """A ``weight_loader`` that copies rows ``ranges`` (``(start, size)``) of a tensor whose first
    dim is ``full``, concatenated, into the parameter (2-D or 3-D conv weights squeezed)."""

    def load(param: nn.Parameter, tensor: LazyTensor, shard_id: int = 0) -> None:
        tensor.check_shape((full, *tensor.shape[1:]))
        rows = torch.cat([tensor[start:start + size] for start, size in ranges])
        param.data.copy_(rows.reshape(param.shape))

    return load


class GatedDeltaNet(nn.Module):
    """One gated-DeltaNet layer on this rank's key heads.

    Args:
        config: transformers ``Qwen3NextConfig``.
        k_range: ``(first key head, count)`` held by this rank.
        dtype: parameter (and conv window) dtype; matrix states are float32.

    Shapes: ``hidden [T, hidden_size] -> [T, hidden_size]`` (all-reduced). ``kv_cache`` is set by
    the runner's allocator from :meth:`cache_spec`: ``(conv_state [S, C, W - 1], ssm_state
    [S, Hv_local, K, V] float32)``; ``state_index`` by :class:`workers.state_cache.StateCache`.
    """

    def __init__(self, config, k_range: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        k_start, k_count = k_range
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        ratio = config.linear_num_value_heads // config.linear_num_key_heads
        self.ratio, self.num_k_heads, self.num_v_heads = ratio, k_count, k_count * ratio
        key_dim, value_dim = self.head_k_dim * config.linear_num_key_heads, self.head_v_dim * config.linear_num_value_heads
        self.key_dim, self.value_dim = self.head_k_dim * k_count, self.head_v_dim * self.num_v_heads
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = config.linear_conv_kernel_dim
        self.eps = config.rms_norm_eps
        self.dtype = dtype
        unit_qkvz = 2 * self.head_k_dim + 2 * ratio * self.head_v_dim
        self.in_proj_qkvz = ColumnParallelLinear(config.hidden_size, [(unit_qkvz * config.linear_num_key_heads,
                                                                       unit_qkvz * k_start, unit_qkvz * k_count)],
                                                 dtype=dtype)
        self.in_proj_ba = ColumnParallelLinear(config.hidden_size, [(2 * ratio * config.linear_num_key_heads,
                                                                     2 * ratio * k_start, 2 * ratio * k_count)],
                                               dtype=dtype)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, self.conv_width, dtype=dtype), requires_grad=False)
        k_rows = (self.head_k_dim * k_start, self.key_dim)
        v_start = self.head_v_dim * ratio * k_start
        self.conv1d.weight.weight_loader = _sliced_loader(
            [k_rows, (key_dim + k_rows[0], self.key_dim), (2 * key_dim + v_start, self.value_dim)],
            2 * key_dim + value_dim)
        heads = (ratio * k_start, self.num_v_heads)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        for param in (self.A_log, self.dt_bias):
            param.weight_loader = _sliced_loader([heads], config.linear_num_value_heads)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(self.head_v_dim, dtype=dtype), requires_grad=False)
        self.out_proj = RowParallelLinear(value_dim, config.hidden_size, v_start, self.value_dim, dtype=dtype)
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.state_index = 0

    def cache_spec(self, num_slots: int, block_size: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """``(shape, dtype)`` of this layer's conv windows and matrix states for ``num_slots``
        sequences (``block_size`` is unused: states are per sequence, not per token)."""
        return [((num_slots, self.conv_dim, self.conv_width - 1), self.dtype),
                ((num_slots, self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32)]

    def _project(self, hidden: torch.Tensor):
        """``-> (mixed_qkv [T, C], z [T, Hv, V], b [T, Hv], a [T, Hv])``."""
        num_tokens = hidden.shape[0]
        qkvz = self.in_proj_qkvz(hidden).view(num_tokens, self.num_k_heads, -1)
        ba = self.in_proj_ba(hidden).view(num_tokens, self.num_k_heads, 2 * self.ratio)
        group_v = self.ratio * self.head_v_dim
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, group_v, group_v], dim=-1)
        mixed = torch.cat((q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)), dim=-1)
        b, a = ba.split([self.ratio, self.ratio], dim=-1)
        return (mixed, z.reshape(num_tokens, self.num_v_heads, self.head_v_dim), b.reshape(num_tokens, -1),
                a.reshape(num_tokens, -1))

    def _delta_rule(self, fn, group: SeqGroup | None, inputs: tuple, out: torch.Tensor) -> tuple | None:
        """Run ``fn`` on ``group``'s tokens of ``inputs`` (q, k, v, g, beta) into ``out``; returns
        those tokens' inputs."""
        if group is None:
            return None
        if group.token_idx is not None:
            inputs = tuple(x[group.token_idx] for x in inputs)
        result = fn(*inputs, group.cu_seqlens, self.kv_cache[1], group.slots)
        if group.token_idx is None:
            out.copy_(result)
        else:
            out[group.token_idx] = result
        return inputs

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        mixed, z, b, a = self._project(hidden)
        (out,) = opaque_call(self, (mixed, b, a))
        return self.out_proj(self._gated_norm(out, z).reshape(num_tokens, -1))

    def opaque_fake(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor]:
        return (mixed.new_empty(mixed.shape[0], self.num_v_heads, self.head_v_dim),)

    def opaque_forward(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor]:
        """The recurrent part of one step (opaque to ``--compile``: it reads and writes the slots'
        states): conv window, gates, the gated delta rule. ``mixed [T, C], b, a [T, Hv]`` ->
        ``([T, Hv, V],)`` before the gated norm."""
        meta = get_attention_metadata().state
        num_tokens = mixed.shape[0]
        conv_state, ssm_state = self.kv_cache
        checkpoint = None
        if meta.keep:   # speculative verify: the recurrent group's states before the step, its conv inputs
            rec = meta.recurrent
            rows = rec.slots.long()
            checkpoint = (conv_state[rows].clone(), ssm_state[rows].clone(),
                          mixed if rec.token_idx is None else mixed[rec.token_idx])
        mixed = causal_conv1d(mixed, self.conv1d.weight, meta.cu_seqlens, conv_state, meta.slots)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = _l2norm(q.reshape(num_tokens, self.num_k_heads, self.head_k_dim)) * self.head_k_dim ** -0.5
        k = _l2norm(k.reshape(num_tokens, self.num_k_heads, self.head_k_dim))
        v = v.reshape(num_tokens, self.num_v_heads, self.head_v_dim).contiguous()
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        inputs = (q, k, v, g.contiguous(), beta.contiguous())
        out = torch.empty_like(v)
        self._delta_rule(gated_delta_chunk, meta.chunked, inputs, out)
        recurrent_inputs = self._delta_rule(gated_delta_recurrent, meta.recurrent, inputs, out)
        if checkpoint is not None:
            meta.snapshots[self.state_index] = (*checkpoint, recurrent_inputs)
        return (out,)

    def _gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """transformers' ``Qwen3NextRMSNormGated``: ``weight * rmsnorm(x) * silu(gate)`` per head."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.norm.weight * h.to(x.dtype) * F.silu(gate.float())).to(x.dtype)
