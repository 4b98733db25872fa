"""Data-parallel attention's flags and checks (issue 29), shared by every entry point.

``--enable-dp-attention`` (SGLang's name) splits a replica's ``N = --tensor-parallel-size`` ranks
into ``D = --attention-dp-size`` attention groups of ``G = N / D`` consecutive ranks. Each group is a
plain tensor-parallel group of ``G`` ranks for MLA (and the DSA indexer) and runs attention over its
own requests with its own KV + indexer cache pool; the routed experts (expert parallel), the dense
MLP layers, the shared experts, the embedding and the LM head are split over all ``N`` ranks and run
on every group's tokens (SGLang's layout; ``workers/models/group_exchange.py``), and the MoE layers
exchange tokens between the groups (``--moe-a2a allgather``: gather every group's hidden states,
reduce-scatter the outputs; ``alltoall``: each token goes only to the ranks holding its chosen
experts). ``--max-num-batched-tokens`` / ``--max-num-seqs`` are the replica's step budget, 1/D of it
per group. Under plain TP every rank of an MLA model stores every token's
latent (one latent head), so a replica's cache holds what one rank holds; with ``D`` groups it holds
``D`` times that. The layout pays for MLA + MoE models only (DeepSeek-V3 / V3.2, GLM-5): without MLA
the KV cache already splits by head under TP, without MoE there is nothing to run expert-parallel.

Registered by :mod:`cluster.cli` (flags on ``generate``, ``serve``, ``serve-grpc``, ``manifest`` and
``plan``), read by :class:`cluster.config.EngineArgs` (``validate`` / ``check_model_limits``) and
:class:`cluster.serve_app.ServeArgs`. Every refusal is one line (``ValueError``): exit code 2 on the
command line, an error at ``serve deploy`` / replica start-up elsewhere.
"""

from __future__ import annotations

import argparse

MOE_A2A_CHOICES = ("allgather", "alltoall")
PURPOSE = ("data-parallel attention is for MLA + MoE models (DeepSeek-V3 / V3.2, GLM-5 style), whose "
           "latent KV cache every tensor-parallel rank would otherwise hold in full")


def add_dp_attention_flags(parser: argparse.ArgumentParser) -> None:
    """``--enable-dp-attention``, ``--attention-dp-size D`` and ``--moe-a2a`` (help names defaults)."""
    parser.add_argument("--enable-dp-attention", action="store_true",
                        help="data-parallel attention inside a replica (MLA + MoE models: DeepSeek-V3/V3.2, "
                             "GLM-5): attention groups of ranks each serve their own requests with their own KV "
                             "cache, routed experts are split over all ranks (expert parallel)")
    parser.add_argument("--attention-dp-size", type=int, default=None, metavar="D",
                        help="with --enable-dp-attention: attention groups per replica, dividing "
                             "--tensor-parallel-size; each group is tensor-parallel-size / D ranks (default: "
                             "--tensor-parallel-size, one rank per group)")
    parser.add_argument("--moe-a2a", choices=list(MOE_A2A_CHOICES), default="allgather",
                        help="with --enable-dp-attention: how MoE layers exchange tokens between the groups: "
                             "allgather (all-gather hidden states, reduce-scatter outputs) or alltoall (each token "
                             "only to the ranks holding its chosen experts)")


def dp_attention_fields(ns: argparse.Namespace) -> dict:
    """The ``EngineArgs`` / ``ServeArgs`` fields of these flags (defaults where a command lacks them)."""
    return {"enable_dp_attention": getattr(ns, "enable_dp_attention", False),
            "attention_dp_size": getattr(ns, "attention_dp_size", None),
            "moe_a2a": getattr(ns, "moe_a2a", "allgather")}


def check_dp_attention_args(args) -> None:
    """The flags' own consistency (no model file read; :meth:`EngineArgs.validate` calls it).

    Raises:
        ValueError: ``moe_a2a`` is not a known mode; ``attention_dp_size`` or a non-default
            ``moe_a2a`` without ``enable_dp_attention``; ``attention_dp_size`` < 1 or not dividing
            ``tensor_parallel_size``; ``max_num_batched_tokens`` or ``max_num_seqs`` (the replica's
            step budget, divided over the ``D`` groups) below ``D``; MTP (``speculative_tokens``) with
            DP attention (``dp_engine.MTP_REFUSAL``); an uneven ``tensor_split`` with
            DP attention (attention groups are equal by construction, and the layers split over all
            ranks split in whole units).
    """
    if args.moe_a2a not in MOE_A2A_CHOICES:
        raise ValueError(f"--moe-a2a must be one of {', '.join(MOE_A2A_CHOICES)}, got {args.moe_a2a!r}")
    if not args.enable_dp_attention:
        if args.attention_dp_size is not None:
            raise ValueError(f"--attention-dp-size {args.attention_dp_size} needs --enable-dp-attention "
                             "(without it the replica is one tensor-parallel group)")
        if args.moe_a2a != "allgather":
            raise ValueError(f"--moe-a2a {args.moe_a2a} needs --enable-dp-attention (plain tensor parallelism "
                             "all-reduces MoE outputs; there are no groups to exchange tokens between)")
        return
    tp = args.tensor_parallel_size
    size = args.attention_dp_size
    if size is not None and (size < 1 or tp % size):
        raise ValueError(f"--attention-dp-size {size} must be >= 1 and divide --tensor-parallel-size {tp} "
                         f"(each attention group is tensor-parallel-size / D ranks; try one of "
                         f"{', '.join(str(d) for d in range(1, tp + 1) if tp % d == 0)})")
    groups = size or tp
    for flag, value in (("--max-num-batched-tokens", args.max_num_batched_tokens), ("--max-num-seqs",
                                                                                 args.max_num_seqs)):
        if value < groups:
            raise ValueError(f"{flag} {value} is the replica's step budget, split over its {groups} attention groups "
                             f"under --enable-dp-attention: {value} // {groups} = 0 per group; raise it to at least "
                             f"{groups}")
    if args.speculative_tokens:
        from shardserve.cluster.engine.dp_engine import MTP_REFUSAL

        raise ValueError(MTP_REFUSAL)
    if args.tensor_split is not None and len(set(args.tensor_split)) > 1:
        split = ",".join(f"{share:g}" for share in args.tensor_split)
        raise ValueError(f"--tensor-split {split} is uneven: --enable-dp-attention needs equal ranks (equal "
                         "attention groups, routed experts in whole experts over all ranks); drop --tensor-split")


def dp_attention_model_problem(hf_config) -> str | None:
    """Why a model cannot run DP attention (None: it can). MLA: ``kv_lora_rank``; MoE: routed
    experts (``n_routed_experts``, or ``num_experts`` / ``num_local_experts`` in other families)."""
    archs = list(getattr(hf_config, "architectures", None) or []) or [getattr(hf_config, "model_type", "?")]
    experts = next((getattr(hf_config, name) for name in ("n_routed_experts", "num_experts", "num_local_experts")
                    if getattr(hf_config, name, None)), 0)
    missing = [what for what, has in (("MoE layers", experts), ("MLA attention", getattr(hf_config, "kv_lora_rank",
                                                                                          None))) if not has]
    if not missing:
        return None
    return (f"--enable-dp-attention: this model ({archs[0]}) has no {' and no '.join(missing)}; {PURPOSE}. "
            "Serve it with plain --tensor-parallel-size (drop --enable-dp-attention)")


def check_dp_attention_model(args, hf_config) -> None:
    """Refuse DP attention on a model without MLA or MoE (called by
    :meth:`EngineArgs.check_model_limits`, once the config is read, before any weight).

    Raises:
        ValueError: the one-line reason from :func:`dp_attention_model_problem`.
    """
    if args.enable_dp_attention and (problem := dp_attention_model_problem(hf_config)):
        raise ValueError(problem)


def model_config_for_check(model: str):
    """The config a model argument's DP-attention check needs, read without loading weights: an
    HF folder's ``config.json`` (transformers' ``AutoConfig``), or a GGUF file's header (tens of
    milliseconds; MLA = ``{arch}.attention.kv_lora_rank``, MoE = ``{arch}.expert_count``). A known
    model name is fetched first, as ``serve`` does before it starts Ray.

    Raises:
        FileNotFoundError: no such model, or a folder without ``config.json``.
    """
    from types import SimpleNamespace

    from shardserve.workers.gguf_file import read_header
    from shardserve.workers.model_source import load_config, resolve_model

    files = resolve_model(model)
    if not files.is_gguf:
        if not (files.path / "config.json").is_file():
            raise FileNotFoundError(f"{files.path}: no config.json")
        return load_config(files)
    meta = read_header(files.path).metadata
    arch = meta.get("general.architecture", "unknown")
    return SimpleNamespace(architectures=[f"{arch} (GGUF)"], kv_lora_rank=meta.get(f"{arch}.attention.kv_lora_rank"),
                           n_routed_experts=meta.get(f"{arch}.expert_count"))


def check_dp_attention_start(args) -> None:
    """What ``serve``, ``serve-grpc``, ``generate`` and ``serve deploy`` check before anything loads
    when ``args.enable_dp_attention`` (``args``: a validated :class:`EngineArgs`): the model has MLA
    and MoE (its config or GGUF header is read; no weights).

    Raises:
        ValueError: the model has no MLA or no MoE.
        FileNotFoundError: the model cannot be found.
    """
    if not args.enable_dp_attention:
        return
    check_dp_attention_model(args, model_config_for_check(args.model))
