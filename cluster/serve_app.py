"""Ray Serve application: an OpenAI-compatible HTTP front over tensor-parallel model replicas.

Two kinds of deployments (``build_app`` wires them; ``serve_config.yaml`` and ``shardserve
serve`` both deploy ``shardserve.cluster.serve_app:build_app``):

- ``ModelReplica{i}`` (one per data-parallel replica, ``num_replicas=1`` each): the Serve replica
  *is* the replica's coordinator. It builds :class:`cluster.replica.coordinator.Coordinator` in-process,
  which puts shard worker ``r`` in bundle ``r + 1`` of the replica's own placement group
  (``placement_group_bundles = [{"CPU": 1}] + [worker bundle] * tp``; bundle 0 holds the replica
  itself), so tensor parallelism needs no second, nested placement group. The engine loop and
  the gRPC server (``shardserve.v1.Inference``) run on the replica's event loop.
- ``OpenAIRouter`` (FastAPI ingress, the app of :func:`cluster.frontend.openai_app.build_openai_app`,
  built on the replica after the router core): ``/v1/chat/completions``, ``/v1/completions``,
  ``/v1/models``, ``/health``, ``/metrics``, ``/docs``, ``POST /admin/reload_weights``
  (:mod:`cluster.frontend.admin`). It learns each replica's gRPC address through its deployment handle and
  forwards requests over the same gRPC API external clients use, to the replica with the fewest
  outstanding tokens (see :mod:`cluster.frontend.openai_router`).

API keys (``api_key_file``, ``api_key`` or ``$SHARDSERVE_API_KEY``; admin keys likewise with
``admin_``) are read once, by :func:`build_app`, and only their SHA-256 digests travel to the
deployments (``api_key_sha256`` / ``admin_api_key_sha256``: no key in Serve's init args); they
guard the router's HTTP app and every replica's gRPC server alike. The router calls each replica
with the internal token that replica made at start-up and reports in :meth:`ModelReplica.status`;
see :mod:`cluster.frontend.security`.

A replica whose shard or draft worker dies repairs itself in place (``cluster/replica/recovery.py``) and
reports ``recovering`` meanwhile; only when that fails (``recovery_timeout``) does its health
check fail, and Serve replaces the replica, as it does when the replica process itself dies.

One deployment per data-parallel replica (rather than ``num_replicas=N``) gives the router a
handle per replica, hence every replica's gRPC address, without a registry actor.

Rolling upgrades (``serve deploy`` of a changed config, hence RayService ``serveConfigV2`` edits):
Serve counts a replica as running once its constructor returns, so both constructors return only
when the replica can serve (the model loaded and the gRPC server up; the router's tokenizer
loaded and its replicas polled once), and raise when it cannot: a config whose model cannot load
never takes traffic. ``max_surge_percent=100`` makes Serve start the replacement before it stops
the old replica, and keeps the old one when the new one fails to start. A stopping model replica
drains: it refuses new requests (the router retries them on the replacement) and finishes its
running ones within ``drain_timeout_s`` (``graceful_shutdown_timeout_s`` leaves room for it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

from ray import serve

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.frontend.chat_output import ParserConfig
from shardserve.cluster.frontend.openai_app import OPEN_ROUTES, build_openai_app
from shardserve.cluster.frontend.openai_router import RouterCore
from shardserve.cluster.frontend.replica_pool import FAILED, READY, RECOVERING
from shardserve.cluster.frontend.limits import (
    DEFAULT_MAX_CHOICES, DEFAULT_MAX_PROMPT_CHARS, DEFAULT_MAX_REQUEST_BODY_BYTES, Limits)
from shardserve.cluster.frontend.security import (
    DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_RELOAD_DRAIN_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S, FrontConfig, key_digest,
    load_admin_keys, load_api_keys, refuse_exposed)
from shardserve.cluster.replica.worker_group import GroupConfig
from shardserve.workers.model_source import DEFAULT_MODEL, check_model, known_model_names

logger = logging.getLogger(__name__)
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_SHUTDOWN_MARGIN_S = 30.0   # after the drain: stop the gRPC server and the ranks


@dataclass(slots=True)
class ServeArgs:
    """The app's arguments (``args:`` of ``serve_config.yaml``; the CLI fills the same fields).

    Attributes:
        model: known model name, ``.gguf`` file or HF checkpoint folder.
        served_model_name: the name clients use (default: the model's name).
        tensor_parallel_size: shard workers per replica. data_parallel_size: replicas.
        tensor_split: relative share of each TP rank (uneven splits), or None.
        cpus_per_worker / gpus_per_worker: resources of each shard worker's bundle.
        placement_strategy: Ray placement strategy of a replica's group: ``PACK`` (fill few nodes),
            ``SPREAD``, ``STRICT_PACK`` (one node) or ``STRICT_SPREAD`` (coordinator and every rank on
            a node of its own). Ranks on different nodes use gloo (CPU) or NCCL (GPU).
        cpu_collective: ``shm`` / ``gloo`` / None (pick by placement). dispatch: ``calls`` or ``compiled``.
        grpc_port: replica i serves gRPC on ``grpc_port + i``; 0 = any free port.
        grpc_host: interface the gRPC servers bind (``0.0.0.0``: all; the router dials the node IP).
        router_cpus: CPUs reserved for the router replica.
        drain_timeout_s: how long a replaced replica may take to finish its running requests
            (size it for the longest completion you serve); Serve's ``graceful_shutdown_timeout_s``.
        block_size, kv_cache_gib, num_blocks, max_model_len, max_num_seqs,
        max_num_batched_tokens, enable_prefix_caching, seed, dsa, dsa_top_k, indexer_cache_dtype,
            dsa_sink, speculative_tokens, speculative_policy, device, dtype, gpu_memory_utilization, enforce_eager,
            recovery_timeout, quantization, compile: engine settings (see EngineArgs). ``device="cuda"`` with
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
    tensor_split: list[float] | None = None
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    placement_strategy: str = "PACK"
    cpu_collective: str | None = None
    dispatch: str = "calls"
    grpc_port: int = 0
    grpc_host: str = "127.0.0.1"
    router_cpus: float = 1.0
    drain_timeout_s: float = 300.0
    block_size: int = 16
    kv_cache_gib: float = 1.0
    num_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
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
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, "
                             f"got {self.placement_strategy!r}")
        if self.gpus_per_worker and self.tensor_parallel_size > 1 and self.gpus_per_worker != int(self.gpus_per_worker):
            raise ValueError(f"gpus_per_worker={self.gpus_per_worker}: NCCL needs whole GPUs per rank "
                             f"(a fractional GPU only works at tensor_parallel_size 1)")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not 0 <= self.grpc_port <= 65535 - self.data_parallel_size:
            raise ValueError(f"grpc_port {self.grpc_port} leaves no room for {self.data_parallel_size} replicas")

    def engine_args(self) -> EngineArgs:
        return EngineArgs(model=self.model, block_size=self.block_size, kv_cache_gib=self.kv_cache_gib,
                          num_blocks=self.num_blocks, max_num_seqs=self.max_num_seqs,
                          max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
                          enable_prefix_caching=self.enable_prefix_caching, seed=self.seed,
                          tensor_parallel_size=self.tensor_parallel_size, tensor_split=self.tensor_split,
                          dsa=self.dsa, dsa_top_k=self.dsa_top_k, indexer_cache_dtype=self.indexer_cache_dtype,
                          dsa_sink=self.dsa_sink, speculative_tokens=self.speculative_tokens,
                          speculative_policy=self.speculative_policy, device=self.device,
                          dtype=self.dtype, gpu_memory_utilization=self.gpu_memory_utilization,
                          enforce_eager=self.enforce_eager, recovery_timeout=self.recovery_timeout,
                          quantization=self.quantization, compile=self.compile)

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
        """Logical CPUs the whole app reserves."""
        return self.router_cpus + self.data_parallel_size * sum(b["CPU"] for b in self.replica_bundles())


@serve.deployment(max_ongoing_requests=100, health_check_period_s=5, health_check_timeout_s=30,
                  max_surge_percent=100)
class ModelReplica:
    """One tensor-parallel model replica: coordinator, engine loop and gRPC server in this actor.

    The constructor returns once the model is loaded and the gRPC server is up (Serve routes to
    a replica, and retires the one it replaces, only after that), and raises when the model
    cannot load (Serve then keeps the old version).

    Args:
        args: :class:`ServeArgs` as a dict.
        index: data-parallel rank (its gRPC port is ``grpc_port + index`` when a port is set).

    Raises:
        RuntimeError: the model could not load ("replica I failed to load: ..."); starting the gRPC
            server raises its own error.
    """

    async def __init__(self, args: dict, index: int) -> None:
        from shardserve.cluster.replica.coordinator import Coordinator

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.args, self.index = ServeArgs.from_dict(args), index
        try:   # the constructor blocks on Ray calls (spawn ranks, load weights): keep the loop free
            coordinator = await asyncio.to_thread(Coordinator, self.args.engine_args(), self.args.group_config(),
                                                  self.args.front_config())
        except Exception as exc:
            # Serve reports the last line; ``shardserve serve`` prints it as its one-line error.
            raise RuntimeError(f"replica {index} failed to load: {type(exc).__name__}: {exc}") from exc
        try:
            self.address = await self._start_grpc(coordinator)
        except Exception:
            await coordinator.shutdown()
            raise
        self.coordinator = coordinator
        logger.info("model replica %d ready: gRPC on %s", self.index, self.address)

    async def _start_grpc(self, coordinator) -> str:
        port = self.args.grpc_port + self.index if self.args.grpc_port else 0
        try:
            return await coordinator.start_grpc(port, self.args.grpc_host)
        except RuntimeError:
            if not port:
                raise
            # During a rolling upgrade the replica being replaced still holds the port until it
            # has drained; the router learns the new address from status() either way.
            logger.warning("gRPC port %d is taken (the replica being replaced?): using a free port", port)
            return await coordinator.start_grpc(0, self.args.grpc_host)

    async def status(self) -> dict:
        """``{"state": ready|recovering|failed, "address", "error", "info", "token"}`` (info: ModelInfo
        dict; token: the internal token the router authenticates with)."""
        coordinator = self.coordinator
        info = coordinator.model_info()
        state = READY if info["healthy"] else RECOVERING if coordinator.recovering else FAILED
        # NOTE: "token" is this replica's internal credential: the router's only way in. Status
        # goes over Ray to the router (and the CLI that started the app), never to a client.
        return {"state": state, "address": self.address, "error": coordinator.failed or coordinator.error,
                "info": info, "token": coordinator.internal_token}

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


async def _replica_status(handle) -> dict:
    return await handle.status.remote()


def _load_tokenizer(model: str):
    from shardserve.cluster.tokenizer import load_tokenizer
    from shardserve.workers.model_source import resolve_model

    return load_tokenizer(resolve_model(model))


@serve.deployment(max_ongoing_requests=1024, max_surge_percent=100)
@serve.ingress()
class OpenAIRouter:
    """The HTTP ingress (see :class:`cluster.frontend.openai_router.RouterCore` for the behaviour and
    :func:`cluster.frontend.openai_app.build_openai_app` for the routes and the API-key guard).

    The constructor returns once the tokenizer is loaded and every replica was asked for its
    status once, so a replacement router knows the serving replicas before it takes traffic.

    Args:
        args: :class:`ServeArgs` as a dict.
        replicas: deployment handles of ``ModelReplica0..N-1``.

    Raises:
        RuntimeError: the tokenizer could not be loaded.
    """

    async def __init__(self, args: dict, replicas: list) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("ray.serve").addFilter(_not_an_open_route_access_log)
        cfg = ServeArgs.from_dict(args)
        self.front = cfg.front_config()
        self.core = RouterCore(cfg.model, cfg.served_names(),
                               [functools.partial(_replica_status, handle) for handle in replicas],
                               functools.partial(_load_tokenizer, cfg.model), front=self.front,
                               parsers=cfg.parser_config())
        self.core.start()
        try:
            await self.core.wait_started()
        except Exception:
            await self.core.close()
            raise

    def __serve_build_asgi_app__(self):
        """Serve's hook, called after ``__init__``: the app that answers HTTP on this replica."""
        return build_openai_app(self.core, self.front)

    async def __del__(self) -> None:
        await self.core.close()


def build_app(args: dict | None = None) -> serve.Application:
    """The Serve application (``import_path: shardserve.cluster.serve_app:build_app``; ``args`` as in
    :class:`ServeArgs`).

    Raises:
        ValueError: unknown or inconsistent arguments.
        FileNotFoundError: the model is neither a known name nor an existing path.
    """
    cfg = ServeArgs.from_dict(args)
    check_model(cfg.model)
    # Keys are read once, here (the environment of whoever builds the app); only digests go on.
    cfg = cfg.with_key_digests()
    raw = cfg.to_dict()
    shutdown_s = cfg.drain_timeout_s + _SHUTDOWN_MARGIN_S   # Serve kills a stopping replica after this
    replicas = [
        ModelReplica.options(
            name=f"ModelReplica{i}", num_replicas=1, ray_actor_options={"num_cpus": 1.0},
            logging_config={"enable_access_log": False},  # the router polls status() every few seconds
            placement_group_bundles=cfg.replica_bundles(), placement_group_strategy=cfg.placement_strategy,
            graceful_shutdown_timeout_s=shutdown_s,
        ).bind(raw, i)
        for i in range(cfg.data_parallel_size)
    ]
    return OpenAIRouter.options(ray_actor_options={"num_cpus": cfg.router_cpus},
                                graceful_shutdown_timeout_s=shutdown_s).bind(raw, replicas)
