"""The C decode attention of CPU ranks (``kernels/cpu_attention.c``) against its torch reference,
``paged_decode_attention``, which stays the path wherever the C kernel does not apply."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import make_block_tables
from shardserve.kernels import cpu_attention
from shardserve.kernels.paged_attention import (paged_attention, paged_decode_attention, store_kv_and_attend,
                                                  store_kv_ref)

# (block_size, seq_lens, num_heads, num_kv_heads, head_dim)
CASES = [
    (16, [1], 9, 3, 64),                 # SmolLM2's heads, the first position
    (16, [16, 17, 40], 9, 3, 64),        # ending on / one past a block boundary
    (16, [300], 32, 4, 128),             # Llama-3-style GQA, head_dim 128, many blocks
    (64, [70, 5], 8, 1, 80),             # MQA (8 heads per KV head), a head_dim with no constant path
    (1, [7, 3], 4, 4, 48),               # block_size 1, no GQA
    (16, [33], 16, 2, 256),              # Qwen3-Next's full-attention heads (8 per KV head, head_dim 256)
]


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    monkeypatch.delenv("SHARDSERVE_KERNELS", raising=False)
    if not cpu_attention.available():
        pytest.skip("no C compiler on this machine: the torch path runs")


@pytest.mark.parametrize("block_size, seq_lens, num_heads, num_kv, head_dim", CASES)
def test_decode_attention_matches_the_torch_path(block_size, seq_lens, num_heads, num_kv, head_dim):
    torch.manual_seed(0)
    block_tables, num_blocks = make_block_tables(seq_lens, block_size)
    k_cache = torch.randn(num_blocks, block_size, num_kv, head_dim, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    batch = len(seq_lens)
    # as a model passes it: a view of a wider [T, H + 2 Hkv, D] projection (token stride > H * D)
    query = torch.randn(batch, num_heads + 2 * num_kv, head_dim, dtype=torch.bfloat16)[:, :num_heads]
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    tables = block_tables.to(torch.int32)
    scale = head_dim ** -0.5
    ours = cpu_attention.decode_attention(query, k_cache, v_cache, tables, lens, scale, max(seq_lens))
    assert ours is not None and ours.dtype == torch.bfloat16 and ours.shape == (batch, num_heads, head_dim)
    ref = paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, max(seq_lens))
    exact = paged_decode_attention(query.float(), k_cache.float(), v_cache.float(), tables, lens, scale, max(seq_lens))
    # both float32 inside, one rounding to bf16: within two bf16 steps of the float32 result
    assert (ours.float() - exact).abs().max() <= 2 * 2 ** -8 * exact.abs().max().clamp(min=1)
    assert (ours.float() - ref.float()).abs().max() <= 2 * 2 ** -8 * exact.abs().max().clamp(min=1)


def test_store_kv_and_attend_stores_and_attends_in_one_call_on_small_bf16_decode_steps(monkeypatch):
    """This step's K/V land in the caches exactly as :func:`store_kv_ref` puts them (a negative slot,
    as the Triton store has it: not stored), and the result is the torch path's within bf16 rounding;
    ``SHARDSERVE_KERNELS=torch`` keeps the torch ops."""
    calls = []
    real = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *args: calls.append(args) or real(*args))
    torch.manual_seed(0)
    block_tables, num_blocks = make_block_tables([5, 9, 4], 16)
    tables = block_tables.to(torch.int32)
    k_cache = torch.randn(num_blocks, 16, 2, 32, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    qk = torch.randn(3, 4 + 2, 32, dtype=torch.bfloat16)             # as Llama passes them: Q and K out of
    query, key = qk[:, :4], qk[:, 4:]                                  # one RoPE call, V a view of the wider
    value = torch.randn(3, 4 + 2 + 2, 32, dtype=torch.bfloat16)[:, 6:]  # projection (other token strides)
    seq_lens = torch.tensor([5, 9, 4])
    slots = torch.stack([tables[b, (n - 1) // 16].long() * 16 + (n - 1) % 16 for b, n in enumerate([5, 9, 4])])
    slots[2] = -1                                                       # a placeholder row: not stored
    args = (slots, tables, seq_lens, torch.tensor([0, 1, 2, 3]), 0.2, 1, 9)
    k_ours, v_ours = k_cache.clone(), v_cache.clone()
    out = store_kv_and_attend(query, key, value, k_ours, v_ours, *args)
    assert len(calls) == 1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(key[:2], value[:2], k_ref, v_ref, slots[:2])
    assert torch.equal(k_ours, k_ref) and torch.equal(v_ours, v_ref)
    monkeypatch.setenv("SHARDSERVE_KERNELS", "torch")                 # the reference, as the switch says
    k_torch, v_torch = k_cache.clone(), v_cache.clone()
    store_kv_ref(key[:2], value[:2], k_torch, v_torch, slots[:2])
    ref = paged_attention(query, k_torch, v_torch, *args[1:])
    slots[2] = slots[1] + 1                                             # the torch path stores every row
    assert torch.equal(store_kv_and_attend(query, key, value, k_torch, v_torch, *args), ref) and len(calls) == 2
    assert (out.float() - ref.float()).abs().max() <= 2 * 2 ** -8 * ref.float().abs().max()
    assert not cpu_attention.available()


@pytest.mark.parametrize("change", ["float32", "group", "keys", "cache layout"])
def test_the_torch_path_runs_where_the_kernel_does_not_apply(change):
    block_tables, num_blocks = make_block_tables([20], 16)
    heads, num_kv = (18, 2) if change == "group" else (4, 2)
    dtype = torch.float32 if change == "float32" else torch.bfloat16
    k_cache = torch.randn(num_blocks, 16, num_kv, 32, dtype=dtype)
    if change == "cache layout":
        k_cache = k_cache.transpose(0, 1).contiguous().transpose(0, 1)
    query = torch.randn(1, heads, 32, dtype=dtype)
    longest = cpu_attention.MAX_DECODE_KEYS + 1 if change == "keys" else 20
    assert cpu_attention.decode_attention(query, k_cache, k_cache.clone(), block_tables.to(torch.int32),
                                          torch.tensor([20]), 0.2, longest) is None


def test_no_compiler_leaves_the_torch_path_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path))            # nothing built there yet
    monkeypatch.setattr(cpu_attention, "_lib", None)
    monkeypatch.setattr(cpu_attention, "_failed", False)
    assert not cpu_attention.available() and not cpu_attention.available()
    assert sum("CPU attention kernels unavailable" in r.message for r in caplog.records) == 1
    block_tables, num_blocks = make_block_tables([3], 16)
    k_cache = torch.randn(num_blocks, 16, 1, 16, dtype=torch.bfloat16)
    query = torch.randn(1, 2, 16, dtype=torch.bfloat16)
    out = paged_attention(query, k_cache, k_cache.clone(), block_tables.to(torch.int32), torch.tensor([3]),
                          torch.tensor([0, 1]), 0.25, 1, 3)
    assert out.shape == (1, 2, 16)


def test_edge_inputs_match_the_torch_path_or_fail_as_it_does():
    """A sequence of no keys attends to nothing (zeros, not 0/0); heads that do not split evenly
    over the KV heads are left to the torch path; a slot or block id outside the cache raises
    before anything is written (a raw write there would corrupt memory)."""
    block_tables, num_blocks = make_block_tables([5, 5], 16)
    tables = block_tables.to(torch.int32)
    k_cache = torch.randn(num_blocks, 16, 2, 32, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    query = torch.randn(2, 4, 32, dtype=torch.bfloat16)
    out = cpu_attention.decode_attention(query, k_cache, v_cache, tables, torch.tensor([0, 5]), 0.2, 5)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    uneven = torch.randn(1, 10, 32, dtype=torch.bfloat16)
    k4 = torch.randn(num_blocks, 16, 4, 32, dtype=torch.bfloat16)
    assert cpu_attention.decode_attention(uneven, k4, k4.clone(), tables[:1], torch.tensor([5]), 0.2, 5) is None
    before = k_cache.clone()
    key = torch.randn(2, 2, 32, dtype=torch.bfloat16)
    for slots, lens, table in ((torch.tensor([4, num_blocks * 16]), [5, 5], tables),      # a slot past the cache
                               (torch.tensor([4, 20]), [5, 5], tables.clone().fill_(num_blocks)),  # a block id
                               (torch.tensor([4, 20]), [5, 40], tables)):            # longer than its table
        with pytest.raises(IndexError, match="outside the cache"):
            cpu_attention.decode_attention(query, k_cache, v_cache, table, torch.tensor(lens), 0.2, max(lens),
                                           key, key, slots)
    assert torch.equal(k_cache, before)


def test_a_damaged_cached_library_is_built_again(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_attention, "_lib", None)
    monkeypatch.setattr(cpu_attention, "_failed", False)
    _, built = cpu_attention._target()
    built.parent.mkdir(parents=True)
    built.write_bytes(b"")                                              # e.g. a full disk, a copied cache
    assert cpu_attention.available() and built.stat().st_size > 0


def test_a_steps_tables_are_checked_once_for_all_its_layers(monkeypatch):
    """Layers of one step share the step cache: the tables' checks, addresses and score scratch are
    worked out by the first layer only, and each layer's result is the one it gets alone."""
    checks = []
    real = cpu_attention._step_args
    monkeypatch.setattr(cpu_attention, "_step_args", lambda *args: checks.append(args) or real(*args))
    torch.manual_seed(0)
    block_tables, num_blocks = make_block_tables([5, 20], 16)
    tables, lens = block_tables.to(torch.int32), torch.tensor([5, 20])
    step_cache: dict = {}
    for layer in range(3):
        k_cache = torch.randn(num_blocks, 16, 2, 32, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        query = torch.randn(2, 4, 32, dtype=torch.bfloat16)
        shared = cpu_attention.decode_attention(query, k_cache, v_cache, tables, lens, 0.2, 20, step_cache=step_cache)
        alone = cpu_attention.decode_attention(query, k_cache, v_cache, tables, lens, 0.2, 20)
        assert shared is not None and torch.equal(shared, alone), layer
    assert len(checks) == 1 + 3, "one check for the step's layers, one per call without a step cache"
