"""``shardserve`` command line: ``generate`` (one prompt, this process), ``serve-grpc`` (the gRPC
API of one replica), ``serve`` (Ray Serve: OpenAI-compatible HTTP + gRPC, TP x DP replicas) and
``manifest`` (the KubeRay RayService running what ``serve`` would, from the same arguments) and
``plan`` (each rank's memory, without loading the model: ``cluster/plan_cli.py``).

Every flag's help names its default and unit. Bad arguments are one line on stderr and exit code
2, found before anything is loaded. ``serve`` and ``serve-grpc`` keep Ray's worker logs out of
the terminal (they stay in Ray's log folder, printed at start-up): a failure ends with its cause
on the last line, not with tracebacks from every actor.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from shardserve.cluster import cli_agents, generate_controls
from shardserve.cluster.cli_types import finite_float, finite_floats
from shardserve.cluster.config import QUANTIZATION_CHOICES, SPECULATIVE_POLICIES, EngineArgs
from shardserve.cluster.dp_attention_args import add_dp_attention_flags, check_dp_attention_start, dp_attention_fields
from shardserve.workers.compilation import COMPILE_MODES
from shardserve.cluster.ray_errors import root_cause
from shardserve.cluster.front_cli import check_ray_token_auth, front_config, front_flags, serve_args_fields
from shardserve.cluster.frontend.security import refuse_exposed
from shardserve.cluster.ingress import INGRESS_CHOICES
from shardserve.cluster.scaling_cli import scaling_args_fields, scaling_flags, tcp_port
from shardserve.workers.quantization import check_packed_dense_rows
from shardserve.workers.model_source import DEFAULT_MODEL


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` unless the help already says what the default is (flags whose
    default is None or a computed value describe it in words)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS):
            return text
        if action.nargs == 0:   # store_true / store_false
            return f"{text} (default: {'on' if action.default else 'off'})"
        return text + " (default: %(default)s)"


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"known model name ({DEFAULT_MODEL}), a .gguf file or an HF checkpoint folder")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument("--kv-cache-gib", type=finite_float, default=1.0, help="KV cache budget per rank in GiB")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length in tokens, prompt + output (default: the model's, lowered to what "
                             "the KV cache holds; a value the KV cache cannot hold is an error)")
    parser.add_argument("--max-num-seqs", type=int, default=64,
                        help="sequences per engine step at most (the replica's: 1/D a group, --enable-dp-attention)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="tokens per engine step at most, prefill chunks included (the replica's: 1/D per "
                             "attention group with --enable-dp-attention)")
    parser.add_argument("--max-prefill-tokens", type=int, default=None,
                        help="prompt tokens (prefills and prefill chunks) per engine step at most, so a burst of "
                             "requests starts streaming over several short steps (default: 128 on CPU ranks, "
                             "--max-num-batched-tokens on GPUs)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks of equal prefixes")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the sampling generators, an integer (default: 0 for the engine; generate: "
                             "unseeded)")
    parser.add_argument("--dsa", action=argparse.BooleanOptionalAction, default=None,
                        help="DSA sparse attention for DeepSeek-V3.2 / GLM-5 (--no-dsa: dense MLA; default: on "
                             "when the checkpoint has an indexer)")
    parser.add_argument("--dsa-top-k", type=int, default=None,
                        help="keys (tokens) each query attends to under DSA (default: the checkpoint's index_topk)")
    parser.add_argument("--indexer-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="DSA indexer-key cache: auto = the model dtype, fp8 = e4m3 keys and queries with a "
                             "scale per 128 dims")
    parser.add_argument("--dsa-sink", type=int, default=0, metavar="N",
                        help="keep the first N positions of each sequence in every DSA top-k (attention sink; "
                             "0 = plain top-k)")
    parser.add_argument("--speculative-tokens", type=int, default=0, choices=range(5), metavar="{0..4}",
                        help="MTP speculative decoding: the most draft tokens per sequence and step from the "
                             "checkpoint's MTP layer (0 = off)")
    parser.add_argument("--speculative-policy", choices=list(SPECULATIVE_POLICIES), default="adaptive",
                        help="adaptive: draft only when, and as deep as, it pays (measured step costs and "
                             "per-request acceptance); fixed: always --speculative-tokens")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="where each rank computes (auto: cuda when the rank has a GPU, else cpu)")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                        help="weights and activations (auto: bfloat16 on cuda; on cpu bfloat16 with packed "
                             "weights for Q4_0/Q4_1/Q8_0 GGUF files, else float32: the exact path)")
    parser.add_argument("--gpu-memory-utilization", type=finite_float, default=0.9,
                        help="fraction (0, 1] of each GPU's memory a rank may use; the KV cache takes what weights "
                             "and activations leave (CPU ranks use --kv-cache-gib)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run decode steps eagerly on CUDA (no captured CUDA graphs)")
    parser.add_argument("--compile", choices=list(COMPILE_MODES), default="off",
                        help="torch.compile the forward (auto: where it pays, CPU ranks; on: every device); kernels "
                             "are built once per model shape and cached under $SHARDSERVE_CACHE")
    parser.add_argument("--quantization", choices=list(QUANTIZATION_CHOICES), default="none",
                        help="weight-only quantization of a float checkpoint at load time (CPU): int8 per "
                             "output row, int4 per group of 32")
    parser.add_argument("--packed-dense-rows", type=_packed_dense_rows, default="0",
                        help="CPU packed int4/int8 weights (Q4/Q8 GGUF, --quantization) also keep a dense copy "
                             "and run matmuls of at least N input rows (prefill, verify, large decode batches) on "
                             "it: faster prefill and large batches for ~4x the weights' memory; 0 = never (the "
                             "default); auto = 16 where a dense 16-row matmul beats the packed kernel on this CPU "
                             "(bfloat16: AMX / AVX-512-BF16) and the copies fit in a quarter of the available "
                             "memory, else 0")
    add_dp_attention_flags(parser)


def _cluster_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="tensor-parallel ranks (shard workers) per model replica")
    parser.add_argument("--tensor-split", type=finite_floats, default=None,
                        help="relative share of each TP rank, e.g. 2,1 (whole KV groups per rank; default: even)")
    parser.add_argument("--address", default=None, help="join this Ray cluster (default: start a local one)")
    parser.add_argument("--cpus-per-worker", type=finite_float, default=None,
                        help="CPUs reserved per shard worker (default: this machine's cores / TP size; "
                             "manifest: 1, the pods' cores are unknown here)")
    parser.add_argument("--gpus-per-worker", type=finite_float, default=0.0, help="GPUs reserved per shard worker")
    parser.add_argument("--placement-strategy", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
                        default="PACK", help="Ray placement of a replica's coordinator and ranks (STRICT_SPREAD: "
                                             "each on a node of its own; ranks on several nodes use gloo/NCCL)")
    parser.add_argument("--cpu-collective", choices=["shm", "gloo"], default=None,
                        help="CPU all-reduce backend (default: shm on one node, gloo across nodes)")
    parser.add_argument("--dispatch", choices=["calls", "compiled"], default="calls",
                        help="per-step dispatch to the shard workers: direct (Unix sockets on one node, else Ray actor calls) or a Ray Compiled Graph")
    parser.add_argument("--recovery-timeout", type=finite_float, default=300.0,
                        help="seconds to repair a dead shard or draft worker in place (new actors in the same "
                             "bundles) before the replica gives up and Ray Serve replaces it; 0 = no in-place repair")


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def _unescape(text: str) -> str:
    r"""``--stop`` value with the escapes ``\n``, ``\t``, ``\r`` and ``\\`` decoded (others kept)."""
    return re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m.group(1)], text)


def _packed_dense_rows(text: str) -> str:
    try:
        return check_packed_dense_rows(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--packed-dense-rows must be ")) from exc


def _engine_args(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(model=ns.model, block_size=ns.block_size, kv_cache_gib=ns.kv_cache_gib,
                      max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
                      max_num_batched_tokens=ns.max_num_batched_tokens, max_prefill_tokens=ns.max_prefill_tokens,
                      enable_prefix_caching=not ns.no_prefix_caching, seed=ns.seed or 0,
                      tensor_parallel_size=getattr(ns, "tensor_parallel_size", 1),
                      tensor_split=getattr(ns, "tensor_split", None), dsa=ns.dsa, dsa_top_k=ns.dsa_top_k,
                      indexer_cache_dtype=ns.indexer_cache_dtype, dsa_sink=ns.dsa_sink,
                      speculative_tokens=ns.speculative_tokens, speculative_policy=ns.speculative_policy,
                      device=ns.device, dtype=ns.dtype, gpu_memory_utilization=ns.gpu_memory_utilization,
                      enforce_eager=ns.enforce_eager, quantization=ns.quantization, compile=ns.compile,
                      packed_dense_rows=ns.packed_dense_rows, recovery_timeout=getattr(ns, "recovery_timeout", 300.0),
                      **dp_attention_fields(ns))


def _group_config(ns: argparse.Namespace):
    from shardserve.cluster.replica.coordinator import default_cpus_per_worker
    from shardserve.cluster.replica.worker_group import GroupConfig, check_worker_resources

    tp = ns.tensor_parallel_size
    cpus, gpus = getattr(ns, "cpus_per_worker", None), getattr(ns, "gpus_per_worker", 0.0)
    cpus = default_cpus_per_worker(tp) if cpus is None else cpus
    check_worker_resources(cpus, gpus)
    return GroupConfig(tensor_parallel_size=tp, cpus_per_worker=cpus, gpus_per_worker=gpus,
                       strategy=getattr(ns, "placement_strategy", "PACK"),
                       collective=getattr(ns, "cpu_collective", None), dispatch=getattr(ns, "dispatch", "calls"),
                       device=ns.device)


def cluster_gpus_per_worker(device: str, gpus_per_worker: float, num_workers: int, address: str | None) -> float:
    """GPUs to reserve per worker: ``--device cuda`` (or ``auto`` where there is a GPU per worker)
    reserves one when ``--gpus-per-worker`` was left 0. A local cluster has this machine's GPUs
    (checked before Ray starts); a joined one (``address``) has what Ray reports.

    Raises:
        DeviceConfigError: GPUs are asked for (``--device cuda`` or ``--gpus-per-worker``) but there
            are fewer than the workers need.
    """
    from shardserve.workers.device import DeviceConfigError, visible_gpus

    if device == "cpu":
        return gpus_per_worker
    if address:
        import ray

        available, where = ray.cluster_resources().get("GPU", 0.0), "the Ray cluster has"
    else:
        available, where = float(visible_gpus()), "this machine has"
    gpus = gpus_per_worker or (1.0 if device == "cuda" or available >= num_workers else 0.0)
    if gpus * num_workers > available:
        raise DeviceConfigError(f"--device {device}: {num_workers} worker(s) x {gpus:g} GPU need {gpus * num_workers:g} "
                                f"GPUs; {where} {available:g}; use --device cpu or add GPUs")
    return gpus


def init_ray(address: str | None, cpus_needed: float, log_to_driver: bool = True) -> None:
    """Join ``address`` or start a local Ray with at least ``cpus_needed`` logical CPUs.

    ``log_to_driver=False`` keeps the actors' output out of this terminal (it stays in Ray's log
    folder, see :func:`ray_logs_dir`).
    """
    import os

    import ray

    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=log_to_driver)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, int(-(-cpus_needed // 1))), include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=log_to_driver)


def ray_logs_dir() -> str:
    """Where this Ray session writes the actors' logs (for the start-up banner and errors)."""
    try:
        import ray._private.worker as ray_worker

        return ray_worker._global_node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 - private API; the usual place otherwise
        return "/tmp/ray/session_latest/logs"


def _quiet_ray_serve_driver_logs() -> None:
    """Hide Ray Serve's INFO lines in this process (e.g. "Application ... is ready", printed when the
    deployments start, long before the model is loaded); its warnings still show."""
    logging.getLogger("ray.serve").addFilter(lambda record: record.levelno >= logging.WARNING)


def _interrupt_event(stop=None):
    """An event set by SIGINT / SIGTERM (installed before start-up, so an early Ctrl-C also
    shuts down cleanly instead of killing the process half-way). Called again with the same
    event after ``ray.init``, whose core worker installs its own SIGTERM handler (it would dump a
    stack and exit without shutting Serve down: ``docker stop`` / systemd send SIGTERM)."""
    import signal
    import threading

    stop = stop or threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


def _quantity(text: str) -> str:
    """argparse type of a Kubernetes memory quantity (``8Gi``, ``512Mi``, ``1e9`` is not one)."""
    if not _QUANTITY.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a Kubernetes memory quantity (e.g. 8Gi, 512Mi)")
    return text


def _pods(text: str) -> int:
    """argparse type of a pod count: an integer >= 1."""
    count = int(text)
    if count < 1:
        raise argparse.ArgumentTypeError(f"at least 1 pod, got {count}")
    return count


def check_port_free(host: str, port: int, flag: str) -> None:
    """Raises ValueError (one line) when ``port`` on ``host`` is taken: Ray Serve's proxy binds with
    SO_REUSEPORT, so a second server would silently share the port with the first."""
    import socket

    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # TIME_WAIT leftovers are no conflict
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ValueError(f"{flag} {port}: {host}:{port} is in use ({exc.strerror}); is another server "
                             f"running? Stop it or pick another port") from None


def _serve_grpc(ns: argparse.Namespace) -> int:
    import ray

    from shardserve.cluster.replica.coordinator import launch_coordinator, stop_coordinator
    from shardserve.workers.model_source import check_model

    args, group, front = _engine_args(ns), _group_config(ns), front_config(ns)
    args.validate()
    check_model(args.model)
    check_dp_attention_start(args)
    refuse_exposed(ns.host, front.requires_key, ns.allow_unauthenticated, "--host")
    stop = _interrupt_event()
    num_workers = args.tensor_parallel_size   # the MTP draft worker shares rank 0's bundle
    if not ns.address:
        group.gpus_per_worker = cluster_gpus_per_worker(args.device, group.gpus_per_worker, num_workers, None)
    check_port_free(ns.host, ns.grpc_port, "--grpc-port")
    init_ray(ns.address, 1 + group.cpus_per_worker * num_workers, log_to_driver=False)
    _interrupt_event(stop)
    if ns.address:
        try:
            check_ray_token_auth(ns.allow_ray_without_auth)
            group.gpus_per_worker = cluster_gpus_per_worker(args.device, group.gpus_per_worker, num_workers, ns.address)
        except ValueError:
            ray.shutdown()
            raise
    handle, pg = launch_coordinator(args, group, front=front)
    try:
        try:
            address = ray.get(handle.start_grpc.remote(ns.grpc_port, ns.host))
        except ray.exceptions.RayError as exc:   # the coordinator failed to start (e.g. does not fit)
            raise ServeStartError(f"the replica failed to start: {root_cause(exc)} (logs: {ray_logs_dir()})") from None
        scheme = "TLS" if front.grpc_tls_cert else "plaintext"
        print(f"shardserve gRPC API (shardserve.v1.Inference) on {address} ({scheme}; logs: {ray_logs_dir()})",
              flush=True)
        stop.wait()
    finally:
        stop_coordinator(handle, pg)
        ray.shutdown()
    return 0


class ServeStartError(RuntimeError):
    """``shardserve serve`` could not bring the app up (a replica failed to load)."""


def _serve_args(ns: argparse.Namespace, read_keys: bool = True):
    """The app's arguments from ``serve``'s flags; ``read_keys=False`` leaves the API keys unread
    (``manifest``: keys reach the pods from a Secret, never through the manifest)."""
    from shardserve.cluster.replica.coordinator import default_cpus_per_worker
    from shardserve.cluster.serve_app import ServeArgs

    tp = ns.tensor_parallel_size
    return ServeArgs(
        model=ns.model_arg or ns.model, served_model_name=ns.served_model_name, tensor_parallel_size=tp,
        tensor_split=ns.tensor_split,
        cpus_per_worker=default_cpus_per_worker(tp) if ns.cpus_per_worker is None else ns.cpus_per_worker,
        gpus_per_worker=ns.gpus_per_worker,
        placement_strategy=ns.placement_strategy, cpu_collective=ns.cpu_collective, dispatch=ns.dispatch,
        grpc_host=ns.grpc_host or ns.host, drain_timeout_s=ns.drain_timeout_s,
        block_size=ns.block_size,
        kv_cache_gib=ns.kv_cache_gib, max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens, max_prefill_tokens=ns.max_prefill_tokens,
        enable_prefix_caching=not ns.no_prefix_caching,
        seed=ns.seed or 0, dsa=ns.dsa, dsa_top_k=ns.dsa_top_k, indexer_cache_dtype=ns.indexer_cache_dtype,
        dsa_sink=ns.dsa_sink, speculative_tokens=ns.speculative_tokens, speculative_policy=ns.speculative_policy,
        device=ns.device, dtype=ns.dtype,
        gpu_memory_utilization=ns.gpu_memory_utilization, enforce_eager=ns.enforce_eager,
        recovery_timeout=ns.recovery_timeout, quantization=ns.quantization, compile=ns.compile,
        packed_dense_rows=ns.packed_dense_rows, **serve_args_fields(ns, read_keys), **cli_agents.parser_settings(ns),
        **scaling_args_fields(ns),
        **dp_attention_fields(ns))


def _wait_until_serving(url: str, app_name: str, timeout_s: float) -> dict:
    """Poll a replica (Serve's handle to ``ModelReplica``: this process is the Ray driver) until it
    is ready, then ``url`` (``/health``, open) until the router answers ``ok``; returns that
    replica's status (address, ModelInfo). The poll backs off to 2 s. HTTPS is not verified: this
    is our own server on this machine, and nothing secret is sent.

    Raises:
        ServeStartError: the replica failed. TimeoutError: not ready within ``timeout_s``.
    """
    import json
    import ssl
    import time
    import urllib.error
    import urllib.request

    from ray import serve

    from shardserve.cluster.frontend.replica_directory import REPLICA_DEPLOYMENT

    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name)
    context = ssl._create_unverified_context() if url.startswith("https") else None
    deadline, last, pause = time.monotonic() + timeout_s, "no answer yet", 0.25
    while time.monotonic() < deadline:
        try:
            status = handle.status.remote().result(timeout_s=30)
        except Exception as exc:  # noqa: BLE001 - a replica still starting (or restarting)
            status, last = None, f"{type(exc).__name__}: {exc}"
        if status is not None and status["state"] == "failed":
            raise ServeStartError(f"replica {status.get('replica_id')} failed to load: {status['error']} "
                                  f"(logs: {ray_logs_dir()})")
        if status is not None and status["state"] == "ready":
            try:
                with urllib.request.urlopen(url, timeout=5, context=context) as resp:
                    if json.loads(resp.read()).get("status") == "ok":
                        return status
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"
            except (OSError, ValueError) as exc:
                last = str(exc)
        time.sleep(pause)
        pause = min(2.0, pause * 1.5)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s ({last}; logs: {ray_logs_dir()})")


def _replicas_text(cfg) -> str:
    """``"2 replica(s)"`` or ``"1-4 replicas (autoscaled)"``."""
    if cfg.autoscaled:
        return f"{cfg.min_num_replicas()}-{cfg.max_replicas} replicas (autoscaled)"
    return f"{cfg.data_parallel_size} replica(s)"


def _serve(ns: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from shardserve.cluster.frontend.security import check_tls_pair
    from shardserve.cluster.ingress import controller_env, ingress_env, resolve_ingress
    from shardserve.cluster.serve_app import build_app
    from shardserve.workers.model_source import resolve_model

    cfg = _serve_args(ns)
    keyed = bool(cfg.api_key_sha256)
    refuse_exposed(ns.host, keyed, ns.allow_unauthenticated, "--host")
    cfg.validate()   # refuses a non-loopback --grpc-host without a key too (unless --allow-unauthenticated)
    check_tls_pair(ns.ssl_certfile, ns.ssl_keyfile, "--ssl-certfile", "--ssl-keyfile")
    check_dp_attention_start(cfg.engine_args())
    stop = _interrupt_event()
    num_workers = cfg.max_num_replicas() * (len(cfg.replica_bundles()) - 1)
    if not ns.address:
        cfg.gpus_per_worker = cluster_gpus_per_worker(cfg.device, cfg.gpus_per_worker, num_workers, None)
    if not ns.address:   # a Serve app on a cluster of its own takes this machine's ports
        check_port_free(ns.host, ns.port, "--port")
        check_port_free(cfg.grpc_host, cfg.grpc_port, "--grpc-port")
        check_port_free(cfg.grpc_host, cfg.replica_grpc_port, "--replica-grpc-port")
    ingress = resolve_ingress(ns.ingress, bool(ns.ssl_certfile))
    files = resolve_model(cfg.model)  # fetch a known model once, here, not in every replica
    if not ns.address:   # read by the Ray processes this starts; a joined cluster keeps its own
        own_ports = {port for port in (ns.port, cfg.grpc_port, cfg.replica_grpc_port) if port}
        os.environ.update(ingress_env(ingress, local=True, own_ports=own_ports))
        for name, value in controller_env().items():   # a value of the user's own stands
            os.environ.setdefault(name, value)
        _adopt_orphans()
    init_ray(ns.address, cfg.cpus_needed(), log_to_driver=False)
    _interrupt_event(stop)
    if ns.address:
        try:
            check_ray_token_auth(ns.allow_ray_without_auth)
            cfg.gpus_per_worker = cluster_gpus_per_worker(cfg.device, cfg.gpus_per_worker, num_workers, ns.address)
        except ValueError:
            ray.shutdown()
            raise
    _quiet_ray_serve_driver_logs()
    local = "127.0.0.1" if ns.host in ("0.0.0.0", "::", "") else ns.host
    scheme = "https" if ns.ssl_certfile else "http"
    http_options = {"host": ns.host, "port": ns.port}
    if ns.ssl_certfile:
        http_options.update(ssl_certfile=ns.ssl_certfile, ssl_keyfile=ns.ssl_keyfile)
    print(f"shardserve: loading {files.name} on {_replicas_text(cfg)} of TP={cfg.tensor_parallel_size} "
          f"(logs: {ray_logs_dir()})", flush=True)
    try:
        # The proxy's access log would repeat the router's; the router logs every request but /health.
        serve.start(http_options=http_options, logging_config={"enable_access_log": False})
        try:   # returns once every replica has loaded its model
            serve.run(build_app(cfg.to_dict()), name=ns.app_name, route_prefix="/")
        except RuntimeError as exc:   # Serve gave up on a replica whose constructor kept failing
            raise ServeStartError(f"{_deploy_failure(ns.app_name, exc)} (logs: {ray_logs_dir()})") from None
        replica = _wait_until_serving(f"{scheme}://{local}:{ns.port}/health", ns.app_name, ns.ready_timeout)
        grpc_address = serve.get_app_handle(ns.app_name).grpc_address.remote().result(timeout_s=30)
        print(f"shardserve: serving {cfg.served_names()[0]} ({files.path}) with TP={cfg.tensor_parallel_size} "
              f"x {_replicas_text(cfg)}, routing {cfg.routing_policy().name}"
              f"{' (API key required)' if keyed else ''}", flush=True)
        print(f"  OpenAI API: {scheme}://{local}:{ns.port}/v1  (health: /health, metrics: /metrics"
              f"{', admin: /admin/status' if cfg.front_config().admin_enabled else ''})", flush=True)
        print(f"  context:    {replica['info'].get('max_model_len')} tokens per sequence, prompt + output ("
              + ("--max-model-len" if cfg.max_model_len else "the model's limit or what the KV cache holds, the "
                 "smaller; --kv-cache-gib raises the second") + ")", flush=True)
        if grpc_address:
            print(f"  gRPC API:   {grpc_address} (shardserve.v1.Inference, health, reflection; routed like HTTP"
                  f"{', TLS' if cfg.grpc_tls_cert else ''})", flush=True)
        print(f"  replicas:   own gRPC servers for direct access, e.g. {replica['address']} (replica "
              f"{replica.get('replica_id')}){'; all on /admin/status' if cfg.front_config().admin_enabled else ''}",
              flush=True)
        print("Press Ctrl-C to stop.", flush=True)
        stop.wait()
        print("shardserve: shutting down", flush=True)
    except KeyboardInterrupt:
        print("shardserve: interrupted, shutting down", flush=True)
    finally:
        try:
            # ns.address: leave the rest of a shared cluster alone
            _while_ray_lives(lambda: serve.delete(ns.app_name) if ns.address else serve.shutdown())
        finally:
            if not ns.address:   # first: ray.shutdown() can wait a minute for a GCS a signal stopped
                _stop_leftovers("haproxy")
            ray.shutdown()
            if not ns.address:
                _stop_leftovers()
    return 0


def _adopt_orphans() -> None:
    """Make this process the child subreaper of what it starts (Linux ``PR_SET_CHILD_SUBREAPER``).

    Ray Serve's HAProxy (:mod:`cluster.ingress`) is a subprocess of an actor, in that actor's
    process group, outside Ray's own bookkeeping: when a signal to this command's process group
    stops the actor before it stops HAProxy, HAProxy lived on holding ``--port``. As subreaper,
    this process inherits such orphans and :func:`_stop_leftovers` stops them at exit."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER = 36
    except (OSError, AttributeError):   # not Linux: nothing is adopted, nothing changes
        pass


def _stop_leftovers(name: str | None = None, timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s`` seconds, the processes below this one (those named
    ``name``; all of them: after ``ray.shutdown()`` of a cluster this command started, what is left
    are adopted orphans)."""
    import psutil

    children = [child for child in psutil.Process().children(recursive=True)
                if name is None or _process_name(child) == name]
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def _process_name(process) -> str | None:
    import psutil

    try:
        return process.name()
    except psutil.Error:
        return None


def _while_ray_lives(shutdown) -> None:
    """Run ``shutdown`` (a Serve shutdown) unless the Ray cluster's GCS stops answering meanwhile.

    A SIGTERM to the whole process group (``kill -- -PGID``, systemd, a container runtime) stops
    a local cluster's Ray processes together with this one; Serve's shutdown then waits 30 s for a
    controller that is gone. Here the wait ends as soon as the GCS refuses connections."""
    import socket
    import threading

    import ray

    host, port = ray.get_runtime_context().gcs_address.rsplit(":", 1)

    def gcs_alive() -> bool:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return True
        except OSError:
            return False

    done, failure = threading.Event(), []

    def run() -> None:
        try:
            shutdown()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="serve-shutdown", daemon=True).start()
    while not done.wait(0.5):
        if not gcs_alive():
            print("shardserve: Ray's processes have stopped already (a signal to the whole process group)",
                  flush=True)
            return
    if failure:
        raise failure[0]


def _deploy_failure(app_name: str, exc: Exception) -> str:
    """Why ``serve.run`` failed: the cause a failed deployment reports (a replica's constructor
    raised ``replica I failed to load: ...``), else the error's own root cause."""
    from ray import serve

    try:
        deployments = serve.status().applications[app_name].deployments
    except Exception:  # noqa: BLE001 - the app is gone; the error is all we know
        return root_cause(exc)
    for deployment in deployments.values():
        if deployment.status not in ("HEALTHY", "UPDATING") and deployment.message:
            return root_cause(RuntimeError(deployment.message))
    return root_cause(exc)


def _manifest(ns: argparse.Namespace) -> int:
    import shlex

    from shardserve.cluster.manifest import PodLayout, render

    if any(value is not None for value in (ns.api_key, ns.api_key_file, ns.admin_api_key, ns.admin_api_key_file)):
        raise ValueError("--api-key/--api-key-file/--admin-api-key(-file) would write keys into the manifest: put "
                         "them in Secrets and pass --api-key-secret NAME[:KEY] (and --admin-api-key-secret)")
    for flag, given in (("--address", ns.address is not None), ("--allow-ray-without-auth", ns.allow_ray_without_auth)):
        if given:
            raise ValueError(f"{flag} applies to a Ray cluster `serve` joins; the RayService starts its own (KubeRay "
                             "sets its address and authentication)")
    if ns.cpus_per_worker is None:   # not this machine's cores: the pods' are unknown here
        ns.cpus_per_worker = 1.0
    cfg = _serve_args(ns, read_keys=False)
    layout = PodLayout(name=ns.name, image=ns.image, worker_pods=ns.worker_pods, gpus_per_pod=ns.gpus_per_pod,
                       memory_per_pod=ns.memory_per_pod, head_memory=ns.head_memory, shm_size=ns.shm_size,
                       surge_pods=ns.surge_pods, api_key_secret=ns.api_key_secret,
                       admin_api_key_secret=ns.admin_api_key_secret, allow_unauthenticated=ns.allow_unauthenticated,
                       operator_namespace=ns.operator_namespace, model_pvc=ns.model_pvc,
                       model_mount=ns.model_mount, tls_secret=ns.tls_secret, ssl_certfile=ns.ssl_certfile,
                       ssl_keyfile=ns.ssl_keyfile, upgrade_strategy=ns.upgrade_strategy,
                       service_type=ns.service_type, http_port=ns.port, env=dict(ns.env or []), ingress=ns.ingress)
    sys.stdout.write(render(cfg, layout, shlex.join(["shardserve", *ns.argv])))
    return 0


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _manifest_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="shardserve", help="RayService name (the Service is NAME-openai)")
    parser.add_argument("--image", default="shardserve:0.1.0", help="image with shardserve installed")
    parser.add_argument("--worker-pods", type=_pods, default=None, help="worker pods (default: the fewest that fit)")
    parser.add_argument("--gpus-per-pod", type=int, default=None,
                        help="GPUs per worker pod (default: one replica's ranks, at most 8)")
    parser.add_argument("--memory-per-pod", type=_quantity, default="8Gi",
                        help="memory of a worker pod (Kubernetes quantity)")
    parser.add_argument("--head-memory", type=_quantity, default="4Gi", help="memory of the head pod")
    parser.add_argument("--shm-size", type=_quantity, default=None,
                        help="memory-backed /dev/shm per pod (default: 1Gi, 64Gi on GPUs)")
    parser.add_argument("--surge-pods", type=int, default=None,
                        help="extra worker pods an upgrade may add while the new replica loads "
                             "(default: one replica's pods)")
    parser.add_argument("--api-key-secret", default=None, metavar="NAME[:KEY]",
                        help="Secret with the API key, passed as SHARDSERVE_API_KEY (key 'api-key' by default); "
                             "required unless --allow-unauthenticated (default: none)")
    parser.add_argument("--admin-api-key-secret", default=None, metavar="NAME[:KEY]",
                        help="Secret with the admin key, passed as SHARDSERVE_ADMIN_API_KEY (key 'admin-api-key' by "
                             "default; default: none, no admin API)")
    parser.add_argument("--operator-namespace", default="default",
                        help="namespace of the KubeRay operator, the only one the NetworkPolicy lets reach the "
                             "dashboard")
    parser.add_argument("--model-pvc", default=None, help="PersistentVolumeClaim holding the weights (default: none)")
    parser.add_argument("--model-mount", default="/models", help="where --model-pvc is mounted")
    parser.add_argument("--tls-secret", default=None,
                        help="Secret (kubectl create secret tls) mounted read-only at /etc/shardserve/tls in every "
                             "pod, for --ssl-certfile/--grpc-tls-cert paths there (default: none)")
    parser.add_argument("--upgrade-strategy", choices=["NewCluster", "None"], default="NewCluster",
                        help="RayService upgrade of rayClusterConfig changes")
    parser.add_argument("--service-type", choices=["ClusterIP", "NodePort", "LoadBalancer"], default="ClusterIP")
    parser.add_argument("--env", type=_key_value, action="append", metavar="KEY=VALUE",
                        help="extra environment variable of every Ray container (repeatable; default: none)")


def _generate(ns: argparse.Namespace) -> int:
    from shardserve.cluster.engine.request import SamplingParams
    from shardserve.workers.model_source import check_model

    from shardserve.cluster.prompt_file import read_prompt

    # Everything that can be checked without the model is checked first (loading takes seconds).
    ns.prompt = read_prompt(ns.prompt, ns.prompt_file)   # the agent flags read it too
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            top_k=ns.top_k, seed=ns.seed, stop=[_unescape(stop) for stop in ns.stop or []])
    generate_controls.apply_flags(ns, params).validate()
    if params.structured_outputs is not None:
        from shardserve.cluster.frontend.structured import check_syntax

        check_syntax(params.structured_outputs)
    agent = cli_agents.agent_chat(ns)
    args = _engine_args(ns)
    args.validate()
    check_model(args.model)
    check_dp_attention_start(args)
    prompt = [{"role": "user", "content": ns.prompt}] if ns.chat else ns.prompt
    output = None
    if agent is not None:   # tools or parsers: render here, send token ids, print the parsed answer
        from shardserve.cluster.tokenizer import load_tokenizer
        from shardserve.workers.model_source import resolve_model

        prompt, output = agent.encode(load_tokenizer(resolve_model(args.model)), params)
    if args.tensor_parallel_size > 1:
        completion = _generate_on_cluster(ns, args, prompt, params)
    else:
        from shardserve.cluster.llm import LLM

        (done,) = LLM(args).generate([prompt], params)
        completion = {"text": done.text, "finish_reason": done.finish_reason,
                      "num_prompt_tokens": len(done.prompt_token_ids), "num_output_tokens": len(done.token_ids)}
    if agent is not None:
        sys.stdout.write(cli_agents.answer_json(completion["text"], output, completion["finish_reason"]) + "\n")
    else:
        sys.stdout.write(completion["text"] + "\n")
    logging.getLogger("shardserve").info("finish_reason=%s, %d prompt + %d output tokens", completion["finish_reason"],
                                         completion["num_prompt_tokens"], completion["num_output_tokens"])
    return 0


def _generate_on_cluster(ns: argparse.Namespace, args: EngineArgs, prompt, params) -> dict:
    """``generate --tensor-parallel-size N``: one coordinator and N shard workers on a local Ray
    cluster (as ``serve-grpc``), one request, then everything is shut down."""
    import ray

    from shardserve.cluster.replica.coordinator import launch_coordinator, stop_coordinator

    group = _group_config(ns)
    num_workers = args.tensor_parallel_size   # the MTP draft worker shares rank 0's bundle
    group.gpus_per_worker = cluster_gpus_per_worker(args.device, group.gpus_per_worker, num_workers, None)
    init_ray(None, 1 + group.cpus_per_worker * num_workers, log_to_driver=False)
    handle = pg = None
    try:
        handle, pg = launch_coordinator(args, group)
        try:
            if prompt and isinstance(prompt, list) and isinstance(prompt[0], int):
                ids = list(prompt)   # rendered by the caller
            else:
                ids = ray.get(handle.encode.remote(chat=prompt) if ns.chat else handle.encode.remote(text=prompt))
            out = ray.get(handle.complete.remote(ids, params))
        except ray.exceptions.RayActorError as exc:   # the coordinator failed to start (e.g. does not fit)
            raise ServeStartError(root_cause(exc)) from None
        return {"text": out["text"], "finish_reason": out["finish_reason"], "num_prompt_tokens": len(ids),
                "num_output_tokens": len(out["token_ids"])}
    finally:
        if handle is not None:
            stop_coordinator(handle, pg)
        ray.shutdown()


class _OneLineErrors(argparse.ArgumentParser):
    """A parser whose usage errors are one line on stderr (exit code 2), not the whole usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardserve")
    except PackageNotFoundError:   # run from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The ``shardserve`` argument parser (every flag has help naming its default and unit)."""
    parser = _OneLineErrors(prog="shardserve", description="Ray-based tensor-parallel LLM serving",
                            formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"shardserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt in this process and print the text",
                         formatter_class=_HelpFormatter)
    _engine_flags(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text, not empty (default: none; this or --prompt-file is required)")
    source.add_argument("--prompt-file", metavar="FILE",
                        help="read the prompt from FILE, UTF-8, one trailing line break dropped; - = standard input "
                             "(default: none)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template (prompt = user message)")
    gen.add_argument("--max-tokens", type=int, default=64, help="output tokens at most")
    gen.add_argument("--temperature", type=finite_float, default=0.0, help="sampling temperature in [0, 2]; 0 = greedy")
    gen.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling: probability mass kept, in (0, 1]")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off")
    gen.add_argument("--stop", action="append",
                     help="stop string, repeatable, at most 4; the escapes \\n, \\t, \\r and \\\\ are decoded, so "
                          "--stop '\\n\\n' stops at a blank line (default: none)")
    gen.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="shard workers (ranks) on a local Ray cluster; 1 = everything in this process")
    gen.add_argument("--tensor-split", type=finite_floats, default=None,
                     help="relative share of each TP rank, e.g. 2,1 (whole KV groups per rank; default: even)")
    generate_controls.add_flags(gen)
    cli_agents.add_generate_flags(gen)
    gen.set_defaults(func=_generate)

    grpc_cmd = sub.add_parser("serve-grpc", help="serve the gRPC API from a tensor-parallel Ray cluster until Ctrl-C",
                              formatter_class=_HelpFormatter)
    _engine_flags(grpc_cmd)
    _cluster_flags(grpc_cmd)
    front_flags(grpc_cmd)
    grpc_cmd.add_argument("--grpc-port", type=tcp_port, default=50051, help="TCP port of the gRPC API; 0 = any free port")
    grpc_cmd.add_argument("--host", default="127.0.0.1",
                          help="interface the gRPC API binds (0.0.0.0: all; needs an API key or --allow-unauthenticated)")
    grpc_cmd.set_defaults(func=_serve_grpc)

    serve_cmd = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API and the gRPC API with Ray Serve "
                                            "(tensor-parallel replicas) until Ctrl-C", formatter_class=_HelpFormatter)
    _serve_flags(serve_cmd)
    serve_cmd.add_argument("--host", default="127.0.0.1",
                           help="interface the HTTP API binds (0.0.0.0: all; needs an API key or --allow-unauthenticated)")
    serve_cmd.add_argument("--app-name", default="shardserve", help="Ray Serve application name")
    serve_cmd.add_argument("--ready-timeout", type=finite_float, default=1800.0,
                           help="seconds to wait for the model to load")
    serve_cmd.set_defaults(func=_serve)

    manifest_cmd = sub.add_parser("manifest", help="print a KubeRay RayService (YAML) that serves like `serve` with "
                                                   "the same arguments, on Kubernetes pods",
                                  formatter_class=_HelpFormatter)
    _serve_flags(manifest_cmd)
    _manifest_flags(manifest_cmd)
    manifest_cmd.set_defaults(func=_manifest, host="0.0.0.0")

    from shardserve.cluster.plan_cli import add_plan_flags, run_plan

    plan_cmd = sub.add_parser("plan", help="print what each rank would hold and whether it fits (cluster/plan_cli.py)",
                              formatter_class=_HelpFormatter)
    _engine_flags(plan_cmd)
    add_plan_flags(plan_cmd)
    plan_cmd.set_defaults(func=lambda ns: run_plan(ns, _engine_args(ns)))
    return parser


def _serve_flags(parser: argparse.ArgumentParser) -> None:
    """The flags ``serve`` and ``manifest`` share (the app's :class:`ServeArgs` and HTTPS files)."""
    parser.add_argument("model_arg", nargs="?", metavar="MODEL", default=None,
                        help=f"model to serve (default: {DEFAULT_MODEL}; same as --model)")
    _engine_flags(parser)
    _cluster_flags(parser)
    front_flags(parser)
    scaling_flags(parser)
    parser.add_argument("--port", type=tcp_port, default=8000, help="TCP port of the OpenAI HTTP API")
    parser.add_argument("--grpc-host", default=None, help="interface the gRPC APIs bind (default: --host)")
    parser.add_argument("--ssl-certfile", default=None, help="PEM certificate: serve HTTPS (default: none, HTTP)")
    parser.add_argument("--ssl-keyfile", default=None, help="PEM private key of --ssl-certfile (default: none)")
    parser.add_argument("--ingress", choices=INGRESS_CHOICES, default="auto",
                        help="what carries HTTP to the router: Ray Serve's HAProxy ingress (C, forwards each "
                             "connection to the router's own HTTP server) or its Python proxy actor (relays "
                             "every streamed chunk as a Ray call); auto: haproxy unless --ssl-certfile. Applies "
                             "to a Ray cluster this command starts (or the pods of `manifest`); a cluster joined "
                             "with --address keeps the ingress it was started with")
    parser.add_argument("--served-model-name", default=None, help="model name clients use (default: the model's)")
    parser.add_argument("--drain-timeout-s", type=finite_float, default=300.0,
                        help="seconds a replaced replica may take to finish its running requests (size it for "
                             "your longest completion)")
    cli_agents.add_parser_flags(parser)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardserve`` console script. Logs go to stderr, results to stdout."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    ns = build_parser().parse_args(argv)
    ns.argv = argv
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError, ServeStartError, TimeoutError) as exc:
        print(f"shardserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # Ctrl-C in `generate` or `plan` (each `finally` has cleaned up)
        print("shardserve: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # the reader of stdout left (`shardserve plan | head -1`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # Python's advice: no second error at exit
        return 1


if __name__ == "__main__":
    sys.exit(main())
