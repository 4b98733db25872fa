"""Data-parallel attention vs plain tensor parallelism on CPU (issue 29): decode throughput at 1, 8
and 32 concurrent requests and the replica's KV capacity, TP=2 against DP attention over the same
2 ranks (``--enable-dp-attention``, 2 groups of 1 rank) with ``--moe-a2a allgather`` and ``alltoall``.

The model is a scaled-down DeepSeek-V3.2 (MLA + DSA indexer + MoE with a shared expert: hidden 256,
4 layers of which 3 MoE, 16 heads, 32 routed experts, top-4) with random weights, built by
transformers' own classes and written with ``save_pretrained`` (``tests/models/tiny_checkpoints.py``).
Each configuration is one replica as ``shardserve generate -tp 2`` runs it: a coordinator and two
shard workers on a local Ray cluster, the same per-rank KV budget (``--kv-cache-gib``), greedy
requests of ``--prompt-len`` random tokens and ``--new-tokens`` output tokens each, all sent at once.
Printed per configuration: output tokens per second at each concurrency (wall time of the whole
batch, after one warm-up request), the replica's KV capacity in tokens (ModelInfo's
``kv_capacity_tokens``), and whether the greedy outputs equal TP=2's. Ratios are against TP=2 in
the same run; compare nothing across runs.

Run (after ``make install``; about a minute per configuration on 2 quiet cores)::

    TMPDIR=/tmp/bench python benchmarks/bench_dp_attention.py

Exits 2 with one line when this build refuses DP attention (the runtime is not there) or the
replica fails to start. Not a test.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

# A DeepSeek-V3.2 shape scaled down (the released model: hidden 7168, 61 layers of which 58 MoE,
# 128 heads, kv_lora_rank 512, 256 routed experts, top-8 in 8 groups, 1 shared expert, index_topk 2048).
SHAPE = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
             num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
             q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
             n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
             index_topk=64, index_head_dim=32, index_n_heads=8, max_position_embeddings=1024,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                              "original_max_position_embeddings": 256})
CONFIGS = {   # name -> EngineArgs fields beyond the shared ones
    "TP=2": {},
    "DP-attn=2 allgather": {"enable_dp_attention": True, "moe_a2a": "allgather"},
    "DP-attn=2 alltoall": {"enable_dp_attention": True, "moe_a2a": "alltoall"},
}


def engine_args(model: str, fields: dict, kv_cache_gib: float, max_num_seqs: int):
    """The replica's :class:`EngineArgs` for one configuration (2 ranks, CPU, float32)."""
    from shardserve.cluster.config import EngineArgs

    return EngineArgs(model=model, tensor_parallel_size=2, device="cpu", dtype="float32", kv_cache_gib=kv_cache_gib,
                      max_num_seqs=max_num_seqs, enable_prefix_caching=False, **fields)


def check_supported(model: str, names: list[str], kv_cache_gib: float, max_num_seqs: int) -> None:
    """The configurations' arguments as ``generate`` / ``serve`` check them before loading.

    Raises:
        ValueError: a configuration is refused (e.g. MTP with DP attention).
    """
    from shardserve.cluster.dp_attention_args import check_dp_attention_start

    for name in names:
        args = engine_args(model, CONFIGS[name], kv_cache_gib, max_num_seqs)
        args.validate()
        try:
            check_dp_attention_start(args)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None


def measure(model: str, fields: dict, prompts: list[list[int]], concurrency: list[int], new_tokens: int,
            kv_cache_gib: float) -> dict:
    """One configuration: ``{"tok_s": {c: output tokens/s}, "kv_tokens": int, "outputs": {c: [ids]}}``.

    Raises:
        RuntimeError: the replica failed to start or to serve (its root cause, one line).
    """
    import ray

    from shardserve.cluster.engine.request import SamplingParams
    from shardserve.cluster.ray_errors import root_cause
    from shardserve.cluster.replica.coordinator import launch_coordinator, stop_coordinator
    from shardserve.cluster.replica.worker_group import GroupConfig

    args = engine_args(model, fields, kv_cache_gib, max(concurrency))
    handle, pg = launch_coordinator(args, GroupConfig(tensor_parallel_size=2, cpus_per_worker=1.0, device="cpu"))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    try:
        ray.get(handle.complete.remote(prompts[0][:8], SamplingParams(max_tokens=4, temperature=0.0)))  # warm-up
        info = ray.get(handle.model_info.remote())
        out = {"tok_s": {}, "outputs": {},
               "kv_tokens": info.get("kv_capacity_tokens") or info["num_blocks"] * info["block_size"]}
        for count in concurrency:
            started = time.perf_counter()
            done = ray.get([handle.complete.remote(prompt, params) for prompt in prompts[:count]])
            wall = time.perf_counter() - started
            out["tok_s"][count] = sum(len(d["token_ids"]) for d in done) / wall
            out["outputs"][count] = [d["token_ids"] for d in done]
        return out
    except ray.exceptions.RayError as exc:
        raise RuntimeError(root_cause(exc)) from None
    finally:
        stop_coordinator(handle, pg)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8,32", help="concurrent requests per measurement, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--kv-cache-gib", type=float, default=0.02, help="KV cache budget per rank, GiB")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"configurations to run, comma-separated (default: all of {', '.join(CONFIGS)})")
    ns = parser.parse_args()
    concurrency = [int(c) for c in ns.concurrency.split(",")]
    names = [name.strip() for name in ns.configs.split(",")]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")

    import ray
    import torch

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, SHAPE["vocab_size"], (ns.prompt_len,), generator=generator).tolist()
               for _ in range(max(concurrency))]
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_checkpoint("deepseek_v32", tmp, seed=0, tokenizer=True, **SHAPE)
        try:
            check_supported(tmp, names, ns.kv_cache_gib, max(concurrency))
        except ValueError as exc:
            print(f"bench_dp_attention: {exc}", file=sys.stderr)
            return 2
        ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        rows = {}
        try:
            for name in names:
                try:
                    rows[name] = measure(tmp, CONFIGS[name], prompts, concurrency, ns.new_tokens, ns.kv_cache_gib)
                except RuntimeError as exc:
                    print(f"bench_dp_attention: {name}: the replica failed: {exc}", file=sys.stderr)
                    return 2
                print(f"  {name}: done", file=sys.stderr, flush=True)
        finally:
            ray.shutdown()
    print_table(rows, concurrency, ns)
    return 0


def print_table(rows: dict, concurrency: list[int], ns: argparse.Namespace) -> None:
    """Tokens/s per concurrency and KV capacity per configuration, with ratios against TP=2."""
    base = rows.get("TP=2")
    print(f"scaled-down DeepSeek-V3.2 on CPU, 2 ranks, {ns.prompt_len}-token prompts, {ns.new_tokens} new tokens "
          f"each, --kv-cache-gib {ns.kv_cache_gib} per rank")
    def cell(value: float, ref: float | None) -> str:
        return f"{value:.1f}" + (f" ({value / ref:.2f}x)" if ref else "")

    print(f"{'configuration':<22}" + "".join(f"{f'tok/s @{c}':>18}" for c in concurrency)
          + f"{'KV tokens':>18}  greedy == TP=2")
    for name, row in rows.items():
        cells = "".join(f"{cell(row['tok_s'][c], base and base['tok_s'][c]):>18}" for c in concurrency)
        kv = cell(row["kv_tokens"], base and base["kv_tokens"]).replace(".0 (", " (", 1)
        same = "-" if not base or row is base else ("yes" if row["outputs"] == base["outputs"] else "no")
        print(f"{name:<22}{cells}{kv:>18}  {same}")

if __name__ == "__main__":
    sys.exit(main())
