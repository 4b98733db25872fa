"""Gated delta rule (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks"), the token mixer of
Qwen3-Next's linear-attention layers, over a pool of per-sequence recurrent states.

Per value head, with ``q, k`` L2-normalized (``q`` also scaled by ``K ** -0.5``), decay
``g_t <= 0`` (log space) and write strength ``beta_t`` in (0, 1), the state ``S [K, V]`` evolves as

    S_t = exp(g_t) * S_{t-1};  S_t += k_t (beta_t * (v_t - k_t^T S_t));  o_t = q_t^T S_t

Two equivalent evaluations, both transcribed from transformers' ``models/qwen3_next/
modeling_qwen3_next.py`` (the oracle): :func:`gated_delta_recurrent_ref` is its
``torch_recurrent_gated_delta_rule`` (token by token: decode and speculative verify), and
:func:`gated_delta_chunk_ref` its ``torch_chunk_gated_delta_rule`` (chunks of 64 tokens through the
UT transform: prefill). Both read each sequence's initial state from ``state[slots[b]]`` and write
the final state back there, so a prompt may be prefilled over several steps (chunked prefill).

Value heads are grouped over key heads: value head ``h`` reads key/query head ``h // (Hv / Hk)``
(transformers' ``repeat_interleave``). Layout: packed tokens of ``B`` sequences, ``cu_seqlens
[B + 1]``; ``q, k [T, Hk, K]``, ``v [T, Hv, V]``, ``g, beta [T, Hv]``; states ``[num_slots, Hv, K, V]``
float32. Math in float32 as transformers does; outputs in ``v.dtype``.
"""

from __future__ import annotations

import torch

from shardserve.kernels.dispatch import use_triton

CHUNK_SIZE = 64


def _check(q, k, v, g, beta, cu_seqlens, state, slots) -> None:
    num_tokens, num_k_heads, k_dim = k.shape
    num_v_heads, v_dim = v.shape[1:]
    assert q.shape == k.shape, f"q {tuple(q.shape)} vs k {tuple(k.shape)}"
    assert v.shape[0] == num_tokens and g.shape == beta.shape == (num_tokens, num_v_heads), \
        f"v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)} for {num_tokens} tokens"
    assert num_v_heads % num_k_heads == 0, f"{num_v_heads} value heads over {num_k_heads} key heads"
    assert state.shape[1:] == (num_v_heads, k_dim, v_dim) and state.dtype == torch.float32, \
        f"state {tuple(state.shape)} {state.dtype} vs [slots, {num_v_heads}, {k_dim}, {v_dim}] float32"
    assert cu_seqlens.shape == (slots.shape[0] + 1,), f"cu_seqlens {tuple(cu_seqlens.shape)} vs {slots.shape[0]} slots"


def gated_delta_recurrent_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, cu_seqlens: torch.Tensor, state: torch.Tensor,
                              slots: torch.Tensor) -> torch.Tensor:
    """Token-by-token gated delta rule (transformers' ``torch_recurrent_gated_delta_rule``).

    Args:
        q, k: ``[T, Hk, K]`` (normalized, ``q`` scaled; see the module docstring).
        v: ``[T, Hv, V]``. g, beta: ``[T, Hv]`` (log decay, write strength).
        cu_seqlens: ``[B + 1]`` int, token offsets of the ``B`` sequences.
        state: ``[num_slots, Hv, K, V]`` float32, read at and written back to ``slots``.
        slots: ``[B]`` int, each sequence's state slot (distinct).

    Returns:
        ``o [T, Hv, V]`` in ``v.dtype``; ``state[slots]`` holds the states after each sequence.
        With one token per sequence (``T == B``, a decode step) it runs without a host sync.
    """
    _check(q, k, v, g, beta, cu_seqlens, state, slots)
    group = v.shape[1] // k.shape[1]
    slots = slots.long()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    if q.shape[0] == slots.shape[0]:   # one token per sequence (decode): no host sync, fixed shapes
        state[slots] = _recurrent_step(q, k, v, g, beta, state[slots], group, out, slice(None))
        return out.to(v.dtype)
    starts, lens = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    states = state[slots].clone()                                        # [B, Hv, K, V]
    for i in range(int(lens.max()) if lens.numel() else 0):
        seqs = (lens > i).nonzero().squeeze(1)
        states[seqs] = _recurrent_step(q, k, v, g, beta, states[seqs], group, out, starts[seqs] + i)
    state[slots] = states
    return out.to(v.dtype)


def _recurrent_step(q, k, v, g, beta, s, group: int, out: torch.Tensor, rows) -> torch.Tensor:
    """One token of each of ``n`` sequences: states ``s [n, Hv, K, V]`` float32 and their tokens at
    ``rows`` of the packed inputs; writes ``out[rows]`` and returns the new states."""
    q_t = q[rows].float().repeat_interleave(group, dim=1)                  # [n, Hv, K]
    k_t = k[rows].float().repeat_interleave(group, dim=1)
    s = s * g[rows].float().exp()[..., None, None]
    kv_mem = (s * k_t.unsqueeze(-1)).sum(dim=-2)                           # [n, Hv, V]
    delta = (v[rows].float() - kv_mem) * beta[rows].float().unsqueeze(-1)
    s = s + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
    out[rows] = (s * q_t.unsqueeze(-1)).sum(dim=-2)
    return s


def _chunk_one(q, k, v, g, beta, initial: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, heads first: ``q, k [H, L, K]``, ``v [H, L, V]``, ``g, beta [H, L]`` float32,
    ``initial [H, K, V]`` -> ``(o [H, L, V], final state [H, K, V])``."""
    length = q.shape[1]
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    heads = q.shape[0]
    q, k, v = (x.reshape(heads, -1, chunk_size, x.shape[-1]) for x in (q, k, v))   # [H, N, C, D]
    g, beta = g.reshape(heads, -1, chunk_size), beta.reshape(heads, -1, chunk_size)
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)                                                            # [H, N, C]
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * decay                                # unit lower-triangular system
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, k_beta * cum.exp().unsqueeze(-1), upper=False,
                                               unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    s = initial
    out = torch.empty_like(new_values)
    for i in range(q.shape[1]):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, -1, out.shape[-1])[:, :length], s


def gated_delta_chunk_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          cu_seqlens: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                          chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Chunked gated delta rule (transformers' ``torch_chunk_gated_delta_rule``), one sequence at a
    time: within a chunk the ``chunk_size`` delta updates are solved at once through the UT
    transform (a unit lower-triangular solve), chunks are scanned in order from the slot's state.

    Args and returns: as :func:`gated_delta_recurrent_ref`; ``chunk_size``
    tokens per chunk, counted from each sequence's first token in this call.
    """
    _check(q, k, v, g, beta, cu_seqlens, state, slots)
    group = v.shape[1] // k.shape[1]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    bounds = cu_seqlens.tolist()
    for b, slot in enumerate(slots.tolist()):
        rows = slice(bounds[b], bounds[b + 1])
        if bounds[b + 1] == bounds[b]:
            continue
        heads_first = [x[rows].float().transpose(0, 1) for x in (q, k, v, g, beta)]
        hq, hk = (x.repeat_interleave(group, dim=0) for x in heads_first[:2])
        o, final = _chunk_one(hq, hk, *heads_first[2:], state[slot].clone(), chunk_size)
        out[rows] = o.transpose(0, 1)
        state[slot] = final
    return out.to(v.dtype)


def gated_delta_recurrent(q, k, v, g, beta, cu_seqlens, state, slots) -> torch.Tensor:
    """Dispatching recurrent rule (:func:`kernels.gated_delta_triton.gated_delta_recurrent_triton`
    or :func:`gated_delta_recurrent_ref`, same contract)."""
    if use_triton(v):
        from shardserve.kernels.gated_delta_triton import gated_delta_recurrent_triton

        return gated_delta_recurrent_triton(q, k, v, g, beta, cu_seqlens, state, slots)
    return gated_delta_recurrent_ref(q, k, v, g, beta, cu_seqlens, state, slots)


def gated_delta_chunk(q, k, v, g, beta, cu_seqlens, state, slots) -> torch.Tensor:
    """Dispatching chunked rule (:func:`kernels.gated_delta_triton.gated_delta_chunk_triton` or
    :func:`gated_delta_chunk_ref`, same contract, chunks of :data:`CHUNK_SIZE`)."""
    if use_triton(v):
        from shardserve.kernels.gated_delta_triton import gated_delta_chunk_triton

        return gated_delta_chunk_triton(q, k, v, g, beta, cu_seqlens, state, slots)
    return gated_delta_chunk_ref(q, k, v, g, beta, cu_seqlens, state, slots)
