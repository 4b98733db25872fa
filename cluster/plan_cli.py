"""``shardserve plan MODEL``: what each rank would hold, and whether it fits, without a GPU.

Every rank's model is built on the meta device by the code ``serve`` loads it with, from the
checkpoint's metadata or from a folder holding only ``config.json``, and planned by
``workers/plan.py`` (the plan every ``serve`` rank logs at start-up). Prints per rank the weights
by storage format, the KV / indexer / draft bytes per token, the activation and graph reserves, and
the KV blocks, tokens and concurrent sequences that fit; exit code 0 when it fits, 2 with one line
naming the numbers when it does not. ``--json`` prints the plan as one JSON object.
``--enable-dp-attention`` plans the data-parallel-attention layout (``workers/plan_dp.py``): per-rank
weights with attention split over its group and everything else over all ranks, and the replica's
KV capacity in tokens (one pool per attention group) beside plain TP's at the same ranks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardserve.cluster.cli_types import finite_float, finite_floats
from shardserve.workers.device import GIB


def _gib(text: str) -> float:
    """argparse type of ``--gpu-memory-gib``: a number > 0."""
    value = finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 GiB, got {text}")
    return value


def add_plan_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``plan`` beyond the engine's (``cli._engine_flags``)."""
    parser.add_argument("model_arg", nargs="?", metavar="MODEL", default=None,
                        help="model to plan: a known name, a .gguf file, or an HF folder (config.json alone is "
                             "enough; default: --model)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--tensor-split", type=finite_floats, default=None,
                        help="relative share of each TP rank, e.g. 2,1 (default: even)")
    parser.add_argument("--gpus-per-worker", type=finite_float, default=1.0,
                        help="GPUs per rank; below 1 a rank plans for that share of its GPU")
    parser.add_argument("--gpu-memory-gib", type=_gib, default=None,
                        help="memory of one GPU in GiB (default: this machine's GPU; without one, --device auto "
                             "plans for this machine's CPU and --device cuda needs this flag)")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def _device_bytes(ns: argparse.Namespace, device: str) -> int:
    """One rank's device memory: ``--gpu-memory-gib`` (or the visible GPU) times its GPU share;
    the host memory available on CPU."""
    from shardserve.workers.device import host_memory_available, visible_gpus

    if device == "cpu":
        return host_memory_available()
    if ns.gpu_memory_gib is not None:
        total = int(ns.gpu_memory_gib * GIB)
    elif visible_gpus():
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
    else:
        raise ValueError("no GPU is visible here: give --gpu-memory-gib (80 for an H100, 141 for an H200)")
    if not 0 < ns.gpus_per_worker:
        raise ValueError(f"--gpus-per-worker must be > 0, got {ns.gpus_per_worker}")
    return int(total * min(1.0, ns.gpus_per_worker))


def _plan_device(ns: argparse.Namespace, device: str) -> str:
    """The device ``plan`` plans for: ``--device`` when given; under ``auto`` a GPU when one is
    visible or ``--gpu-memory-gib`` names one, else this machine's CPU (where ``serve`` would run)."""
    from shardserve.workers.device import visible_gpus

    if device != "auto":
        return device
    return "cuda" if ns.gpu_memory_gib is not None or visible_gpus() else "cpu"


def build_plan(ns: argparse.Namespace, args):
    """The :class:`workers.plan.ReplicaPlan` of ``plan``'s arguments (``args``: their EngineArgs).

    Raises:
        ValueError / FileNotFoundError: bad arguments, no ``config.json``, an unknown architecture, a
            split the model cannot take (one line each).
    """
    from shardserve.workers.checkpoint import GGUFCheckpoint
    from shardserve.workers.device import resolve_dtype
    from shardserve.workers.model_source import load_config, model_context_length, resolve_model
    from shardserve.workers.plan import PlanConfig, open_for_plan, plan_replica
    from shardserve.workers.quantization import weight_format_for

    args.validate()
    files = resolve_model(args.model)
    if not files.is_gguf and not (files.path / "config.json").is_file():
        raise FileNotFoundError(f"{files.path}: no config.json (plan reads the model's shape from it)")
    hf_config = args.model_config(load_config(files))
    args.check_model_limits(hf_config)
    device = _plan_device(ns, args.device)
    ckpt = open_for_plan(files.path, hf_config)
    gguf_types = ckpt.matrix_types() if isinstance(ckpt, GGUFCheckpoint) else None
    dtype = resolve_dtype(args.dtype, device, gguf_types, args.quantization)
    model_len = model_context_length(hf_config)
    config = PlanConfig(
        tensor_parallel_size=args.tensor_parallel_size, device=device, device_bytes=_device_bytes(ns, device),
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_bytes=int(args.kv_cache_gib * GIB),
        block_size=args.block_size, max_model_len=min(args.max_model_len or model_len, model_len),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager, triton=device == "cuda" and _cuda_kernels())
    groups = args.attention_groups
    fmt = (weight_format_for(dtype, args.quantization, isinstance(ckpt, GGUFCheckpoint), args.packed_dense_rows, ckpt)
           if device == "cpu" else None)
    if args.enable_dp_attention:
        from shardserve.workers.plan_dp import plan_dp_replica

        plan = plan_dp_replica(hf_config, ckpt, config, dtype, groups, fmt, args.speculative_tokens)
    else:
        plan = plan_replica(hf_config, ckpt, config, dtype, args.tensor_split, fmt, args.speculative_tokens)
    source = "config.json only" if not any(Path(files.path).glob("*.safetensors")) and not files.is_gguf else "checkpoint"
    layout = f" (DP attention: {groups} groups, --moe-a2a {args.moe_a2a})" if args.enable_dp_attention else ""
    copies = (f", dense {str(dtype).removeprefix('torch.')} copies for matmuls of >= {fmt.dense_rows} rows"
              if fmt is not None and fmt.dense_rows else "")
    plan.notes.append(f"{files.name} ({type(hf_config).__name__.removesuffix('Config')}, {source}), "
                      f"TP={args.tensor_parallel_size}{layout}, {str(dtype).removeprefix('torch.')}{copies}, {device}")
    return plan


def _cuda_kernels() -> bool:
    """The CUDA path runs the Triton kernels unless ``SHARDSERVE_KERNELS=torch``."""
    import os

    return os.environ.get("SHARDSERVE_KERNELS", "").lower() != "torch"


def _table(plan) -> str:
    """Ranks as columns (identical ranks share one), quantities as rows."""
    from shardserve.workers.plan import size_text as gib

    groups: list[tuple[list[int], object]] = []
    for rank in plan.ranks:
        key = rank.summary().split(":", 1)[1]
        if groups and groups[-1][1].summary().split(":", 1)[1] == key:
            groups[-1][0].append(rank.rank)
        else:
            groups.append(([rank.rank], rank))
    formats = sorted({name for rank in plan.ranks for name in rank.weight_bytes_by_dtype})
    rows = [("device", lambda r: gib(r.device_bytes)), ("usable", lambda r: gib(r.capacity)),
            ("weights", lambda r: gib(r.weight_bytes))]
    rows += [(f"  {name}", lambda r, n=name: gib(r.weight_bytes_by_dtype.get(n, 0))) for name in formats]
    rows += [("buffers (RoPE)", lambda r: gib(r.buffer_bytes)), ("draft weights", lambda r: gib(r.draft_weight_bytes)),
             ("KV bytes/token", lambda r: str(r.kv_bytes_per_token)),
             ("indexer bytes/token", lambda r: str(r.indexer_bytes_per_token)),
             ("draft bytes/token", lambda r: str(r.draft_bytes_per_token)),
             ("activation reserve", lambda r: gib(r.activation_bytes)), ("graph reserve", lambda r: gib(r.graph_bytes)),
             ("outside torch", lambda r: gib(r.overhead_bytes)), ("state pool", lambda r: gib(r.state_bytes)),
             ("KV budget", lambda r: gib(r.kv_budget_bytes)), ("KV blocks", lambda r: str(r.kv_blocks)),
             ("KV tokens", lambda r: str(r.kv_tokens)),
             (f"sequences of {plan.max_model_len}", lambda r: str(r.max_concurrent_seqs)),
             ("fits", lambda r: "yes" if r.fits else "no")]
    names = [f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}" for ranks, _ in groups]
    width = max(12, *(len(n) for n in names)) + 2
    lines = [" " * 22 + "".join(n.rjust(width) for n in names)]
    for label, value in rows:
        lines.append(label.ljust(22) + "".join(value(rank).rjust(width) for _, rank in groups))
    return "\n".join(lines)


def run_plan(ns: argparse.Namespace, args) -> int:
    """``shardserve plan``: print the plan; 0 when it fits, 2 (and one line on stderr) when not.
    With ``--enable-dp-attention`` the plan is :func:`workers.plan_dp.plan_dp_replica`'s, and the
    replica's KV capacity is printed beside plain TP's at the same ranks."""
    from shardserve.workers.plan_dp import summary_lines

    args.model = ns.model_arg or args.model
    plan = build_plan(ns, args)
    if ns.json:
        print(plan.to_json())
    else:
        first = plan.ranks[0]
        print(f"shardserve plan: {plan.notes[0]}, --max-model-len {plan.max_model_len}, block {first.block_size}")
        print(_table(plan))
        for line in summary_lines(plan):
            print(line)
        if plan.fits:
            pools = f" in each of {plan.attention_dp_size} attention groups" if plan.attention_dp_size > 1 else ""
            print(f"fits: {plan.kv_blocks} KV blocks on every rank{pools} = {plan.kv_tokens} tokens per replica, "
                  f"{plan.attention_dp_size * (plan.kv_blocks // first.blocks_per_seq)} concurrent sequences of "
                  f"{plan.max_model_len} tokens")
    if not plan.fits:
        print(f"shardserve: error: {plan.reason}", file=sys.stderr)
        return 2
    return 0
