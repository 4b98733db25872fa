"""Ray Serve application: an OpenAI-compatible HTTP front (and one gRPC endpoint) over
tensor-parallel model replicas.

Two deployments (``build_app`` wires them; ``serve_config.yaml`` and ``shardserve serve`` both deploy
``shardserve.cluster.serve_app:build_app``):

- ``ModelReplica``: one deployment whose Serve replicas are the model replicas, as many as
  ``data_parallel_size`` or, with ``max_replicas``, as Serve's autoscaler asks for
  (:mod:`cluster.autoscaling`: ``min_replicas`` .. ``max_replicas`` on the requests the replicas
  hold, ``target_ongoing_requests`` each). Each Serve replica *is* a replica's coordinator: it
  builds :class:`cluster.replica.coordinator.Coordinator` in-process, which puts shard worker ``r``
  in bundle ``r + 1`` of the replica's own placement group (``placement_group_bundles = [{"CPU":
  1}] + [worker bundle] * tp``; bundle 0 holds the replica itself), so tensor parallelism needs no
  second, nested placement group. The engine loop and a gRPC server (``shardserve.v1.Inference``,
  for direct access on ``replica_grpc_port``) run on the replica's event loop. Each replica reports
  to Serve its routing stats (gRPC address, state, load, prefix-cache counters), its load for the
  autoscaler, and streams its prefix-cache events to the router on request.
- ``OpenAIRouter`` (FastAPI ingress, the app of :func:`cluster.frontend.openai_app.build_openai_app`,
  built on the replica after the router core): ``/v1/chat/completions``, ``/v1/completions``,
  ``/v1/models``, ``/health``, ``/metrics``, ``/docs``, ``/admin/*`` (:mod:`cluster.frontend.admin`),
  and the app's one gRPC endpoint on ``grpc_port`` (:mod:`cluster.frontend.grpc_front`). It learns
  the replicas from Serve (:mod:`cluster.frontend.replica_directory`: ``ModelReplica``'s request
  router hands it the running replicas and their routing stats), chooses one per request
  (:mod:`cluster.routing`: prefix-aware with a load guard, or least-loaded) and forwards the
  request over the gRPC API external clients use.

API keys (``api_key_file``, ``api_key`` or ``$SHARDSERVE_API_KEY``; admin keys likewise with
``admin_``) are read once, by :func:`build_app`, and only their SHA-256 digests travel to the
deployments (``api_key_sha256`` / ``admin_api_key_sha256``: no key in Serve's init args); they
guard the router's HTTP app, its gRPC endpoint and every replica's gRPC server alike. The router
calls each replica with the internal token that replica made at start-up and reports in
:meth:`ModelReplica.status` (a Serve call routed to that replica, never routing stats); see
:mod:`cluster.frontend.security`.

A replica whose shard or draft worker dies repairs itself in place (``cluster/replica/recovery.py``) and
reports ``recovering`` meanwhile; only when that fails (``recovery_timeout``) does its health
check fail, and Serve replaces the replica, as it does when the replica process itself dies.

Rolling upgrades (``serve deploy`` of a changed config, hence RayService ``serveConfigV2`` edits),
scale-up and scale-down: Serve lists a replica (and the router routes to it) only once its
constructor has returned, and both constructors return only when the replica can serve (the model
loaded and the gRPC server up; the router's tokenizer loaded and its replicas polled once), and
raise when it cannot: a config whose model cannot load never takes traffic. ``max_surge_percent=100``
makes Serve start the replacement before it stops the old replica, and keeps the old one when the
new one fails to start. A stopping model replica drains: Serve drops it from the list at once (the
router sends it nothing new), it refuses new requests (the router retries them elsewhere) and
finishes its running ones within ``drain_timeout_s`` (``graceful_shutdown_timeout_s`` leaves room
for it). Settings only the router reads (routing, the gRPC endpoint, autoscaling bounds) are not
among the replicas' init args, so changing them leaves the replicas running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from ray import serve

from shardserve.cluster.autoscaling import ONGOING_REQUESTS, autoscaling_config, push_interval_env
from shardserve.cluster.config import EngineArgs
from shardserve.cluster.dp_attention_args import check_dp_attention_start
from shardserve.cluster.frontend.chat_output import ParserConfig
from shardserve.cluster.frontend.openai_app import OPEN_ROUTES, build_openai_app
from shardserve.cluster.frontend.openai_router import RouterCore
from shardserve.cluster.frontend.replica_directory import REPLICA_DEPLOYMENT, ServeReplicas
from shardserve.cluster.frontend.replica_pool import FAILED, READY, RECOVERING
from shardserve.cluster.frontend.limits import (
    DEFAULT_MAX_CHOICES, DEFAULT_MAX_PROMPT_CHARS, DEFAULT_MAX_REQUEST_BODY_BYTES, Limits)
from shardserve.cluster.frontend.security import (
    DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_RELOAD_DRAIN_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S, FrontConfig, key_digest,
    load_admin_keys, load_api_keys, refuse_exposed)
from shardserve.cluster.replica.worker_group import GroupConfig, check_worker_resources
from shardserve.cluster.routing import DEFAULT_LOAD_MARGIN, LEAST_LOADED, PREFIX_AWARE, ROUTING_POLICIES, RoutingPolicy
from shardserve.workers.model_source import DEFAULT_MODEL, check_model, known_model_names

logger = logging.getLogger(__name__)
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_SHUTDOWN_MARGIN_S = 30.0   # after the drain: stop the gRPC server and the ranks
ROUTING_STATS_PERIOD_S = 1.0   # how often Serve asks each replica for its routing stats
# Settings only the router (or Serve's deployment options) read: left out of the replicas' init
# args, so that changing them does not restart the replicas.
ROUTER_ONLY = ("served_model_name", "data_parallel_size", "min_replicas", "max_replicas", "target_ongoing_requests",
               "upscale_delay_s", "downscale_delay_s", "autoscaling_look_back_s", "routing", "routing_load_margin",
               "grpc_port", "router_cpus", "router_resource")


@dataclass(slots=True)
class ServeArgs:
    """The app's arguments (``args:`` of ``serve_config.yaml``; the CLI fills the same fields).

    Attributes:
        model: known model name, ``.gguf`` file or HF checkpoint folder.
        served_model_name: the name clients use (default: the model's name).
        tensor_parallel_size: shard workers per replica. data_parallel_size: replicas (fixed count).
        min_replicas / max_replicas: autoscale between these many replicas (``max_replicas`` turns
            autoscaling on; ``min_replicas`` defaults to 1 then, and ``data_parallel_size`` must stay 1).
        target_ongoing_requests: requests (running + waiting) per replica the autoscaler aims at
            (default: half of ``max_num_seqs``). upscale_delay_s / downscale_delay_s: how long the
            autoscaler must want more / fewer replicas before it acts (Serve's defaults, 30 / 600 s).
            autoscaling_look_back_s: the window the replicas' load is averaged over (seconds).
        routing: ``least-loaded`` or ``prefix-aware`` (default: prefix-aware when there can be more
            than one replica, see :mod:`cluster.routing`). routing_load_margin: requests the replica
            holding the longest cached prefix may have outstanding beyond the least-loaded one.
        tensor_split: relative share of each TP rank (uneven splits), or None.
        cpus_per_worker / gpus_per_worker: resources of each shard worker's bundle.
        placement_strategy: Ray placement strategy of a replica's group: ``PACK`` (fill few nodes),
            ``SPREAD``, ``STRICT_PACK`` (one node) or ``STRICT_SPREAD`` (coordinator and every rank on
            a node of its own). Ranks on different nodes use gloo (CPU) or NCCL (GPU).
        cpu_collective: ``shm`` / ``gloo`` / None (pick by placement). dispatch: ``calls`` or ``compiled``.
        grpc_port: the app's one gRPC endpoint, on the router (0 = any free port; None = none).
        replica_grpc_port: each replica's own gRPC server, for direct access (0 = any free port; a
            fixed port works for one replica per node, others fall back to a free port).
        grpc_host: interface the gRPC servers bind (``0.0.0.0``: all; the router dials the node IP).
        router_cpus: CPUs reserved for the router replica. router_resource: a Ray custom resource
            the router needs one unit of instead of CPUs (``shardserve manifest`` gives it a pod of its
            own, which the gRPC endpoint's Service selects); None: anywhere with ``router_cpus``.
        drain_timeout_s: how long a replaced replica may take to finish its running requests
            (size it for the longest completion you serve); Serve's ``graceful_shutdown_timeout_s``.
        block_size, kv_cache_gib, num_blocks, max_model_len, max_num_seqs,
        max_num_batched_tokens, enable_prefix_caching, seed, dsa, dsa_top_k, indexer_cache_dtype,
            dsa_sink, speculative_tokens, speculative_policy, device, dtype, gpu_memory_utilization, enforce_eager,
            recovery_timeout, quantization, compile, packed_dense_rows, enable_dp_attention, attention_dp_size,
            moe_a2a: engine
            settings (see EngineArgs). ``device="cuda"`` with
            ``gpus_per_worker=0`` reserves one GPU per worker.
        api_key: accepted API keys, comma-separated or a list (hidden from ``repr``; prefer a file);
            api_key_file: a file with one key per line. Neither: ``$SHARDSERVE_API_KEY``, else none
            (a Kubernetes manifest sets neither and passes the key from a Secret in that variable).
            api_key_sha256: SHA-256 digests (hex) of more accepted keys (what the deployments get).
        admin_api_key / admin_api_key_file / admin_api_key_sha256: the admin keys, the same way
            (``$SHARDSERVE_ADMIN_API_KEY``); none: no admin routes or methods.
        allow_unauthenticated: let the gRPC servers bind a non-loopback ``grpc_host`` without a key.
        allowed_model_root: folder weight reloads may read (default: the served model's folder).
        reload_drain_timeout: seconds a drain reload waits for running requests before it is refused.
        max_request_body_bytes, max_prompt_chars, max_choices, rate_limit_requests,
            rate_limit_tokens: limits before work (see :mod:`cluster.frontend.limits`).
        max_queued_requests: requests that may wait per replica before new ones get 429.
        request_timeout: seconds a request may take (None: no limit; default 600); past it, 408.
        grpc_tls_cert / grpc_tls_key: PEM files of the replicas' gRPC servers (the same paths on
            every node); the router trusts the certificate when it dials them.
        tool_call_parser, enable_auto_tool_choice, reasoning_parser: how the router parses chat
            answers (vLLM's flags; see :class:`cluster.frontend.chat_output.ParserConfig`).
    """

    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    autoscaling_look_back_s: float = 30.0
    routing: str | None = None
    routing_load_margin: int = DEFAULT_LOAD_MARGIN
    tensor_split: list[float] | None = None
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    placement_strategy: str = "PACK"
    cpu_collective: str | None = None
    dispatch: str = "calls"
    grpc_port: int | None = 50051
    replica_grpc_port: int = 0
    grpc_host: str = "127.0.0.1"
    router_cpus: float = 1.0
    router_resource: str | None = None
    drain_timeout_s: float = 300.0
    block_size: int = 16
    kv_cache_gib: float = 1.0
    num_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_tokens: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    dsa: bool | None = None
    dsa_top_k: int | None = None
    indexer_cache_dtype: str = "auto"
    dsa_sink: int = 0
    speculative_tokens: int = 0
    speculative_policy: str = "adaptive"
    device: str = "auto"
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    recovery_timeout: float = 300.0
    quantization: str = "none"
    compile: str = "off"
    packed_dense_rows: str = "0"
    enable_dp_attention: bool = False
    attention_dp_size: int | None = None
    moe_a2a: str = "allgather"
    api_key: str | list[str] | None = field(default=None, repr=False)
    api_key_file: str | None = None
    api_key_sha256: list[str] | None = None
    admin_api_key: str | list[str] | None = field(default=None, repr=False)
    admin_api_key_file: str | None = None
    admin_api_key_sha256: list[str] | None = None
    allow_unauthenticated: bool = False
    allowed_model_root: str | None = None
    reload_drain_timeout: float = DEFAULT_RELOAD_DRAIN_TIMEOUT_S
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    max_choices: int = DEFAULT_MAX_CHOICES
    rate_limit_requests: int | None = None
    rate_limit_tokens: int | None = None
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S
    grpc_tls_cert: str | None = None
    grpc_tls_key: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    @classmethod
    def from_dict(cls, raw: dict | None) -> ServeArgs:
        """Build from a plain dict (YAML ``args``).

        Raises:
            ValueError: an unknown key or an inconsistent setting.
        """
        raw = dict(raw or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown shardserve app argument(s) {unknown}; known: {sorted(known)}")
        args = cls(**raw)
        args.validate()
        return args

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Raises ValueError for inconsistent settings (engine and front checks included), or
        FileNotFoundError for a key or certificate file that does not exist."""
        self.engine_args().validate()
        front = self.front_config()
        front.validate()
        refuse_exposed(self.grpc_host, front.requires_key, self.allow_unauthenticated, "grpc_host")
        self.parser_config().validate()
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        self._validate_scaling()
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, "
                             f"got {self.placement_strategy!r}")
        if self.gpus_per_worker and self.tensor_parallel_size > 1 and self.gpus_per_worker != int(self.gpus_per_worker):
            raise ValueError(f"gpus_per_worker={self.gpus_per_worker}: NCCL needs whole GPUs per rank "
                             f"(a fractional GPU only works at tensor_parallel_size 1)")
        if not 0 <= self.drain_timeout_s < math.inf:
            raise ValueError(f"drain_timeout_s must be >= 0 seconds, got {self.drain_timeout_s}")
        check_worker_resources(self.cpus_per_worker, self.gpus_per_worker)
        for name in ("grpc_port", "replica_grpc_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be a TCP port (0-65535), got {port}")
        if self.grpc_port and self.grpc_port == self.replica_grpc_port:
            raise ValueError(f"grpc_port and replica_grpc_port are both {self.grpc_port}: the router's endpoint "
                             "and the replicas' servers need different ports")

    def _validate_scaling(self) -> None:
        """Replica counts, autoscaling and routing settings (ValueError when inconsistent)."""
        if self.routing is not None and self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        if self.routing_load_margin < 0:
            raise ValueError(f"routing_load_margin must be >= 0 requests, got {self.routing_load_margin}")
        if self.max_replicas is None:
            if self.min_replicas is not None:
                raise ValueError("min_replicas needs max_replicas (autoscaling); for a fixed count use "
                                 "data_parallel_size")
            return
        low = 1 if self.min_replicas is None else self.min_replicas
        if self.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size {self.data_parallel_size} with max_replicas: the autoscaler sizes "
                             "the replicas; set min_replicas instead")
        if not 1 <= low <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {low} and {self.max_replicas} "
                             "(the router needs a replica: no scale to zero)")
        if self.target_ongoing_requests is not None and not self.target_ongoing_requests > 0:
            raise ValueError(f"target_ongoing_requests must be > 0, got {self.target_ongoing_requests}")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0 or not self.autoscaling_look_back_s > 0:
            raise ValueError("upscale_delay_s and downscale_delay_s must be >= 0 and autoscaling_look_back_s > 0")

    @property
    def autoscaled(self) -> bool:
        """Serve's autoscaler sizes the replicas (``max_replicas`` is set)."""
        return self.max_replicas is not None

    def max_num_replicas(self) -> int:
        """The most replicas the app may run (what a local cluster is sized for)."""
        return self.max_replicas if self.autoscaled else self.data_parallel_size

    def min_num_replicas(self) -> int:
        """The replicas the app runs at least (and starts with)."""
        return (self.min_replicas or 1) if self.autoscaled else self.data_parallel_size

    def replica_count_options(self) -> dict:
        """The ``ModelReplica`` deployment's ``num_replicas`` or ``autoscaling_config`` (Serve's options)."""
        if not self.autoscaled:
            return {"num_replicas": self.data_parallel_size}
        target = self.target_ongoing_requests or max(1.0, self.max_num_seqs / 2)
        return {"autoscaling_config": autoscaling_config(self.min_num_replicas(), self.max_replicas, target,
                                                         self.upscale_delay_s, self.downscale_delay_s,
                                                         self.autoscaling_look_back_s)}

    def routing_policy(self) -> RoutingPolicy:
        """The router's policy: ``routing``, or prefix-aware when there can be more than one replica."""
        name = self.routing or (PREFIX_AWARE if self.max_num_replicas() > 1 else LEAST_LOADED)
        return RoutingPolicy(name, self.routing_load_margin)

    def replica_args(self) -> dict:
        """The replicas' init args: every setting but the router-only ones (:data:`ROUTER_ONLY`)."""
        return {name: value for name, value in self.to_dict().items() if name not in ROUTER_ONLY}

    def engine_args(self) -> EngineArgs:
        return EngineArgs(model=self.model, block_size=self.block_size, kv_cache_gib=self.kv_cache_gib,
                          num_blocks=self.num_blocks, max_num_seqs=self.max_num_seqs,
                          max_num_batched_tokens=self.max_num_batched_tokens,
                          max_prefill_tokens=self.max_prefill_tokens, max_model_len=self.max_model_len,
                          enable_prefix_caching=self.enable_prefix_caching, seed=self.seed,
                          tensor_parallel_size=self.tensor_parallel_size, tensor_split=self.tensor_split,
                          dsa=self.dsa, dsa_top_k=self.dsa_top_k, indexer_cache_dtype=self.indexer_cache_dtype,
                          dsa_sink=self.dsa_sink, speculative_tokens=self.speculative_tokens,
                          speculative_policy=self.speculative_policy, device=self.device,
                          dtype=self.dtype, gpu_memory_utilization=self.gpu_memory_utilization,
                          enforce_eager=self.enforce_eager, recovery_timeout=self.recovery_timeout,
                          quantization=self.quantization, compile=self.compile,
                          packed_dense_rows=self.packed_dense_rows, enable_dp_attention=self.enable_dp_attention,
                          attention_dp_size=self.attention_dp_size,
                          moe_a2a=self.moe_a2a)

    def worker_gpus(self) -> float:
        """GPUs in each worker's bundle: ``gpus_per_worker``, or 1 when ``device="cuda"`` left it 0."""
        return self.gpus_per_worker or (1.0 if self.device == "cuda" else 0.0)

    def front_config(self) -> FrontConfig:
        """What the router and the replicas' gRPC servers enforce (keys read here, kept as digests)."""
        api = [key_digest(k) for k in load_api_keys(self.api_key, self.api_key_file)] + list(self.api_key_sha256 or [])
        admin = [key_digest(k) for k in load_admin_keys(self.admin_api_key, self.admin_api_key_file)]
        admin += list(self.admin_api_key_sha256 or [])
        limits = Limits(max_request_body_bytes=self.max_request_body_bytes, max_prompt_chars=self.max_prompt_chars,
                        max_choices=self.max_choices, rate_limit_requests=self.rate_limit_requests,
                        rate_limit_tokens=self.rate_limit_tokens)
        return FrontConfig(api_key_digests=list(dict.fromkeys(api)), admin_key_digests=list(dict.fromkeys(admin)),
                           max_queued_requests=self.max_queued_requests, request_timeout=self.request_timeout,
                           grpc_tls_cert=self.grpc_tls_cert, grpc_tls_key=self.grpc_tls_key,
                           allowed_model_root=self.allowed_model_root, reload_drain_timeout=self.reload_drain_timeout,
                           limits=limits)

    def with_key_digests(self) -> ServeArgs:
        """These arguments with every key read and replaced by its digest (what the deployments get)."""
        front = self.front_config()
        return dataclasses.replace(self, api_key=[], api_key_file=None, api_key_sha256=front.api_key_digests,
                                   admin_api_key=[], admin_api_key_file=None,
                                   admin_api_key_sha256=front.admin_key_digests)

    def parser_config(self) -> ParserConfig:
        return ParserConfig(self.tool_call_parser, self.enable_auto_tool_choice, self.reasoning_parser)

    def group_config(self) -> GroupConfig:
        return GroupConfig(tensor_parallel_size=self.tensor_parallel_size, cpus_per_worker=self.cpus_per_worker,
                           gpus_per_worker=self.worker_gpus(), strategy=self.placement_strategy,
                           collective=self.cpu_collective, dispatch=self.dispatch, device=self.device)

    def replica_bundles(self) -> list[dict]:
        """Placement group of one replica: bundle 0 for the replica (coordinator), then one per rank
        (the MTP draft worker, when speculation is on, shares rank 0's)."""
        gpus = self.worker_gpus()
        worker = {"CPU": self.cpus_per_worker, **({"GPU": gpus} if gpus else {})}
        return [{"CPU": 1.0}] + [dict(worker) for _ in range(self.tensor_parallel_size)]

    def served_names(self) -> list[str]:
        """Names a request's ``model`` may use; the first is reported."""
        if self.model in known_model_names():
            own = self.model
        else:
            path = Path(self.model)
            own = path.stem if path.suffix == ".gguf" else path.name
        names = [self.served_model_name or own, own, self.model]
        return list(dict.fromkeys(names))

    def cpus_needed(self) -> float:
        """Logical CPUs the whole app reserves at most (``max_replicas`` replicas when autoscaled)."""
        router = 0.0 if self.router_resource else self.router_cpus
        return router + self.max_num_replicas() * sum(b["CPU"] for b in self.replica_bundles())


@serve.deployment(max_ongoing_requests=100, health_check_period_s=5, health_check_timeout_s=30,
                  max_surge_percent=100)
class ModelReplica:
    """One tensor-parallel model replica: coordinator, engine loop and gRPC server in this actor.

    The constructor returns once the model is loaded and the gRPC server is up (Serve routes to
    a replica, and retires the one it replaces, only after that), and raises when the model
    cannot load (Serve then keeps the old version).

    Args:
        args: :meth:`ServeArgs.replica_args` (a dict).

    Raises:
        RuntimeError: the model could not load ("replica ID failed to load: ..."); starting the gRPC
            server raises its own error.
    """

    async def __init__(self, args: dict) -> None:
        from shardserve.cluster.replica.coordinator import Coordinator

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.args = ServeArgs.from_dict(args)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        try:   # the constructor blocks on Ray calls (spawn ranks, load weights): keep the loop free
            coordinator = await asyncio.to_thread(Coordinator, self.args.engine_args(), self.args.group_config(),
                                                  self.args.front_config())
        except Exception as exc:
            # Serve reports the last line; ``shardserve serve`` prints it as its one-line error.
            raise RuntimeError(f"replica {self.replica_id} failed to load: {type(exc).__name__}: {exc}") from exc
        try:
            self.address = await self._start_grpc(coordinator)
        except Exception:
            await coordinator.shutdown()
            raise
        self.coordinator = coordinator
        logger.info("model replica %s ready: gRPC on %s", self.replica_id, self.address)

    async def _start_grpc(self, coordinator) -> str:
        port = self.args.replica_grpc_port
        try:
            return await coordinator.start_grpc(port, self.args.grpc_host)
        except RuntimeError:
            if not port:
                raise
            # Another replica on this node holds the port (or the one being replaced, until it has
            # drained); the router learns the address from status() either way.
            logger.warning("gRPC port %d is taken (another replica on this node?): using a free port", port)
            return await coordinator.start_grpc(0, self.args.grpc_host)

    def _state(self) -> str:
        coordinator = self.coordinator
        return READY if coordinator.healthy else RECOVERING if coordinator.recovering else FAILED

    async def status(self, target: str | None = None) -> dict:
        """``{"state": ready|recovering|failed, "address", "error", "info", "token", "local_address"}``
        (info: ModelInfo dict; token: the internal token the router authenticates with;
        local_address: the local link's socket, for a router on this machine). ``target``: the
        replica the caller meant (:class:`cluster.frontend.replica_directory.ReplicaDirectoryRouter`
        routes the call there).

        Raises:
            RuntimeError: the call reached another replica than ``target``.
        """
        self._check_target(target)
        coordinator = self.coordinator
        # NOTE: "token" is this replica's internal credential: the router's only way in. Status
        # goes over Ray to the router (and the CLI that started the app), never to a client.
        return {"state": self._state(), "address": self.address, "error": coordinator.failed or coordinator.error,
                "info": coordinator.model_info(), "token": coordinator.internal_token, "replica_id": self.replica_id,
                "local_address": coordinator.local_address}

    def _check_target(self, target: str | None) -> None:
        if target is not None and target != self.replica_id:
            raise RuntimeError(f"a call for replica {target} reached replica {self.replica_id}")

    async def record_routing_stats(self) -> dict:
        """What Serve relays to the router every ``ROUTING_STATS_PERIOD_S``: gRPC address, state,
        load and prefix-cache counters (no secret: Serve keeps these in its controller)."""
        core = self.coordinator.core
        bm, scheduler = core.block_manager, core.scheduler
        return {"address": self.address, "state": self._state(), "draining": self.coordinator.draining,
                "running": len(scheduler.running), "waiting": len(scheduler.waiting),
                "free_blocks": bm.num_free_blocks, "num_blocks": bm.num_blocks, "cached_blocks": len(bm.cached),
                "prefix_queries": bm.prefix_queries, "prefix_hits": bm.prefix_hits}

    async def record_autoscaling_stats(self) -> dict:
        """The load Serve's autoscaler reads (:mod:`cluster.autoscaling`): requests running + waiting."""
        scheduler = self.coordinator.core.scheduler
        return {ONGOING_REQUESTS: float(len(scheduler.running) + len(scheduler.waiting))}

    async def cache_events(self, target: str | None = None):
        """This replica's prefix-cache events (:mod:`cluster.replica.cache_events`), until the caller
        stops reading (the router does when Serve drops the replica).

        Raises:
            RuntimeError: the call reached another replica than ``target``.
        """
        self._check_target(target)
        async for message in self.coordinator.cache_events.stream():
            yield message

    async def check_health(self) -> None:
        """Serve's health check: a dead worker the replica could not repair in place
        (``--recovery-timeout``) restarts this replica; a repair in progress does not.

        Raises:
            RuntimeError: the replica cannot serve.
        """
        self.coordinator.check_health()

    async def __del__(self) -> None:
        """Serve stops this replica (scale-down, upgrade, shutdown): finish the running requests
        (new ones are refused and retried elsewhere by the router), then stop everything."""
        coordinator = getattr(self, "coordinator", None)   # None: the constructor failed
        if coordinator is not None:
            await coordinator.drain(self.args.drain_timeout_s)
            await coordinator.shutdown()  # stops gRPC, the ranks, and frees shared memory


def _not_an_open_route_access_log(record: logging.LogRecord) -> bool:
    """Drop Serve's access-log lines of ``GET /health`` (polled by start-up waits and probes every
    few seconds); every other request is still logged."""
    if not getattr(record, "serve_access_log", False):
        return True
    route, message = getattr(record, "route", None), record.getMessage()
    return not any(route == path and f"{method} {path} " in message for method, path in OPEN_ROUTES)


def _load_tokenizer(model: str):
    from shardserve.cluster.tokenizer import load_tokenizer
    from shardserve.workers.model_source import resolve_model

    return load_tokenizer(resolve_model(model))


@serve.deployment(max_ongoing_requests=1024, max_surge_percent=100)
@serve.ingress()
class OpenAIRouter:
    """The HTTP ingress and the gRPC endpoint (see :class:`cluster.frontend.openai_router.RouterCore`
    for the behaviour, :func:`cluster.frontend.openai_app.build_openai_app` for the routes and the
    API-key guard, :mod:`cluster.frontend.grpc_front` for gRPC).

    The constructor returns once the tokenizer is loaded and every replica Serve lists was asked
    for its status once, so a replacement router knows the serving replicas before it takes
    traffic; then the gRPC endpoint binds ``grpc_port``.

    Args:
        args: :class:`ServeArgs` as a dict.
        replicas: the deployment handle of ``ModelReplica``.

    Raises:
        RuntimeError: the tokenizer could not be loaded, or the gRPC port could not be bound.
    """

    async def __init__(self, args: dict, replicas) -> None:
        from shardserve.cluster.frontend.grpc_front import start_router_grpc

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("ray.serve").addFilter(_not_an_open_route_access_log)
        cfg = ServeArgs.from_dict(args)
        self.front = cfg.front_config()
        self.core = RouterCore(cfg.model, cfg.served_names(), ServeReplicas(replicas, replicas.app_name),
                               functools.partial(_load_tokenizer, cfg.model), front=self.front,
                               policy=cfg.routing_policy(), parsers=cfg.parser_config())
        self.core.start()
        self.grpc = None
        try:
            await self.core.wait_started()
            if cfg.grpc_port is not None:
                self.grpc = await start_router_grpc(self.core, cfg.grpc_host, cfg.grpc_port, self.front)
        except Exception:
            await self.core.close()
            raise

    def __serve_build_asgi_app__(self):
        """Serve's hook, called after ``__init__``: the app that answers HTTP on this replica."""
        return build_openai_app(self.core, self.front)

    async def grpc_address(self) -> str | None:
        """``host:port`` of the gRPC endpoint (None when there is none)."""
        return self.grpc.address if self.grpc is not None else None

    async def __del__(self) -> None:
        if self.grpc is not None:
            await self.grpc.stop()
        await self.core.close()


def build_app(args: dict | None = None) -> serve.Application:
    """The Serve application (``import_path: shardserve.cluster.serve_app:build_app``; ``args`` as in
    :class:`ServeArgs`).

    Raises:
        ValueError: unknown or inconsistent arguments (``enable_dp_attention`` on a model without MLA
            or MoE, or in a build without the DP-attention runtime, among them).
        FileNotFoundError: the model is neither a known name nor an existing path.
    """
    from ray.serve.config import RequestRouterConfig

    from shardserve.cluster.frontend.serve_request_router import ReplicaDirectoryRouter

    cfg = ServeArgs.from_dict(args)
    check_model(cfg.model)
    check_dp_attention_start(cfg.engine_args())   # MLA + MoE model, and a build that runs it
    # Keys are read once, here (the environment of whoever builds the app); only digests go on.
    cfg = cfg.with_key_digests()
    shutdown_s = cfg.drain_timeout_s + _SHUTDOWN_MARGIN_S   # Serve kills a stopping replica after this
    actor_options: dict = {"num_cpus": 1.0}
    if cfg.autoscaled:
        actor_options["runtime_env"] = {"env_vars": push_interval_env(cfg.autoscaling_look_back_s)}
    replicas = ModelReplica.options(
        name=REPLICA_DEPLOYMENT, ray_actor_options=actor_options, **cfg.replica_count_options(),
        logging_config={"enable_access_log": False},  # the router polls status() every few seconds
        placement_group_bundles=cfg.replica_bundles(), placement_group_strategy=cfg.placement_strategy,
        graceful_shutdown_timeout_s=shutdown_s,
        request_router_config=RequestRouterConfig(request_router_class=ReplicaDirectoryRouter,
                                                  request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
                                                  request_routing_stats_timeout_s=10.0),
    ).bind(cfg.replica_args())
    router_options = ({"num_cpus": 0, "resources": {cfg.router_resource: 1}} if cfg.router_resource
                      else {"num_cpus": cfg.router_cpus})
    return OpenAIRouter.options(ray_actor_options=router_options,
                                graceful_shutdown_timeout_s=shutdown_s).bind(cfg.to_dict(), replicas)
