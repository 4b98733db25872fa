"""One MoE layer on 2 CPU ranks: plain TP (experts split, one all-reduce) vs data-parallel attention
(each rank its own group with its own tokens; ``--moe-a2a`` allgather and alltoall), same run.

Scaled-down DeepSeek-V3.2 MoE shape (hidden 512, 32 routed experts of 256 in 4 groups, top-8 of 2
groups, one shared expert), float32, shared-memory collectives, one thread per rank. Per token count
``T``: ms per layer call on rank 0 and microseconds per *replica* token (plain TP computes T tokens
per call; with DP attention each of the 2 groups brings its own T, so a call serves 2T), and the
ratio of the latter to plain TP's. Run: ``python benchmarks/bench_moe_exchange.py``; not a test.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

CONFIG = SimpleNamespace(hidden_size=512, moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=8,
                         n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1)
MODES = ("tp", "allgather", "alltoall")


def build(mode: str, rank: int):
    from shardserve.workers.models.moe import DeepseekMoE
    from shardserve.workers.partition import split_units

    shared = CONFIG.moe_intermediate_size * CONFIG.n_shared_experts
    shared_range = split_units(shared, 2)[rank] if mode == "tp" else (0, shared)
    moe = DeepseekMoE(CONFIG, split_units(CONFIG.n_routed_experts, 2)[rank], shared_range, torch.float32,
                      None if mode == "tp" else mode)
    gen = torch.Generator().manual_seed(0)
    for param in moe.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return moe


def _rank(rank: int, names: dict, sizes: list[int], iters: int, out_path: str) -> None:
    from shardserve.workers.comm_cpu import SharedMemoryGroup
    from shardserve.workers.distributed import TensorParallelGroup, set_tp_group

    torch.set_num_threads(1)
    results = {}
    for mode in MODES:
        group = SharedMemoryGroup(rank, 2, names[mode], 2 * max(sizes) * CONFIG.hidden_size * 2, timeout_s=120)
        set_tp_group(group) if mode == "tp" else set_tp_group(TensorParallelGroup(), group)
        moe = build(mode, rank)
        for tokens in sizes:
            hidden = torch.randn(tokens, CONFIG.hidden_size, generator=torch.Generator().manual_seed(rank))
            call = (lambda: moe(hidden)) if mode == "tp" else (lambda: moe.exchange_forward(hidden, [tokens, tokens]))
            with torch.inference_mode():
                call()
                start = time.perf_counter()
                for _ in range(iters):
                    call()
                results[mode, tokens] = (time.perf_counter() - start) / iters
        set_tp_group(TensorParallelGroup())
        group.close()
    if rank == 0:
        torch.save(results, out_path)


def main() -> None:
    from shardserve.workers.comm_cpu import SharedMemorySegment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128], help="tokens per rank per call")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per point")
    ns = parser.parse_args()
    segments = {mode: SharedMemorySegment(2, 2 * max(ns.tokens) * CONFIG.hidden_size * 2) for mode in MODES}
    out_path = tempfile.mktemp(suffix=".pt")
    try:
        mp.spawn(_rank, args=({m: s.name for m, s in segments.items()}, ns.tokens, ns.iters, out_path), nprocs=2)
    finally:
        for segment in segments.values():
            segment.close()
    results = torch.load(out_path)
    print(f"{'T':>5} {'mode':>10} {'ms/call':>9} {'us/replica token':>17} {'vs TP':>7}")
    for tokens in ns.tokens:
        tp_per_token = results["tp", tokens] / tokens
        for mode in MODES:
            per_token = results[mode, tokens] / (tokens if mode == "tp" else 2 * tokens)
            print(f"{tokens:>5} {mode:>10} {results[mode, tokens] * 1e3:>9.2f} {per_token * 1e6:>17.1f} "
                  f"{per_token / tp_per_token:>7.2f}")


if __name__ == "__main__":
    main()
