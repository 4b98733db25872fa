"""``shardserve`` command line: ``generate`` (one prompt, this process)."""

from __future__ import annotations

import argparse
import logging
import sys

from cluster.config import EngineArgs
from workers.model_source import DEFAULT_MODEL


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"known model name ({DEFAULT_MODEL}), a .gguf file or an HF checkpoint folder")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache budget per rank (GiB)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length cap (tokens)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--seed", type=int, default=None, help="seed (sampling; engine generator)")
    parser.add_argument("--speculative-tokens", type=int, default=0, choices=range(5), metavar="{0..4}",
                        help="MTP speculative decoding: draft tokens per step from the checkpoint's MTP layer "
                             "(0 = off)")


def _cluster_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--tensor-split", type=_floats, default=None,
                        help="relative share of each TP rank, e.g. 2,1 (whole KV groups per rank)")
    parser.add_argument("--address", default=None, help="join this Ray cluster (default: start a local one)")
    parser.add_argument("--cpus-per-worker", type=float, default=None,
                        help="CPUs reserved per shard worker (default: this machine's cores / TP size)")
    parser.add_argument("--gpus-per-worker", type=float, default=0.0)
    parser.add_argument("--placement-strategy", choices=["PACK", "SPREAD"], default="PACK")
    parser.add_argument("--cpu-collective", choices=["shm", "gloo"], default=None,
                        help="CPU all-reduce backend (default: shm on one node, gloo across nodes)")
    parser.add_argument("--dispatch", choices=["calls", "compiled"], default="calls",
                        help="per-step dispatch to the shard workers: actor calls or a Ray Compiled Graph")


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


def _engine_args(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(model=ns.model, block_size=ns.block_size, kv_cache_gib=ns.kv_cache_gib,
                      max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
                      max_num_batched_tokens=ns.max_num_batched_tokens,
                      enable_prefix_caching=not ns.no_prefix_caching, seed=ns.seed or 0,
                      tensor_parallel_size=getattr(ns, "tensor_parallel_size", 1),
                      tensor_split=getattr(ns, "tensor_split", None), speculative_tokens=ns.speculative_tokens)


def _group_config(ns: argparse.Namespace):
    from cluster.coordinator import default_cpus_per_worker
    from cluster.worker_group import GroupConfig

    return GroupConfig(tensor_parallel_size=ns.tensor_parallel_size,
                       cpus_per_worker=ns.cpus_per_worker or default_cpus_per_worker(ns.tensor_parallel_size),
                       gpus_per_worker=ns.gpus_per_worker, strategy=ns.placement_strategy,
                       collective=ns.cpu_collective, dispatch=ns.dispatch)


def init_ray(address: str | None, cpus_needed: float) -> None:
    """Join ``address`` or start a local Ray with at least ``cpus_needed`` logical CPUs."""
    import os

    import ray

    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, int(-(-cpus_needed // 1))), include_dashboard=False,
                 logging_level=logging.WARNING)


def _wait_for_interrupt() -> None:
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def _serve_grpc(ns: argparse.Namespace) -> int:
    import ray
    from ray.util.placement_group import remove_placement_group

    from cluster.coordinator import launch_coordinator

    args, group = _engine_args(ns), _group_config(ns)
    args.validate()
    num_workers = args.tensor_parallel_size + (1 if args.speculative_tokens else 0)   # + the MTP draft worker
    init_ray(ns.address, 1 + group.cpus_per_worker * num_workers)
    handle, pg = launch_coordinator(args, group)
    try:
        address = ray.get(handle.start_grpc.remote(ns.grpc_port, ns.host))
        print(f"shardserve gRPC API (shardserve.v1.Inference) on {address}", flush=True)
        _wait_for_interrupt()
    finally:
        try:
            ray.get(handle.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass
        ray.kill(handle)
        remove_placement_group(pg)
        ray.shutdown()
    return 0


def _generate(ns: argparse.Namespace) -> int:

    from cluster.llm import LLM
    from cluster.request import SamplingParams

    llm = LLM(_engine_args(ns))
    prompt = [{"role": "user", "content": ns.prompt}] if ns.chat else ns.prompt
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            top_k=ns.top_k, seed=ns.seed, stop=ns.stop or [])
    (completion,) = llm.generate([prompt], params)
    sys.stdout.write(completion.text + "\n")
    logging.getLogger("shardserve").info("finish_reason=%s, %d prompt + %d output tokens",
                                         completion.finish_reason, len(completion.prompt_token_ids),
                                         len(completion.token_ids))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardserve", description="Ray-based tensor-parallel LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt in this process and print the text")
    _engine_flags(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template (prompt = user message)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.set_defaults(func=_generate)

    grpc_cmd = sub.add_parser("serve-grpc", help="serve the gRPC API from a tensor-parallel Ray cluster until Ctrl-C")
    _engine_flags(grpc_cmd)
    _cluster_flags(grpc_cmd)
    grpc_cmd.add_argument("--grpc-port", type=int, default=50051)
    grpc_cmd.add_argument("--host", default="0.0.0.0")
    grpc_cmd.set_defaults(func=_serve_grpc)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardserve`` console script. Logs go to stderr, results to stdout."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as exc:
        print(f"shardserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
