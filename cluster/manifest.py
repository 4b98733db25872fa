"""``shardserve manifest``: the KubeRay ``RayService`` that runs the app ``shardserve serve`` would
run, made from the same arguments, so Kubernetes manifests come from one source of truth
(:class:`cluster.serve_app.ServeArgs`) instead of being copied by hand.

What it writes (a ``ray.io/v1`` ``RayService`` and a ``networking.k8s.io/v1`` ``NetworkPolicy``):

- ``serveConfigV2``: the Serve config of ``build_app`` with the ``ServeArgs`` that differ from their
  defaults (plus the layout ones, always), HTTP on ``0.0.0.0``. Changing it later is an in-place
  ``serve deploy``: new replicas start before old ones stop (``serve_app``'s rolling upgrade).
- ``rayClusterConfig``: a head pod that runs no model work (``num-cpus: 0``: the GCS, the Serve
  controller and the dashboard KubeRay talks to) and one worker group whose pods hold
  ``ranks_per_pod`` shard workers each plus room for a coordinator and the router. A replica whose
  ranks do not fit one pod spans several (e.g. TP=16 on two pods of 8 GPUs); its ranks then use the
  network collective (NCCL on GPU, gloo on CPU). Pods get a memory-backed ``/dev/shm`` (NCCL and the
  CPU shared-memory all-reduce need more than a container's 64 MiB), NCCL's environment on GPUs,
  and a readiness probe on ``/health``, so only pods whose Serve proxy reaches a loaded model
  take traffic (pods without a Serve replica stay unready, as with KubeRay's own probe). Surge pods
  (in-tree autoscaling up to ``surge_pods`` more) give an upgraded replica room to load before the
  old one stops.
- ``serveService``: the OpenAI API Service; KubeRay owns its selector, so it follows the active
  cluster through a ``NewCluster`` upgrade (a ``rayClusterConfig`` change: a whole new cluster,
  traffic moves once its models are loaded, the old one is deleted after ``drain_timeout_s``).
- The gRPC endpoint (``grpc_port``, served by the router): a ``router`` worker group of one pod that
  only the router fits (Ray custom resource :data:`ROUTER_RESOURCE`, no CPUs for replicas), ready
  once its router answers ``/health``, and a Service ``NAME-grpc`` selecting that pod. Through a
  ``NewCluster`` upgrade the new cluster's router pod joins the Service once it is ready, and the
  old one leaves when its cluster is deleted.
- Autoscaling (``--min-replicas`` / ``--max-replicas``): the worker group starts with the pods of
  ``min_replicas`` and KubeRay's in-tree autoscaler may grow it to those of ``max_replicas`` (plus
  the surge pods): Serve's autoscaler adds a replica, its placement group waits for room, Ray's
  autoscaler adds a pod; a replica removed leaves idle pods that go after ``idleTimeoutSeconds``.
- Ray's control plane closed: token authentication through KubeRay's ``authOptions``; the dashboard
  binds the head pod's own address (``$(SHARDSERVE_POD_IP)``, never ``0.0.0.0``) and the Ray client
  port is not exposed; the ``NetworkPolicy`` lets only the cluster's own pods reach any port (GCS
  6379, dashboard 8265, workers, the replicas' gRPC), the KubeRay operator reach the dashboard, and
  anyone reach the Serve port and, on the router pod, the gRPC endpoint's port (the Services' ports,
  guarded by the API key).
- Pods run as a non-root user (uid 1000, the images' ``shardserve``) with a restricted
  ``securityContext`` (no privilege escalation, every capability dropped, the runtime's seccomp
  profile) and no service-account token; only KubeRay's autoscaler sidecar, which scales the worker
  pods through the Kubernetes API, gets one (a projected token mounted into it alone).
- Keys: an API key Secret is required (``SHARDSERVE_API_KEY``, never written into the manifest;
  ``--allow-unauthenticated`` opts out), the admin key likewise (``SHARDSERVE_ADMIN_API_KEY``,
  optional); a ``LoadBalancer`` Service needs a key and HTTPS. TLS files come from a
  ``kubernetes.io/tls`` Secret mounted at ``/etc/shardserve/tls``; ``--ssl-certfile/--ssl-keyfile``
  (HTTPS, and the readiness probe then speaks HTTPS) and ``--grpc-tls-cert/--grpc-tls-key`` name
  files inside the pods, so they are written as given and not looked for on this machine.

Bad layouts (more GPUs than the pods hold, fractional GPUs with NCCL, a name Kubernetes refuses)
raise :class:`LayoutError` before anything is written.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

import yaml

from shardserve.cluster.frontend.security import check_tls_pair
from shardserve.cluster.ingress import controller_env, ingress_env, resolve_ingress
from shardserve.cluster.serve_app import ServeArgs

RAY_VERSION = "2.60.0"
_ALWAYS_ARGS = ("model", "tensor_parallel_size", "data_parallel_size", "cpus_per_worker", "gpus_per_worker",
                "placement_strategy", "grpc_host", "grpc_port", "drain_timeout_s", "router_resource")
_NCCL_ENV = {"NCCL_SOCKET_IFNAME": "eth0",   # the pod network interface carries NCCL's bootstrap/sockets
             "NCCL_DEBUG": "WARN"}
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")   # DNS-1035 label (KubeRay's rule for the name)
_MAX_NAME = 47                                           # KubeRay appends 6 characters for the cluster
TLS_MOUNT = "/etc/shardserve/tls"                        # where --tls-secret is mounted
RUN_AS = 1000                                            # the images' non-root user (Dockerfile*)
POD_IP_ENV = "SHARDSERVE_POD_IP"                         # the pod's own address (downward API)
APP_LABEL = "shardserve.io/app"                          # on every pod of the generated cluster
ROLE_LABEL = "shardserve.io/role"                        # "router" on the router's pod
ROUTER_RESOURCE = "shardserve_router"                    # Ray resource only the router pod has
_TOKEN_VOLUME = "kube-api-access"                        # the autoscaler's projected service-account token
_TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
_OPERATOR_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}


class LayoutError(ValueError):
    """The requested pods cannot hold the replicas, or a manifest field is invalid (one line)."""


@dataclass(slots=True)
class PodLayout:
    """Kubernetes-side settings (everything else comes from :class:`ServeArgs`).

    Attributes:
        name: RayService name (DNS-1035 label, at most 47 characters).
        image: container image with shardserve installed (``Dockerfile`` / ``Dockerfile.gpu``).
        worker_pods: worker pods serving (default: the fewest that hold every replica).
        gpus_per_pod: GPUs of each worker pod (default: one replica's ranks, at most 8).
        memory_per_pod, head_memory: memory of a worker pod / the head pod (Kubernetes quantity).
        shm_size: size of each pod's memory-backed ``/dev/shm`` (default 1Gi, 64Gi with GPUs).
        surge_pods: extra worker pods the autoscaler may add while an upgraded replica loads
            (default: the pods of one replica; 0 pins the size, then an upgrade waits for room).
        api_key_secret: Secret holding the API key (``NAME`` with key ``api-key``, or ``NAME:KEY``);
            required unless ``allow_unauthenticated``.
        admin_api_key_secret: Secret holding the admin key (``NAME`` with key ``admin-api-key``, or
            ``NAME:KEY``); none: no admin routes.
        allow_unauthenticated: generate a cluster whose API needs no key.
        operator_namespace: namespace of the KubeRay operator (it deploys the app through the
            dashboard, which the NetworkPolicy opens to it alone).
        model_pvc: PersistentVolumeClaim with the weights, mounted read-only at ``model_mount``.
        tls_secret: Secret with TLS files, mounted read-only at :data:`TLS_MOUNT`.
        ssl_certfile / ssl_keyfile: HTTPS files of Serve's proxy (paths inside the pods).
        upgrade_strategy: RayService ``upgradeStrategy.type`` for ``rayClusterConfig`` changes.
        service_type: type of the OpenAI API Service.
        http_port: Serve's HTTP port. env: extra environment of every Ray container.
        ingress: ``--ingress`` (:mod:`cluster.ingress`): ``auto`` / ``haproxy`` set Ray Serve's HAProxy
            ingress in every Ray container's environment (not with ``ssl_certfile``).
    """

    name: str = "shardserve"
    image: str = "shardserve:0.1.0"
    worker_pods: int | None = None
    gpus_per_pod: int | None = None
    memory_per_pod: str = "8Gi"
    head_memory: str = "4Gi"
    shm_size: str | None = None
    surge_pods: int | None = None
    api_key_secret: str | None = None
    admin_api_key_secret: str | None = None
    allow_unauthenticated: bool = False
    operator_namespace: str = "default"
    model_pvc: str | None = None
    model_mount: str = "/models"
    tls_secret: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    upgrade_strategy: str = "NewCluster"
    service_type: str = "ClusterIP"
    http_port: int = 8000
    env: dict[str, str] = field(default_factory=dict)
    ingress: str = "auto"


@dataclass(slots=True)
class Fit:
    """How the replicas sit on the worker pods."""

    workers_per_replica: int    # shard workers (+ the MTP draft worker) of one replica
    ranks_per_pod: int          # shard workers one pod holds
    pods_per_replica: int       # worker pods one replica spans
    worker_pods: int            # worker pods serving (min_replicas' when autoscaled)
    max_worker_pods: int        # worker pods max_replicas need (= worker_pods without autoscaling)
    surge_pods: int             # extra pods the autoscaler may add during an upgrade
    cpus_per_pod: int           # logical CPUs Ray sees on a worker pod
    gpus_per_pod: int


def fit(args: ServeArgs, layout: PodLayout) -> Fit:
    """Place ``data_parallel_size`` (or ``min_replicas`` .. ``max_replicas``) replicas of
    ``1 + workers`` bundles on worker pods.

    Each pod holds ``ranks_per_pod`` worker bundles plus spare CPUs for one coordinator (bundle 0,
    ``{"CPU": 1}``); the router has a pod of its own and the head runs no model work.

    Raises:
        LayoutError: the pods cannot hold the replicas, or the GPU settings cannot work.
    """
    _validate(args, layout)
    workers = args.tensor_parallel_size   # the MTP draft worker shares rank 0's bundle
    gpu = args.worker_gpus()
    if gpu:
        gpus_per_pod = layout.gpus_per_pod or min(8, math.ceil(workers * gpu))
        per_pod = int(gpus_per_pod // gpu)
        if per_pod == 0:
            raise LayoutError(f"a shard worker needs {gpu:g} GPUs but a pod has {gpus_per_pod}")
    else:
        if layout.gpus_per_pod:
            raise LayoutError(f"--gpus-per-pod {layout.gpus_per_pod} with --gpus-per-worker 0: the ranks "
                              "would not use the GPUs")
        gpus_per_pod, per_pod = 0, workers
    strict_spread = args.placement_strategy == "STRICT_SPREAD"
    if strict_spread:
        per_pod = 1              # one bundle of a replica per node; its coordinator needs one more pod
    pods_per_replica = math.ceil(workers / per_pod) + (1 if strict_spread else 0)

    def pods_for(replicas: int) -> int:
        return max(pods_per_replica, math.ceil(replicas * workers / per_pod) + (replicas - 1 if strict_spread else 0))

    needed = pods_for(args.min_num_replicas())
    pods = layout.worker_pods or needed
    if args.placement_strategy == "STRICT_PACK" and per_pod < workers:
        raise LayoutError(f"STRICT_PACK puts a replica's {workers} workers on one pod, which holds {per_pod}")
    if pods < needed:
        what = f"{gpus_per_pod} GPUs" if gpu else f"{per_pod} workers"
        replicas = args.min_num_replicas()
        raise LayoutError(f"layout does not fit: TP={args.tensor_parallel_size} x {replicas} "
                          f"replica(s) need {needed} worker pod(s) of {what}, got {pods}"
                          + (f" ({replicas * workers * gpu:g} GPUs needed, "
                             f"{pods * gpus_per_pod} in the pods)" if gpu else ""))
    spare = math.ceil(per_pod / workers)   # the coordinators (bundle 0 of each replica)
    surge = pods_per_replica if layout.surge_pods is None else layout.surge_pods
    if surge < 0:
        raise LayoutError(f"--surge-pods must be >= 0, got {surge}")
    return Fit(workers, per_pod, pods_per_replica, pods, max(pods, pods_for(args.max_num_replicas())), surge,
               math.ceil(per_pod * args.cpus_per_worker + spare), int(gpus_per_pod))


def _validate(args: ServeArgs, layout: PodLayout) -> None:
    """``ServeArgs.validate`` minus the TLS files' presence (they are paths inside the pods).

    Raises:
        LayoutError: an invalid setting, or a certificate without its key (or the reverse).
    """
    try:
        check_tls_pair(args.grpc_tls_cert, args.grpc_tls_key, "--grpc-tls-cert", "--grpc-tls-key")
        check_tls_pair(layout.ssl_certfile, layout.ssl_keyfile, "--ssl-certfile", "--ssl-keyfile")
    except FileNotFoundError:
        pass   # both given: the files live in the pods
    except ValueError as exc:
        raise LayoutError(str(exc)) from exc
    try:
        resolve_ingress(layout.ingress, bool(layout.ssl_certfile))
    except ValueError as exc:
        raise LayoutError(str(exc)) from exc
    try:   # keys come from Secrets in the pods: none is read here, and the check is _check_keys'
        dataclasses.replace(args, grpc_tls_cert=None, grpc_tls_key=None, api_key=[], admin_api_key=[],
                            grpc_host="127.0.0.1").validate()
    except ValueError as exc:
        raise LayoutError(str(exc)) from exc
    _check_keys(args, layout)
    _check_pod_settings(args, layout)


_RAY_PORTS = {6379: "Ray's GCS", 8265: "the Ray dashboard"}
_HAPROXY_PORTS = {8404: "HAProxy's stats page", 9101: "HAProxy's Prometheus exporter"}   # Ray's defaults
_MANAGED_ENV = ("SHARDSERVE_API_KEY", "SHARDSERVE_ADMIN_API_KEY")


def _check_pod_settings(args: ServeArgs, layout: PodLayout) -> None:
    """Ports a pod can open (1-65535, no two on one port, none of Ray's) and ``--env`` names the
    manifest does not set itself.

    Raises:
        LayoutError: naming the flag.
    """
    ports = [("--port", layout.http_port), ("--grpc-port", args.grpc_port or None),
             ("--replica-grpc-port", args.replica_grpc_port or None)]
    if not 1 <= layout.http_port <= 65535:
        raise LayoutError(f"--port must be a TCP port (1-65535) a pod can open, got {layout.http_port}")
    taken: dict[int, str] = dict(_RAY_PORTS)
    if resolve_ingress(layout.ingress, bool(layout.ssl_certfile)) == "haproxy":
        taken.update(_HAPROXY_PORTS)
    for flag, port in ports:
        if port is None:
            continue
        if port in taken:
            raise LayoutError(f"{flag} {port}: the pods use that port for {taken[port]} already; choose another")
        taken[port] = flag
    if layout.gpus_per_pod is not None and layout.gpus_per_pod < 0:
        raise LayoutError(f"--gpus-per-pod must be >= 0, got {layout.gpus_per_pod}")
    for name in layout.env:
        if name in _MANAGED_ENV or name == POD_IP_ENV:
            what = "comes from a Secret (--api-key-secret / --admin-api-key-secret)" if name in _MANAGED_ENV \
                else "is set by the manifest (the pod's IP)"
            raise LayoutError(f"--env {name}: this variable {what}; it cannot be given with --env")


def _check_keys(args: ServeArgs, layout: PodLayout) -> None:
    """Secure defaults: a key Secret unless ``allow_unauthenticated``; a LoadBalancer (reachable from
    outside the cluster) needs a key and HTTPS.

    Raises:
        LayoutError: which is missing.
    """
    if not layout.api_key_secret and not layout.allow_unauthenticated:
        raise LayoutError("the API would need no key: pass --api-key-secret NAME[:KEY] (a Secret holding it), or "
                          "--allow-unauthenticated")
    if layout.service_type == "LoadBalancer" and not (layout.api_key_secret and layout.ssl_certfile):
        raise LayoutError("--service-type LoadBalancer exposes the API outside the cluster: it needs "
                          "--api-key-secret and HTTPS (--tls-secret with --ssl-certfile/--ssl-keyfile)")
    if layout.service_type == "LoadBalancer" and args.grpc_port and not args.grpc_tls_cert:
        raise LayoutError("--service-type LoadBalancer exposes the gRPC endpoint outside the cluster too: it needs "
                          "TLS (--grpc-tls-cert/--grpc-tls-key under --tls-secret's mount)")


def app_args(args: ServeArgs) -> dict:
    """The ``args:`` of the Serve application: the layout fields and whatever differs from the
    defaults (so a field added to ``ServeArgs`` later does not change existing manifests)."""
    defaults = ServeArgs()
    secret = ("api_key", "api_key_file", "api_key_sha256", "admin_api_key", "admin_api_key_file",
              "admin_api_key_sha256", "allow_unauthenticated")
    out = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeArgs)
           if f.name not in secret and (f.name in _ALWAYS_ARGS or getattr(args, f.name) != getattr(defaults, f.name))}
    return out


def _app_args_for(args: ServeArgs, layout: PodLayout) -> dict:
    out = app_args(dataclasses.replace(args, router_resource=ROUTER_RESOURCE))   # the router on its own pod
    if layout.allow_unauthenticated:
        out["allow_unauthenticated"] = True   # the gRPC servers bind 0.0.0.0 without a key
    return out


def serve_config(args: ServeArgs, layout: PodLayout) -> dict:
    """The Serve config (``serveConfigV2``) deploying ``build_app`` with ``args``."""
    http_options: dict = {"host": "0.0.0.0", "port": layout.http_port}
    if layout.ssl_certfile:
        http_options.update(ssl_certfile=layout.ssl_certfile, ssl_keyfile=layout.ssl_keyfile)
    return {"proxy_location": "EveryNode",
            "http_options": http_options,
            "applications": [{"name": "shardserve", "route_prefix": "/",
                              "import_path": "shardserve.cluster.serve_app:build_app",
                              "args": _app_args_for(args, layout)}]}


def _env(args: ServeArgs, layout: PodLayout) -> dict:
    """``{"env": [...]}`` of a Ray container (empty when there is nothing to set)."""
    env = dict(_NCCL_ENV) if args.worker_gpus() else {}
    env.update(ingress_env(resolve_ingress(layout.ingress, bool(layout.ssl_certfile)), local=False))
    env.update(controller_env())
    env.update(layout.env)
    out = [{"name": key, "value": value} for key, value in env.items()]
    out.append({"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    for variable, secret, default_key in (("SHARDSERVE_API_KEY", layout.api_key_secret, "api-key"),
                                          ("SHARDSERVE_ADMIN_API_KEY", layout.admin_api_key_secret, "admin-api-key")):
        if secret:
            name, _, key = secret.partition(":")
            out.append({"name": variable, "valueFrom": {"secretKeyRef": {"name": name, "key": key or default_key}}})
    return {"env": out}


def _restricted() -> dict:
    """A container's restricted securityContext (Kubernetes' "restricted" Pod Security Standard)."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _pod_spec(containers: list[dict], volumes: list[dict]) -> dict:
    """A pod: non-root, no service-account token, the runtime's seccomp profile."""
    return {"automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": containers, "volumes": volumes}


def _token_volume() -> dict:
    """The service-account token of KubeRay's autoscaler sidecar (mounted into it alone), as the
    kubelet's own ``kube-api-access`` volume: token, cluster CA and namespace."""
    return {"name": _TOKEN_VOLUME, "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}}


def _volumes(layout: PodLayout, shm_size: str) -> tuple[list[dict], list[dict]]:
    volumes = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}}]
    mounts = [{"name": "shm", "mountPath": "/dev/shm"}]
    if layout.model_pvc:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": layout.model_pvc, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": layout.model_mount, "readOnly": True})
    if layout.tls_secret:
        volumes.append({"name": "tls", "secret": {"secretName": layout.tls_secret}})
        mounts.append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
    return volumes, mounts


def _head(args: ServeArgs, layout: PodLayout, autoscaled: bool) -> dict:
    volumes, mounts = _volumes(layout, "1Gi")
    resources = {"cpu": "2", "memory": layout.head_memory}
    container = {
        "name": "ray-head", "image": layout.image, **_env(args, layout),
        # No Ray client port (10001): nothing outside the cluster drives Ray; the dashboard is for the operator.
        "ports": [{"containerPort": 6379, "name": "gcs"}, {"containerPort": 8265, "name": "dashboard"},
                  {"containerPort": layout.http_port, "name": "serve"}],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": mounts, "securityContext": _restricted()}
    if autoscaled:
        volumes = volumes + [_token_volume()]
    # num-cpus 0: no replica, router or rank lands on the head (KubeRay deploys the app once the head
    # is ready, so the head keeps KubeRay's own probes; traffic goes to the worker pods). The
    # dashboard binds the pod's own address (the kubelet expands $(VAR) in the container's command).
    return {"rayStartParams": {"dashboard-host": f"$({POD_IP_ENV})", "num-cpus": "0"},
            "template": {"metadata": {"labels": {APP_LABEL: layout.name}}, "spec": _pod_spec([container], volumes)}}


def _worker_group(args: ServeArgs, layout: PodLayout, placed: Fit) -> dict:
    shm = layout.shm_size or ("64Gi" if args.worker_gpus() else "1Gi")
    volumes, mounts = _volumes(layout, shm)
    resources = {"cpu": str(placed.cpus_per_pod), "memory": layout.memory_per_pod}
    if placed.gpus_per_pod:
        resources["nvidia.com/gpu"] = str(placed.gpus_per_pod)
    container = {
        "name": "ray-worker", "image": layout.image, **_env(args, layout),
        "ports": [{"containerPort": layout.http_port, "name": "serve"}],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": mounts, "securityContext": _restricted(),
        # Ready once this pod's Serve proxy reaches a loaded model (503 while loading); pods that
        # hold no Serve replica run no proxy and stay unready, as with KubeRay's default probe.
        "readinessProbe": {"httpGet": {"path": "/health", "port": layout.http_port,
                                       **({"scheme": "HTTPS"} if layout.ssl_certfile else {})},
                           "periodSeconds": 5, "timeoutSeconds": 4, "failureThreshold": 2}}
    spec = _pod_spec([container], volumes)
    if placed.gpus_per_pod:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    group = "gpu-workers" if placed.gpus_per_pod else "cpu-workers"
    return {"groupName": group, "replicas": placed.worker_pods, "minReplicas": placed.worker_pods,
            "maxReplicas": placed.max_worker_pods + placed.surge_pods,
            "rayStartParams": {"num-cpus": str(placed.cpus_per_pod)},
            "template": {"metadata": {"labels": {APP_LABEL: layout.name}}, "spec": spec}}


def _router_group(args: ServeArgs, layout: PodLayout) -> dict:
    """One pod for the router alone: Ray sees no CPU there (no replica lands on it) and two units
    of :data:`ROUTER_RESOURCE` (the router and its replacement during an upgrade). Ready once the
    router answers ``/health``, so the gRPC Service only sends to a router that serves."""
    volumes, mounts = _volumes(layout, "1Gi")
    cpus = str(max(1, math.ceil(2 * args.router_cpus)))
    resources = {"cpu": cpus, "memory": layout.head_memory}
    container = {
        "name": "ray-worker", "image": layout.image, **_env(args, layout),
        "ports": [{"containerPort": layout.http_port, "name": "serve"}]
        + ([{"containerPort": args.grpc_port, "name": "grpc"}] if args.grpc_port else []),
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": mounts, "securityContext": _restricted(),
        "readinessProbe": {"httpGet": {"path": "/health", "port": layout.http_port,
                                       **({"scheme": "HTTPS"} if layout.ssl_certfile else {})},
                           "periodSeconds": 5, "timeoutSeconds": 4, "failureThreshold": 2}}
    labels = {APP_LABEL: layout.name, ROLE_LABEL: "router"}
    return {"groupName": "router", "replicas": 1, "minReplicas": 1, "maxReplicas": 1,
            "rayStartParams": {"num-cpus": "0", "resources": f'"{{\\"{ROUTER_RESOURCE}\\": 2}}"'},
            "template": {"metadata": {"labels": labels}, "spec": _pod_spec([container], volumes)}}


def grpc_service(args: ServeArgs, layout: PodLayout) -> dict:
    """The Service of the app's one gRPC endpoint: the router pod's ``grpc_port``."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{layout.name}-grpc"},
            "spec": {"type": layout.service_type,
                     "selector": {APP_LABEL: layout.name, ROLE_LABEL: "router"},
                     "ports": [{"name": "grpc", "port": args.grpc_port, "targetPort": args.grpc_port,
                                "appProtocol": "grpc"}]}}


def rayservice(args: ServeArgs, layout: PodLayout) -> dict:
    """The ``RayService`` document.

    Raises:
        LayoutError: see :func:`fit`; also a bad name or an API key given in clear.
    """
    if not _NAME.match(layout.name) or len(layout.name) > _MAX_NAME:
        raise LayoutError(f"--name {layout.name!r}: a RayService name is a DNS-1035 label of at most "
                          f"{_MAX_NAME} characters (lowercase letters, digits, '-')")
    if args.api_key:
        raise LayoutError("the API key must not be written into a manifest: put it in a Secret and pass "
                          "--api-key-secret NAME")
    placed = fit(args, layout)
    autoscaled = bool(placed.surge_pods) or placed.max_worker_pods > placed.worker_pods
    groups = [_worker_group(args, layout, placed), _router_group(args, layout)]
    cluster: dict = {"rayVersion": RAY_VERSION, "authOptions": {"mode": "token"},
                     "headGroupSpec": _head(args, layout, autoscaled=autoscaled),
                     "workerGroupSpecs": groups}
    if autoscaled:
        cluster["enableInTreeAutoscaling"] = True
        cluster["autoscalerOptions"] = {"idleTimeoutSeconds": 120, "upscalingMode": "Default",
                                        "securityContext": _restricted(),
                                        "volumeMounts": [{"name": _TOKEN_VOLUME, "mountPath": _TOKEN_PATH,
                                                          "readOnly": True}]}
    spec = {
        "upgradeStrategy": {"type": layout.upgrade_strategy},
        # a replaced cluster stays up while its running requests finish
        "rayClusterDeletionDelaySeconds": int(math.ceil(args.drain_timeout_s)),
        "excludeHeadPodFromServeSvc": True,
        "serveService": {"metadata": {"name": f"{layout.name}-openai"},
                         "spec": {"type": layout.service_type,
                                  "ports": [{"name": "serve", "port": layout.http_port,
                                             "targetPort": layout.http_port}]}},
        "serveConfigV2": yaml.safe_dump(serve_config(args, layout), sort_keys=False),
        "rayClusterConfig": cluster}
    return {"apiVersion": "ray.io/v1", "kind": "RayService", "metadata": {"name": layout.name}, "spec": spec}


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (the embedded Serve config stays readable)."""


_Dumper.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))


def grpc_network_policy(args: ServeArgs, layout: PodLayout) -> dict:
    """The router pod's extra ``NetworkPolicy``: its gRPC endpoint (the ``NAME-grpc`` Service's port)
    from anywhere, guarded by the API key. The replicas' own gRPC servers stay closed to the outside."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{layout.name}-grpc"},
            "spec": {"podSelector": {"matchLabels": {APP_LABEL: layout.name, ROLE_LABEL: "router"}},
                     "policyTypes": ["Ingress"],
                     "ingress": [{"ports": [{"protocol": "TCP", "port": args.grpc_port}]}]}}


def network_policy(layout: PodLayout) -> dict:
    """The ``NetworkPolicy`` of the generated cluster's pods (label :data:`APP_LABEL`): every port
    from the cluster's own pods (Ray's GCS, dashboard, object and worker ports, the replicas'
    gRPC), the dashboard from the KubeRay operator, and only the Serve port from anywhere else."""
    own = {"podSelector": {"matchLabels": {APP_LABEL: layout.name}}}
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": layout.operator_namespace}},
                "podSelector": {"matchLabels": dict(_OPERATOR_LABELS)}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{layout.name}-ray"},
            "spec": {"podSelector": {"matchLabels": {APP_LABEL: layout.name}}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [own]},
                                 {"from": [operator], "ports": [{"protocol": "TCP", "port": 8265}]},
                                 {"ports": [{"protocol": "TCP", "port": layout.http_port}]}]}}


def render(args: ServeArgs, layout: PodLayout, command: str) -> str:
    """The manifest as YAML text, headed by ``command`` (which regenerates it) and a summary.

    Raises:
        LayoutError: see :func:`rayservice`.
    """
    doc = rayservice(args, layout)
    placed = fit(args, layout)
    gpu = f", {args.worker_gpus():g} GPU" if args.worker_gpus() else ""
    pods = (f"{placed.worker_pods}" if placed.max_worker_pods == placed.worker_pods
            else f"{placed.worker_pods}-{placed.max_worker_pods}")
    replicas = (f"{args.min_num_replicas()}-{args.max_replicas} replicas (autoscaled)" if args.autoscaled
                else f"{args.data_parallel_size} replica(s)")
    lines = [
        "# Generated by `shardserve manifest` from the arguments of `shardserve serve`; do not edit, regenerate:",
        f"#   {command}",
        f"# {replicas} of {args.model} at TP={args.tensor_parallel_size} "
        f"({args.placement_strategy}); each rank {args.cpus_per_worker:g} CPU{gpu}.",
        f"# {pods} worker pod(s) of {placed.ranks_per_pod} rank(s), {placed.cpus_per_pod} CPUs"
        + (f", {placed.gpus_per_pod} GPUs" if placed.gpus_per_pod else "")
        + f"; one replica spans {placed.pods_per_replica} pod(s); up to {placed.surge_pods} surge pod(s) "
        "while an upgraded replica loads; one pod for the router.",
        f"# OpenAI API: Service {layout.name}-openai, port {layout.http_port}"
        + (f"; gRPC: Service {layout.name}-grpc, port {args.grpc_port}" if args.grpc_port else "")
        + ". Needs the KubeRay operator (ray.io/v1 CRDs with authOptions).",
    ]
    if layout.api_key_secret:
        secret = layout.api_key_secret.partition(":")
        lines.append(f"# API key: kubectl create secret generic {secret[0]} --from-literal={secret[2] or 'api-key'}=...")
    if layout.tls_secret:
        lines.append(f"# TLS files: kubectl create secret tls {layout.tls_secret} --cert=tls.crt --key=tls.key "
                     f"(mounted at {TLS_MOUNT})")
    if layout.admin_api_key_secret:
        secret = layout.admin_api_key_secret.partition(":")
        lines.append(f"# Admin key: kubectl create secret generic {secret[0]} "
                     f"--from-literal={secret[2] or 'admin-api-key'}=...")
    docs = [doc, network_policy(layout)]
    if args.grpc_port:
        docs += [grpc_service(args, layout), grpc_network_policy(args, layout)]
    body = yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
    return "\n".join(lines) + "\n" + body
