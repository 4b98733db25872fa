"""The activation reserve of one step: the peak bytes a forward allocates above weights and caches.

One function, :func:`step_activation_bytes` (a model and a :class:`StepShape` -> bytes), for every
model family. Both users read it: the memory profile (``workers/memory_profile.py``: the profiling
forward may not need more than it says, and on CUDA the KV budget subtracts the larger of it and
the measured peak) and the plan (``workers/plan.py``: ``shardserve plan`` and every rank at
start-up). When a kernel or a forward changes what it allocates, change its term here, in one
place.

The model is an upper bound read off the code, tensor by tensor: the step's inputs and layout
tensors, the residual stream, the largest decoder sublayer (attention with its DSA indexer, or the
MLP / MoE), and the LM head with the sampler's sort over ``[rows, vocab]`` at the end; within a
sublayer every temporary is counted as if none were freed before the sublayer ends, except where
the peak is known to be a phase (the indexer's row chunks, MLA's key tiles and chunks). MLA and DSA
allocate nothing of size ``tokens x context`` (issue 25): their long-context terms are bounded by
:data:`kernels.workspace.WORKSPACE_ELEMENTS` and read the kernels' own tile planners, so the reserve
at a 163,840-token context exceeds the 4,096-token one only by the block tables. Two
paths differ where their kernels do: ``triton=True`` (the CUDA path: each kernel allocates its
output only) and ``triton=False`` (the torch references of the CPU path, which gather the paged
context and keep float32 copies). Workspaces allocated inside one torch op (a sort's, SDPA's on
CPU) are not counted; ``tests/workers/test_plan_memory.py`` checks the bound against the storage
bytes a real forward creates, for every family.

Symbols below: ``T`` tokens of the step, ``B`` sequences, ``Q`` longest query, ``S`` longest
context after the step, ``R`` logit rows, ``d`` the compute dtype's bytes; ``Hl`` heads on this rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardserve.kernels.fused_moe import PAIRWISE_CHUNK_BYTES, PAIRWISE_MAX_TOKENS
from shardserve.kernels.indexer import SHORT_SEGMENT_ROWS
from shardserve.kernels.mla_attention import absorbed_ref_tiles
from shardserve.kernels.mla_prefill import expanded_chunk_keys, expanded_is_cheaper
from shardserve.kernels.workspace import WORKSPACE_ELEMENTS, plan_row_chunks
from shardserve.workers.layers.norm import RMSNorm


@dataclass(frozen=True, slots=True)
class StepShape:
    """The shape of one engine step, as far as memory is concerned."""

    num_tokens: int       # T: tokens computed (prefill chunk tokens + decodes)
    num_seqs: int         # B: sequences in the step
    max_query_len: int    # Q: the longest query of a sequence
    max_seq_len: int      # S: the longest context after the step (tokens)
    num_logit_rows: int   # R: rows whose logits are computed and sampled

    @classmethod
    def prefill(cls, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> StepShape:
        """The largest step the scheduler can send (what the profiling forward runs): one sequence
        computing its last ``min(max_num_batched_tokens, max_model_len)`` positions of a
        ``max_model_len`` context, plus logits and the sampler over ``max_num_seqs`` rows."""
        tokens = max(1, min(max_num_batched_tokens, max_model_len))
        return cls(tokens, 1, tokens, max_model_len, max_num_seqs)

    @classmethod
    def decode(cls, num_seqs: int, max_model_len: int) -> StepShape:
        """A decode step of ``num_seqs`` sequences at a ``max_model_len`` context (a captured
        decode graph's shape: its tables span the longest allowed sequence)."""
        return cls(num_seqs, num_seqs, 1, max_model_len, num_seqs)


def _n(*dims: int) -> int:
    return math.prod(dims)


def dtype_bytes(model) -> int:
    """Bytes per element of a model's compute dtype (its first RMSNorm's activation dtype)."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            return module.act_dtype.itemsize
    return torch.float32.itemsize


def _norm(tokens: int, width: int, d: int, triton: bool) -> int:
    """A (fused residual) RMSNorm: the Triton kernel writes the output and the new residual; the
    reference adds, upcasts to float32 and casts back."""
    return _n(tokens, width) * (2 * d if triton else 3 * d + 8)


def _rope(tokens: int, heads: int, rot: int, d: int, triton: bool) -> int:
    """``apply_rotary`` of ``[T, heads, rot]``: the output (the reference: products and a roll too)."""
    return _n(tokens, heads, rot) * d * (1 if triton else 3)


# -- attention -------------------------------------------------------------------------------

def _mla(attn, shape: StepShape, hidden: int, d: int, top_k: int | None, triton: bool, block_size: int) -> int:
    """One MLA sublayer (``workers/models/mla.py``) with its DSA indexer when it has one."""
    t, h = shape.num_tokens, attn.num_heads
    nope, rope, v, lora = attn.nope_dim, attn.rope_dim, attn.v_dim, attn.kv_lora_rank
    q_lora = attn.q_lora_rank or 0
    total = _n(t, q_lora) * d * 2 + (_norm(t, q_lora, d, triton) if q_lora else 0)    # q_a, its norm
    total += _n(t, h, nope + rope) * d                                                 # q
    total += _n(t, lora + rope) * d * 3 + _norm(t, lora, d, triton)                    # kv_a, c, cat
    total += _n(t, rope) * 4 + _rope(t, h + 1, rope, d, triton)                        # cos/sin, q_pe, k_pe
    indexer = 0   # the indexer's temporaries are gone (but its top-k) before attention starts
    if attn.indexer is not None and top_k is not None:
        indexer = _indexer(attn.indexer, shape, hidden, d, top_k, triton)
    selected = top_k if top_k is not None and shape.max_seq_len > top_k else None
    if shape.max_query_len > 1 and selected is None and expanded_is_cheaper(
            shape.max_query_len, lora, nope, rope, v):
        attention = _mla_expanded(attn, shape, d, triton, block_size)
    else:     # decode, DSA's sparse prefill, short dense chunks
        attention = _mla_absorbed(attn, shape, d, selected, triton)
    attention += _n(t, selected) * 4 if selected else 0                                 # the step's top-k
    return total + max(indexer, attention) + _n(t, hidden) * d * 2                     # o_proj (+ reduce)


def _mla_absorbed(attn, shape: StepShape, d: int, selected: int | None, triton: bool) -> int:
    """Absorbed MLA (decode, DSA's sparse prefill over each token's ``selected`` keys, short dense
    chunks): ``q W_UK`` (einsum copies of q and the weight), :func:`kernels.mla_attention`, ``W_UV``
    after. Triton: the output and, for few programs, split-K partials. The reference walks
    :func:`kernels.mla_attention.absorbed_ref_tiles`: per row chunk float32 state and per key tile
    the gathered rows, their indices and the scores, nothing of the context's size."""
    t, h = shape.num_tokens, attn.num_heads
    nope, rope, v, lora = attn.nope_dim, attn.rope_dim, attn.v_dim, attn.kv_lora_rank
    keys = selected or shape.max_seq_len
    total = _n(h, t, nope) * d + _n(h, nope + v, lora) * d + _n(t, h, lora) * d * 2 + _n(t, h, v) * d * 2
    total += _n(t) * 8 * 4                                                               # token_seq / token_pos
    if triton:   # kernels/mla_attention_triton.py: choose_splits with 16-head tiles at kv_lora >= 256
        tiles = -(-h // (16 if lora >= 256 else 64))
        splits = 1 if t * tiles >= 512 else max(1, min(-(-keys // 256), -(-512 // (t * tiles)), 64))
        return total + _n(t, h, splits) * 4 + (_n(t, h, splits, lora) * 4 if splits > 1 else 0)
    rows, tile = absorbed_ref_tiles(keys, lora + rope, h)
    rows = min(rows, t)
    state = _n(rows, h, lora) * 4 * 4 + _n(rows, h) * 4 * 6 + (_n(rows, h, lora + rope) * 4 if d != 4 else 0)
    gather = _n(rows, tile) * (8 * 6 + 2) + _n(rows, tile, lora + rope) * (d + (4 if d != 4 else 0))
    return total + state + gather + _n(rows, h, tile) * 4 * 5


def _mla_expanded(attn, shape: StepShape, d: int, triton: bool, block_size: int) -> int:
    """Dense prefill expanded per key chunk (:func:`kernels.mla_prefill.mla_prefill_dense`): the
    float32 online-softmax state ``[T, H, v + 2]``; per chunk of
    :func:`kernels.mla_prefill.expanded_chunk_keys` positions the gathered latent rows and their
    ``kv_b_proj`` expansion (the reference: float32 copies and ``[rows, H, C]`` score tiles within the
    workspace); the normalized output. Nothing of size ``tokens x context``."""
    t, b, q, s, h = shape.num_tokens, shape.num_seqs, shape.max_query_len, shape.max_seq_len, attn.num_heads
    nope, rope, v, lora = attn.nope_dim, attn.rope_dim, attn.v_dim, attn.kv_lora_rank
    chunk = min(s, expanded_chunk_keys(b, h, nope + v, lora + rope, block_size))
    total = _n(t, h, v) * 4 + _n(t, h) * 4 * 2 + _n(t) * 8 * 4                           # state, token_pos
    total += _n(b, chunk) * 8 * 4 + _n(b, chunk, lora + rope) * d + _n(b, chunk, lora) * d   # slots, latent
    total += _n(b, chunk, h, nope + v) * d                                               # expanded chunk
    if not triton:
        rows = min(q, max(1, WORKSPACE_ELEMENTS // max(1, h * chunk)))
        total += _n(chunk, h, nope + v) * 4 + _n(chunk, rope) * 4 + _n(chunk) * 8        # float32 keys, values
        total += _n(rows, h, chunk) * 4 * 4 + _n(rows, chunk) + _n(rows, h, v) * 4 * 3 + _n(rows, h) * 4 * 6
    return total + _n(t, h, v) * (4 + d) + _n(t, h) * 4 + _n(t, h, v) * d               # output, o_proj input


def _indexer(indexer, shape: StepShape, hidden: int, d: int, top_k: int, triton: bool) -> int:
    """DSA lightning indexer (``workers/models/dsa_indexer.py``): q/k projections, RoPE and the
    Hadamard rotation, then (when a context exceeds ``top_k``) per-head weights and
    :func:`kernels.indexer.indexer_topk`: one bounded chunk of rows at a time
    (:func:`kernels.workspace.plan_row_chunks`), its float32 logits and their top-k; Triton keeps
    the sort's workspace of ``torch.topk`` over the chunk (values and int64 indices), the reference
    its score tiles (a quarter of the workspace each; short runs of rows gather each row's own keys,
    :func:`_short_rows`) and the causal mask."""
    t, s, heads, dim = shape.num_tokens, shape.max_seq_len, indexer.num_heads, indexer.head_dim
    q = _n(t, heads, dim)
    # Phase 1, q and k made: projections and RoPE (a rotated part and the concatenation), then the
    # Hadamard rotation (the reference in float32); the unrotated q is gone after each.
    rope = _rope(t, heads + 1, indexer.rope_dim, d, triton)
    made = max(q * d * 2 + rope, q * d + q * (d if triton else 4 * 3)) + _n(t, dim) * d * 4
    if s <= top_k:
        return made
    # Phase 2, scoring: the final q, per-head weights, the result, then one row chunk at a time.
    total = q * d + _n(t, hidden) * 4 + _n(t, heads) * 4 * 2 + _n(t, top_k) * 4 + _n(t) * 8 * 4
    if indexer.cache_fp8:
        total += q * (4 * 4 + 1)                                                          # quantized q
    chunks = _indexer_chunks(shape)
    rows = max(c.end - c.start for c in chunks)
    logits = max((c.end - c.start) * c.width for c in chunks)
    keep = min(top_k, s)
    topk = _n(rows, keep) * (4 + 8 + 1 + 8 * 3 + 4) + _n(rows, top_k) * 4
    topk += _n(rows, keep) * (8 * 4 + 1)      # the tie-break (its running count overwrites the logits)
    if triton:
        return max(made, total + logits * (4 + 12) + topk)
    # Score tiles [rows of one sequence, H, keys] within a quarter of the workspace.
    seg_rows = rows if shape.max_query_len == 1 else min(rows, shape.max_query_len)
    keys = min(s, max(1, WORKSPACE_ELEMENTS // 4 // (seg_rows * heads)))
    tile = _n(seg_rows, heads, keys)
    work = _n(rows, heads, dim) * 4 + _n(rows, heads) * 4 + logits * (4 + 1) + _n(s) * 8 * 6
    gathered = _n(seg_rows if shape.max_query_len == 1 else 1, keys, dim) * (4 + d) + _n(keys) * 8 * 6
    scoring = tile * 4 + _n(seg_rows, keys) * 4 + gathered
    short = _short_rows(shape, rows)
    if short:   # short runs scored together: their rows' q, weights and logits, each row's own keys
        keys = min(s, max(1, WORKSPACE_ELEMENTS // 4 // (short * heads)))
        copies = _n(short) * 8 * 3 + _n(short, heads, dim) * 4 + _n(short, heads) * 4 + _n(short, s) * 4
        tiles = _n(short, keys) * (8 * 4 + 4) + _n(short, keys, dim) * (4 + d) + _n(short, heads, keys) * 4
        scoring = max(scoring, copies + tiles)
    return max(made, total + work + scoring + topk)


def _short_rows(shape: StepShape, rows: int) -> int:
    """Rows of a chunk that :func:`kernels.indexer.score_rows_ref` may score as short runs
    (``SHORT_SEGMENT_ROWS`` rows of a sequence at most): all of them when no query is longer,
    else those of every sequence but one; none in decode steps (their own path)."""
    if shape.max_query_len == 1:
        return 0
    if shape.max_query_len <= SHORT_SEGMENT_ROWS:
        return rows
    return min(rows, (shape.num_seqs - 1) * SHORT_SEGMENT_ROWS)


def _indexer_chunks(shape: StepShape):
    """The indexer's row chunks for ``shape`` (the kernel's own planner over the same bounds)."""
    if shape.max_query_len == 1:
        return plan_row_chunks(shape.num_tokens, shape.max_seq_len)
    per_seq = [shape.num_tokens // shape.num_seqs + (b < shape.num_tokens % shape.num_seqs)
               for b in range(shape.num_seqs)]
    query_start = [0]
    for count in per_seq:
        query_start.append(query_start[-1] + count)
    return plan_row_chunks(shape.num_tokens, shape.max_seq_len, query_start, [shape.max_seq_len] * shape.num_seqs)


def _gqa(attn, shape: StepShape, hidden: int, d: int, triton: bool, gated: bool) -> int:
    """GQA attention (Llama, Qwen3-Next's gated attention) over the paged K/V cache: projections,
    RoPE, ``paged_attention``. The Triton kernel allocates its output only; the reference gathers
    each sequence's K/V, pads the queries and materializes float32 scores (``kernels/paged_attention.py``)."""
    t, b, q, s = shape.num_tokens, shape.num_seqs, shape.max_query_len, shape.max_seq_len
    heads, kv, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    width = (2 * heads if gated else heads) + 2 * kv
    total = _n(t, width, dim) * d + _rope(t, heads + kv, dim, d, triton) * (2 if gated else 1)
    if gated:   # q/k norms on copies, the gate's copy, sigmoid and product
        total += _n(t, heads + kv, dim) * d + _norm(t * (heads + kv), dim, d, triton) + _n(t, heads, dim) * d * 4
    total += _n(t, heads, dim) * d                                                       # output
    if not triton:
        blocks = -(-s // 16) * 16                                                        # at most a block more
        if q == 1 and d != 4:                                                            # paged_decode_attention
            total += _n(b, blocks, kv, dim) * d * 2 + _n(b, blocks) * 9
        else:
            total += _n(b, s) * (8 * 3 + 2) + _n(b, q, s) * 4 + _n(b, kv, s) * 8         # layout (step-cached)
            total += _n(b, q, heads, dim) * d * 3 + _n(b, kv, s, dim) * d * 2             # q pad, K, V, output
            if d != 4:   # grouped_attention, in float32: q, K, V and output copies, scores, probs
                total += _n(b, q, heads, dim) * 8 + _n(b, kv, s, dim) * 8 + _n(b, heads, q, s) * 8
    return total + _n(t, hidden) * d * 2


def _deltanet(layer, shape: StepShape, hidden: int, d: int, triton: bool) -> int:
    """Gated DeltaNet (``workers/models/gated_deltanet.py``): projections, the causal conv, l2-normed
    q/k, gates, the delta rule and the gated norm, per token (its state is per sequence, in the slot
    pool). The reference delta rule works in float32: chunked (prefill) on each sequence padded to
    whole chunks of 64, with ``[H, chunks, 64, 64]`` decay and system matrices; recurrent (decode)
    on a float32 copy of every sequence's state."""
    t, hv, kh = shape.num_tokens, layer.num_v_heads, layer.num_k_heads
    dk, dv, conv = layer.head_k_dim, layer.head_v_dim, layer.conv_dim
    total = _n(t, 2 * kh * dk + 2 * hv * dv + 2 * hv) * d + _n(t, conv) * d * 3         # proj, cat, conv
    total += _n(t, kh, dk) * 4 * 6 + _n(t, hv, dv) * d * 3 + _n(t, hv) * 4 * 6           # q, k, v, z, g, beta
    total += _n(t, hv, dv) * (d + 4)                                                     # out (+ float32 result)
    if not triton and shape.max_query_len > 1:
        padded = -(-shape.max_query_len // 64) * 64
        total += _n(hv, padded) * (4 * (4 * dk + 3 * dv) + 64 * 4 * 6)
    elif not triton:
        total += _n(shape.num_seqs, hv, dk, dv) * 4 * 5 + _n(shape.num_seqs, hv, dk + dv) * 4 * 4
    return total + _n(t, hv, dv) * (4 * 4 + d * 3) + _n(t, hidden) * d * 2               # gated norm, out_proj


# -- MLP / MoE -------------------------------------------------------------------------------

def _mlp(mlp, tokens: int, hidden: int, d: int, triton: bool) -> int:
    """SwiGLU MLP: gate/up, the activation (the reference: ``silu`` then the product), down."""
    inter = mlp.gate_up_proj.weight.shape[0] // 2 if mlp.gate_up_proj.weight is not None \
        else mlp.gate_up_proj.packed.shape[0] // 2
    return _n(tokens, 2 * inter) * d + _n(tokens, inter) * d * (1 if triton else 2) + _n(tokens, hidden) * d * 2


def _experts(experts, tokens: int, top_k: int, d: int, triton: bool, graph_safe: bool = False) -> int:
    """Routed experts (:func:`kernels.fused_moe`). Triton: the pair alignment, the SiLU-mul
    intermediate ``[T k, I]`` and the float32 pair outputs ``[T k, H]``. Reference (the CPU path,
    not graph-safe): the pairs sorted by expert, then one expert's rows (at most ``T``) at a time;
    FP8 experts dequantized whole. ``graph_safe`` (the decode-graph stand-in on CPU): the pair-wise
    reference, a chunk of pairs against their gathered weights."""
    hidden, inter, local = experts.hidden_size, experts.intermediate_size, experts.count
    pairs = tokens * top_k
    if triton:
        block_m = 16 if pairs <= 256 else 64
        capacity = -(-(pairs + min(pairs, local) * (block_m - 1)) // block_m) * block_m
        align = _n(pairs) * 8 * 6 + capacity * 4 + _n(local + 1) * 8 * 4
        return align + _n(pairs, inter) * d + _n(pairs, hidden) * 4 + _n(tokens, hidden) * (4 + d)
    if graph_safe and tokens <= PAIRWISE_MAX_TOKENS:
        per_pair = 3 * inter * hidden * d
        chunk = min(pairs, max(1, PAIRWISE_CHUNK_BYTES // per_pair))
        total = (_n(tokens, top_k) * (8 * 3 + 4 * 2 + 1) + _n(pairs, hidden) * d * 2 + chunk * per_pair
                 + _n(chunk, 2 * inter) * d * 2 + _n(chunk, inter) * d * 2 + _n(chunk, hidden) * d * 3
                 + _n(tokens, hidden) * d * 2)
    else:
        total = _n(tokens, hidden) * d + _n(tokens, top_k) * (1 + 8 * 4)               # out, the sort
        total += _n(tokens, hidden) * (3 * d + 4) + _n(tokens, inter) * d * 4 + _n(tokens) * 8 * 2   # one expert's rows
    if experts.w13_weight.dtype == torch.float8_e4m3fn:
        total += (experts.w13_weight.numel() + experts.w2_weight.numel()) * d + _n(2 * inter, hidden) * 4 * 3
    return total


def _moe(moe, tokens: int, hidden: int, d: int, triton: bool, graph_safe: bool = False) -> int:
    """A MoE sublayer: router (float32 scores and masks over the experts), routed experts, the
    shared expert(s), their sum (and the all-reduce)."""
    num_experts = moe.gate.weight.shape[0]
    top_k = getattr(moe.gate, "top_k", None) or moe.top_k
    router = _n(tokens, hidden) * 4 + _n(tokens, num_experts) * (4 * 5 + 3) + _n(tokens, top_k) * (4 * 4 + 8 * 2)
    shared = getattr(moe, "shared_experts", None) or getattr(moe, "shared_expert", None)
    total = router + _experts(moe.experts, tokens, top_k, d, triton, graph_safe)
    if shared is not None:
        total += _mlp(shared, tokens, hidden, d, triton) + _n(tokens, hidden) * d * 3   # gate, product
    return total + _n(tokens, hidden) * d * 2


# -- whole step ------------------------------------------------------------------------------

def _sublayer_peaks(layer, shape: StepShape, hidden: int, d: int, top_k: int | None, triton: bool,
                    block_size: int, graph_safe: bool = False) -> int:
    """The larger of a decoder layer's token mixer and its MLP / MoE."""
    from shardserve.workers.models.gated_deltanet import GatedDeltaNet
    from shardserve.workers.models.mla import MLAAttention

    mixer = getattr(layer, "self_attn", None) or getattr(layer, "linear_attn", None)
    if isinstance(mixer, MLAAttention):
        attn = _mla(mixer, shape, hidden, d, top_k, triton, block_size)
    elif isinstance(mixer, GatedDeltaNet):
        attn = _deltanet(mixer, shape, hidden, d, triton)
    else:
        attn = _gqa(mixer, shape, hidden, d, triton, gated=type(mixer).__name__ == "Qwen3NextAttention")
    mlp = layer.mlp
    if hasattr(mlp, "experts"):
        ffn = _moe(mlp, shape.num_tokens, hidden, d, triton, graph_safe)
    else:
        ffn = _mlp(mlp, shape.num_tokens, hidden, d, triton)
    return max(attn, ffn)


def _logits(head, rows: int, d: int) -> int:
    """LM head and sampler over ``R`` rows: the local float32 logits, the gathered ones (with the
    gather's padded parts) and the sampler's sort (values, int64 order) with its masks, softmaxes
    and the scatter back (``workers/sampler.py: filter_logits``), and the probabilities."""
    vocab = sum(head.sizes)
    local = head.vocab_size_local
    return _n(rows, local) * (d + 4) + _n(rows, vocab) * 4 * (2 if len(head.sizes) > 1 else 0) \
        + _n(rows, vocab) * (4 * 8 + 8 + 3)


def _inputs(shape: StepShape, block_size: int) -> int:
    """The step's device inputs (ids, positions, slots, lengths, block tables, logit rows), twice
    (the stager's buffer and the views cut from it), and MLA's dense-group indices of a mixed step."""
    t, b, s = shape.num_tokens, shape.num_seqs, shape.max_seq_len
    inputs = (_n(t) * 3 + _n(b + 1) * 2 + _n(b, -(-s // block_size)) + shape.num_logit_rows) * 8 * 2
    return inputs + (_n(t + 2 * b + 1) * 8 + _n(b, -(-s // block_size)) * 4) * 2


def step_activation_bytes(model, shape: StepShape, triton: bool, block_size: int = 16, graph_safe: bool = False) -> int:
    """Peak bytes a forward of ``shape`` (with the LM head and the sampler over its logit rows)
    allocates on this rank above the weights and caches: the activation reserve.

    Args:
        model: this rank's model, loaded or on the meta device (local head counts and widths are
            read off its modules): Llama, DeepSeek-V3 / V3.2, GLM-MoE-DSA, Qwen3-Next, or the MTP
            draft model.
        shape: the step (:meth:`StepShape.prefill` for the profile, :meth:`StepShape.decode` for
            a captured graph).
        triton: the CUDA path's kernels (True) or the torch references (False).
        block_size: tokens per KV block (the block tables' width).
        graph_safe: a step run under the decode graphs' guard (the CPU stand-in, ``replay``): the
            torch MoE reference then takes its sync-free pair-wise form.

    Returns:
        bytes (an upper bound of the GPU path; see the module docstring for what is counted).
    """
    d = dtype_bytes(model)
    if hasattr(model, "mtp"):   # the MTP draft: one decoder layer behind eh_proj
        layers, hidden = [model.mtp], model.config.hidden_size
        top_k, head = model.top_k, model.mtp.shared_head.head
    else:
        layers, hidden = list(model.model.layers), model.config.hidden_size
        top_k = getattr(model, "dsa_top_k", None) if getattr(model, "dsa_enabled", False) else None
        head = model.lm_head
    t = shape.num_tokens
    stream = _n(t, hidden) * d * 4 + _norm(t, hidden, d, triton)              # hidden, residual, norm outputs
    embed = _n(t, hidden) * d * 3 + _n(t) * 8 * 3
    peak = max(_sublayer_peaks(layer, shape, hidden, d, top_k, triton, block_size, graph_safe) for layer in layers)
    rows = shape.num_logit_rows
    logits = _n(rows, hidden) * d * 2 + _logits(head, rows, d)
    return _inputs(shape, block_size) + max(embed, stream + peak, stream + logits)
