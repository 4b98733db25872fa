"""Kubernetes deliverables without a cluster: every document under ``k8s/`` checked as the API server
(the KubeRay CRDs' openAPIV3Schema, unknown fields rejected), the KubeRay operator (its spec rules),
Ray Serve (``ServeDeploySchema``) and our app (``ServeArgs``) would check it; ``shardserve manifest``
reproduces the committed files and rejects layouts that cannot fit; the images install the package
the way ``make install`` does. Fast (no Ray, no model)."""

from __future__ import annotations

import copy
import gzip
import os
import re
import shlex
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from shardserve.cluster.cli import main
from shardserve.cluster.serve_app import ServeArgs

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "k8s").glob("*.yaml"))
COMMAND = re.compile(r"^#   (shardserve manifest .*)$", re.MULTILINE)


# The v1 schemas of KubeRay's RayService and RayCluster CRDs (ray-project/kuberay commit feeaf72fa,
# Apache-2.0; descriptions dropped), so a clean clone validates without ../shared/data.
VENDORED_CRDS = Path(__file__).resolve().parents[1] / "data" / "kuberay-crds-v1.yaml.gz"


def crd_texts() -> list[str]:
    """The CRD files: ``$SHARDSERVE_KUBERAY_CRDS``, else ``shared/data/kuberay-crds`` beside this
    checkout or above it, else the vendored v1 schemas."""
    found = os.environ.get("SHARDSERVE_KUBERAY_CRDS")
    for parent in [] if found else REPO.parents:
        if (parent / "shared" / "data" / "kuberay-crds").is_dir():
            found = parent / "shared" / "data" / "kuberay-crds"
            break
    if found:
        return [path.read_text() for path in sorted(Path(found).glob("*.yaml"))]
    return [gzip.decompress(VENDORED_CRDS.read_bytes()).decode()]


def strict(schema):
    """The schema with unknown fields rejected, as ``kubectl apply`` (field validation Strict) does:
    every object that lists its properties and neither allows extra ones nor preserves unknown
    fields gets ``additionalProperties: false``."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


@pytest.fixture(scope="module")
def validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    """``(apiVersion, kind) -> validator`` for the CRDs' ``v1`` schemas."""
    out = {}
    for text in crd_texts():
        for crd in yaml.load_all(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if not version.get("served", True) or version["name"] != "v1":
                    continue   # the manifests use ray.io/v1
                schema = strict(version["schema"]["openAPIV3Schema"])
                jsonschema.Draft7Validator.check_schema(schema)
                out[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    assert ("ray.io/v1", "RayService") in out and ("ray.io/v1", "RayCluster") in out
    return out


def documents() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def kuberay_rules(doc: dict) -> list[str]:
    """The operator's own checks (KubeRay ``utils/validation.go``) that the schema cannot express."""
    errors, spec = [], doc["spec"]
    cluster = spec["rayClusterConfig"] if doc["kind"] == "RayService" else spec
    name = doc["metadata"]["name"]
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 47:
        errors.append(f"name {name!r} is not a DNS-1035 label of at most 47 characters")
    head = cluster["headGroupSpec"]
    if not head["template"]["spec"].get("containers"):
        errors.append("headGroupSpec has no container")
    for group in cluster.get("workerGroupSpecs", []):
        low, high = group.get("minReplicas"), group.get("maxReplicas")
        if not cluster.get("enableInTreeAutoscaling") and (low is None or high is None):
            errors.append(f"worker group {group['groupName']} needs minReplicas and maxReplicas")
        if low is not None and high is not None and not 0 <= low <= group.get("replicas", low) <= high:
            errors.append(f"worker group {group['groupName']}: replicas outside [minReplicas, maxReplicas]")
        if group.get("resources") and set(group.get("rayStartParams", {})) & {"num-cpus", "num-gpus", "memory"}:
            errors.append(f"worker group {group['groupName']} sets resources twice")
    if doc["kind"] == "RayService":
        if spec.get("upgradeStrategy", {}).get("type") not in (None, "NewCluster", "None",
                                                               "NewClusterWithIncrementalUpgrade"):
            errors.append(f"upgradeStrategy.type {spec['upgradeStrategy']['type']!r}")
        ports = [p.get("name") for p in head["template"]["spec"]["containers"][0].get("ports", [])]
        ports += [p.get("name") for p in spec.get("serveService", {}).get("spec", {}).get("ports", [])]
        if "serve" not in ports:
            errors.append("no port named 'serve': KubeRay would not create the Serve service")
    return errors


def network_policy_errors(doc: dict) -> list[str]:
    """The API server's shape of a ``networking.k8s.io/v1`` NetworkPolicy (the fields used here)."""
    errors, spec = [], doc.get("spec", {})
    if set(doc) - {"apiVersion", "kind", "metadata", "spec"} or set(spec) - {"podSelector", "policyTypes", "ingress",
                                                                              "egress"}:
        errors.append("unknown fields")
    if not isinstance(spec.get("podSelector", {}).get("matchLabels"), dict):
        errors.append("spec.podSelector.matchLabels")
    if not set(spec.get("policyTypes", [])) <= {"Ingress", "Egress"}:
        errors.append("policyTypes")
    for rule in spec.get("ingress", []):
        if set(rule) - {"from", "ports"}:
            errors.append(f"ingress rule {rule}")
        for peer in rule.get("from", []):
            if not peer or set(peer) - {"podSelector", "namespaceSelector", "ipBlock"}:
                errors.append(f"peer {peer}")
        for port in rule.get("ports", []):
            if port.get("protocol") not in ("TCP", "UDP", "SCTP") or not isinstance(port.get("port"), int):
                errors.append(f"port {port}")
    return errors


def rayservice_doc(path: Path) -> dict:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "RayService"]
    return doc


def test_every_manifest_passes_the_crd_schema_and_kuberay_rules(validators):
    docs = documents()
    assert {path.name for path, _ in docs} >= {"rayservice.yaml", "rayservice-deepseek-v32-gpu.yaml"}
    for path, doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key == ("networking.k8s.io/v1", "NetworkPolicy"):
            assert not network_policy_errors(doc), f"{path.name}: {network_policy_errors(doc)}"
            continue
        if key not in validators:
            assert doc["apiVersion"] == "v1", f"{path.name}: no schema for {key}"   # core objects only
            continue
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validators[key].iter_errors(doc)]
        assert not errors + kuberay_rules(doc), f"{path.name}: {errors + kuberay_rules(doc)}"


def test_the_schema_check_catches_what_the_api_server_would(validators):
    (_, doc), = [(p, d) for p, d in documents() if p.name == "rayservice.yaml" and d["kind"] == "RayService"]
    validator = validators[("ray.io/v1", "RayService")]
    typo = copy.deepcopy(doc)
    typo["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replica"] = 2       # unknown field
    wrong_type = copy.deepcopy(doc)
    wrong_type["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    bad_enum = copy.deepcopy(doc)
    bad_enum["spec"]["rayClusterConfig"]["authOptions"]["mode"] = "password"
    for broken in (typo, wrong_type, bad_enum):
        assert list(validator.iter_errors(broken))


def test_serve_configs_pass_ray_serves_schema_and_the_app_arguments(monkeypatch):
    monkeypatch.setenv("SHARDSERVE_API_KEY", "sk-from-the-secret")   # as in the pods: grpc_host 0.0.0.0 needs a key
    for path, doc in documents():
        if doc["kind"] != "RayService":
            continue
        config = ServeDeploySchema.model_validate(yaml.safe_load(doc["spec"]["serveConfigV2"]))
        (app,) = config.applications
        assert app.import_path == "shardserve.cluster.serve_app:build_app", path.name
        args = ServeArgs.from_dict(app.args)    # unknown keys and inconsistent settings raise
        assert args.grpc_host == "0.0.0.0" and config.http_options.host == "0.0.0.0"
        assert doc["spec"]["rayClusterDeletionDelaySeconds"] >= args.drain_timeout_s


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_shardserve_manifest_reproduces_the_committed_file(path, capsys):
    text = path.read_text()
    (command,) = COMMAND.findall(text)
    assert main(shlex.split(command)[1:]) == 0
    assert capsys.readouterr().out == text, f"k8s/{path.name} is stale: rerun `{command} > k8s/{path.name}`"


def worker_group(doc: dict) -> dict:
    """The model replicas' worker group (the router has a group of its own)."""
    (group,) = [g for g in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] != "router"]
    return group


def test_gpu_example_spans_one_replica_over_two_8_gpu_pods():
    doc = rayservice_doc(REPO / "k8s" / "rayservice-deepseek-v32-gpu.yaml")
    args = ServeArgs.from_dict(dict(yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]["args"],
                                    allow_unauthenticated=True))
    group = worker_group(doc)
    (container,) = group["template"]["spec"]["containers"]
    assert (args.tensor_parallel_size, args.data_parallel_size, args.gpus_per_worker) == (16, 1, 1)
    assert group["replicas"] == 2 and container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert int(group["rayStartParams"]["num-cpus"]) >= 8 * args.cpus_per_worker + 1   # ranks + coordinator
    shm = {v["name"]: v for v in group["template"]["spec"]["volumes"]}["shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NCCL_SOCKET_IFNAME"]["value"] == "eth0"
    assert env["SHARDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "shardserve-api-key"
    assert "api_key" not in yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert doc["spec"]["upgradeStrategy"]["type"] == "NewCluster"
    assert group["maxReplicas"] == 4 and doc["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"]
    assert doc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def test_device_front_door_and_tls_flags_reach_the_rayservice(validators, capsys, monkeypatch):
    monkeypatch.setenv("SHARDSERVE_API_KEY", "sk-of-this-shell")   # never copied into a manifest
    tls = "/etc/shardserve/tls"
    assert main(["manifest", "-tp", "2", "--device", "cuda", "--dtype", "float16", "--gpu-memory-utilization", "0.8",
                 "--max-queued-requests", "32", "--request-timeout", "120", "--api-key-secret", "keys:main",
                 "--tls-secret", "shardserve-tls", "--ssl-certfile", f"{tls}/tls.crt", "--ssl-keyfile",
                 f"{tls}/tls.key", "--grpc-tls-cert", f"{tls}/tls.crt", "--grpc-tls-key", f"{tls}/tls.key"]) == 0
    text = capsys.readouterr().out
    assert "sk-of-this-shell" not in text and "kubectl create secret tls shardserve-tls" in text
    doc = next(yaml.safe_load_all(text))
    errors = list(validators[("ray.io/v1", "RayService")].iter_errors(doc))
    assert not errors + kuberay_rules(doc), errors + kuberay_rules(doc)
    config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    args = config["applications"][0]["args"]
    assert {key: args[key] for key in ("device", "dtype", "gpu_memory_utilization", "max_queued_requests",
                                       "request_timeout", "grpc_tls_cert", "grpc_tls_key")} == {
        "device": "cuda", "dtype": "float16", "gpu_memory_utilization": 0.8, "max_queued_requests": 32,
        "request_timeout": 120.0, "grpc_tls_cert": f"{tls}/tls.crt", "grpc_tls_key": f"{tls}/tls.key"}
    assert "api_key" not in args and "api_key_file" not in args
    assert (config["http_options"]["ssl_certfile"], config["http_options"]["ssl_keyfile"]) == (
        f"{tls}/tls.crt", f"{tls}/tls.key")
    group = worker_group(doc)
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"   # --device cuda: one GPU per rank
    assert {e["name"]: e for e in container["env"]}["SHARDSERVE_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "keys", "key": "main"}}
    assert {"name": "tls", "secret": {"secretName": "shardserve-tls"}} in group["template"]["spec"]["volumes"]
    assert {"name": "tls", "mountPath": tls, "readOnly": True} in container["volumeMounts"]
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in {e["name"] for e in container["env"]}   # HAProxy: no TLS


def test_every_ray_container_runs_serves_haproxy_ingress_by_default(capsys):
    """Ray's high-throughput switches (cluster/ingress.py) in the head's and every worker group's env;
    ``--ingress serve-proxy`` leaves Ray's Python proxy."""
    def ray_envs(flags):
        assert main(["manifest", "--api-key-secret", "keys", *flags]) == 0
        doc = next(yaml.safe_load_all(capsys.readouterr().out))
        cluster = doc["spec"]["rayClusterConfig"]
        groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
        return [{e["name"]: e.get("value") for e in g["template"]["spec"]["containers"][0]["env"]} for g in groups]

    envs = ray_envs([])
    assert len(envs) >= 2 and all(env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and
                                  env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1" for env in envs), envs
    assert not any("RAY_SERVE_ENABLE_HA_PROXY" in env for env in ray_envs(["--ingress", "serve-proxy"]))
    # Serve's control loop every 0.5 s, whatever the ingress (its CPU is taken from the ranks)
    assert all(env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5" for env in envs + ray_envs(["--ingress", "serve-proxy"]))


@pytest.mark.parametrize("bad,message", [
    (["-tp", "16", "--gpus-per-worker", "1", "--worker-pods", "1", "--gpus-per-pod", "8"],
     "layout does not fit: TP=16 x 1 replica(s) need 2 worker pod(s) of 8 GPUs, got 1"),
    (["-tp", "4", "-dp", "3", "--gpus-per-worker", "2", "--worker-pods", "2", "--gpus-per-pod", "8"],
     "need 3 worker pod(s)"),
    (["-tp", "2", "--gpus-per-worker", "0.5"], "NCCL needs whole GPUs per rank"),
    (["-tp", "2", "--gpus-per-worker", "4", "--gpus-per-pod", "2"], "a shard worker needs 4 GPUs but a pod has 2"),
    (["-tp", "4", "--placement-strategy", "STRICT_PACK", "--gpus-per-worker", "1", "--gpus-per-pod", "2"],
     "STRICT_PACK puts a replica's 4 workers on one pod"),
    (["-tp", "2", "--gpus-per-pod", "8"], "would not use the GPUs"),
    (["--name", "Shard_Serve"], "DNS-1035 label"),
    (["--api-key", "sk-secret"], "put them in Secrets and pass --api-key-secret"),
    (["--api-key-file", "/etc/keys"], "put them in Secrets and pass --api-key-secret"),
    (["--admin-api-key-file", "/etc/keys"], "put them in Secrets and pass --api-key-secret"),
    (["--grpc-tls-cert", "/etc/shardserve/tls/tls.crt"], "--grpc-tls-cert needs --grpc-tls-key too"),
    (["--ssl-keyfile", "/etc/shardserve/tls/tls.key"], "--ssl-keyfile needs --ssl-certfile too"),
    (["--port", "0"], "--port must be a TCP port (1-65535)"),
    (["--port", "8265"], "--port 8265: the pods use that port for the Ray dashboard"),
    (["--grpc-port", "6379"], "--grpc-port 6379: the pods use that port for Ray's GCS"),
    (["--port", "9000", "--replica-grpc-port", "9000"], "--replica-grpc-port 9000: the pods use that port for --port"),
    (["--cpus-per-worker", "-1"], "cpus_per_worker must be > 0"),
    (["--cpus-per-worker", "0"], "cpus_per_worker must be > 0"),
    (["--gpus-per-worker", "-1"], "gpus_per_worker must be >= 0"),
    (["--gpus-per-pod", "-1"], "--gpus-per-pod must be >= 0"),
    (["--env", "SHARDSERVE_API_KEY=sk-x"], "--env SHARDSERVE_API_KEY: this variable comes from a Secret"),
    (["--env", "SHARDSERVE_POD_IP=1.2.3.4"], "set by the manifest"),
    (["--address", "10.0.0.1:6379"], "--address applies to a Ray cluster `serve` joins"),
    (["--allow-ray-without-auth"], "the RayService starts its own"),
    (["--ingress", "haproxy", "--tls-secret", "t", "--ssl-certfile", "/etc/shardserve/tls/tls.crt", "--ssl-keyfile",
      "/etc/shardserve/tls/tls.key"], "--ingress haproxy cannot serve HTTPS"),
    (["--grpc-port", "9101"], "--grpc-port 9101: the pods use that port for HAProxy's Prometheus exporter"),
])
def test_a_layout_that_cannot_fit_is_one_line_and_exit_2(bad, message, capsys):
    assert main(["manifest", "--api-key-secret", "keys", *bad]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err, captured.err


def test_the_lock_pins_every_dependency_exactly():
    """requirements.lock (written by `make lock`) pins each package of pyproject.toml and everything
    they pull in to one version; the GPU lock is the same list less what torch's CUDA wheels pin."""
    tomllib = pytest.importorskip("tomllib")
    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert re.fullmatch(r"[a-z0-9-]+", name) and re.fullmatch(r"[0-9][0-9A-Za-z.]*", version), line
            pins[name] = version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    for requirement in wanted:
        name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]).lower()
        assert name in pins, f"{name} is not in requirements.lock: run `make lock`"
    assert {"pip", "setuptools", "torch"} <= set(pins) and pins["torch"] == "2.13.0"
    gpu = [line for line in (REPO / "requirements-gpu.lock").read_text().splitlines() if not line.startswith("#")]
    assert set(gpu) == {f"{n}=={v}" for n, v in pins.items() if n != "triton" and not n.startswith("nvidia-")}


def test_generated_clusters_are_closed_by_default(capsys):
    """Issue 27: a key Secret, Ray's control plane closed (NetworkPolicy, dashboard not on 0.0.0.0,
    no client port), non-root pods with a restricted securityContext and no service-account token
    but in the autoscaler; a LoadBalancer needs a key and HTTPS."""
    for bad, message in ((["-tp", "2"], "pass --api-key-secret NAME[:KEY]"),
                         (["--api-key-secret", "k", "--service-type", "LoadBalancer"], "needs --api-key-secret and HTTPS"),
                         (["--allow-unauthenticated", "--service-type", "LoadBalancer"], "LoadBalancer")):
        assert main(["manifest", *bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    tls = ["--tls-secret", "t", "--ssl-certfile", "/etc/shardserve/tls/tls.crt", "--ssl-keyfile",
           "/etc/shardserve/tls/tls.key"]
    assert main(["manifest", "--api-key-secret", "k", "--service-type", "LoadBalancer", *tls]) == 2
    assert "exposes the gRPC endpoint" in capsys.readouterr().err   # the one gRPC Service goes out too
    tls += ["--grpc-tls-cert", "/etc/shardserve/tls/tls.crt", "--grpc-tls-key", "/etc/shardserve/tls/tls.key"]
    assert main(["manifest", "--api-key-secret", "k", "--service-type", "LoadBalancer", *tls]) == 0
    capsys.readouterr()
    for path in MANIFESTS:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        (service,) = [d for d in docs if d["kind"] == "RayService"]
        (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-ray")]
        cluster = service["spec"]["rayClusterConfig"]
        head = cluster["headGroupSpec"]
        assert head["rayStartParams"]["dashboard-host"] == "$(SHARDSERVE_POD_IP)", path.name   # never 0.0.0.0
        assert "0.0.0.0" not in str(head["rayStartParams"]) and cluster["authOptions"] == {"mode": "token"}
        pods = [head["template"]] + [group["template"] for group in cluster["workerGroupSpecs"]]
        labels = {pod["metadata"]["labels"]["shardserve.io/app"] for pod in pods}
        assert labels == {service["metadata"]["name"]} == {policy["spec"]["podSelector"]["matchLabels"]["shardserve.io/app"]}
        for pod in pods:
            spec = pod["spec"]
            assert spec["automountServiceAccountToken"] is False
            assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 1000
            for container in spec["containers"]:
                context = container["securityContext"]
                assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}
                env = {e["name"]: e for e in container["env"]}
                assert env["SHARDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"], path.name
                assert "value" not in env["SHARDSERVE_API_KEY"]
                assert 10001 not in [p["containerPort"] for p in container.get("ports", [])]   # no Ray client port
        autoscaler = cluster.get("autoscalerOptions")
        if autoscaler:   # its token is mounted into the autoscaler sidecar alone
            (mount,) = autoscaler["volumeMounts"]
            assert mount["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
            assert mount["name"] in {v["name"] for v in head["template"]["spec"]["volumes"]}
        own, operator, serve = policy["spec"]["ingress"]
        assert own == {"from": [{"podSelector": {"matchLabels": {"shardserve.io/app": service["metadata"]["name"]}}}]}
        assert operator["ports"] == [{"protocol": "TCP", "port": 8265}]
        assert serve == {"ports": [{"protocol": "TCP", "port": 8000}]} and "from" not in serve   # Serve port only


def run_lines(dockerfile: Path) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("name,base,extras,index,lock", [
    ("Dockerfile", "python:3.11-slim", "", "https://download.pytorch.org/whl/cpu", "requirements.lock"),
    ("Dockerfile.gpu", "nvidia/cuda:12.8.1-runtime-ubuntu24.04", "gpu", "https://download.pytorch.org/whl/cu128",
     "requirements-gpu.lock"),
])
def test_images_install_the_package_the_way_make_install_does(name, base, extras, index, lock):
    lines = run_lines(REPO / name)
    assert re.fullmatch(rf"FROM {re.escape(base)}@sha256:[0-9a-f]{{64}}", lines[0]), lines[0]   # pinned by digest
    (install,) = [line for line in lines if "make install" in line]
    assert f"EXTRAS={extras}" in install and "VENV=/opt/venv" in install
    assert (f"LOCK={lock}" in install) == (lock != "requirements.lock")
    assert "USER 1000" in lines and lines.index("USER 1000") > lines.index(install)   # installs as root, runs as not
    (arg,) = [line for line in lines if line.startswith("ARG TORCH_INDEX=")]
    torch_index = arg.split("=", 1)[1].strip('"')
    assert index in torch_index
    assert any(line.startswith("ENV PATH=/opt/venv/bin:") for line in lines)   # KubeRay runs `ray start`
    assert re.search(r"apt-get install .*\bwget\b", " ".join(lines))            # KubeRay's probes call wget
    for line in lines:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), f"{name} copies {source}, which does not exist"
    dockerignore = (REPO / ".dockerignore").read_text()
    assert ".venv/" in dockerignore and ".git/" in dockerignore
    # the recipe `make install` runs with the image's variables: same steps, this venv and index
    recipe = subprocess.run(["make", "-n", "-B", "install", "VENV=/opt/venv", f"TORCH_INDEX={torch_index}",
                             f"EXTRAS={extras}", f"LOCK={lock}"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout
    assert f"/opt/venv/bin/python -m pip install -q -c {lock} torch==" in recipe and torch_index in recipe
    package = f"-e '.[{extras}]'" if extras else "-e '.'"
    assert package in recipe and recipe.count(f"-c {lock}") == 3   # every pip install takes the lock
    if extras:
        tomllib = pytest.importorskip("tomllib")
        project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
        assert any(dep.startswith("cupy-cuda12x") for dep in project["optional-dependencies"][extras])


def test_grpc_service_and_autoscaling_keys_reach_the_manifest(validators, capsys):
    """Issue 28: the one gRPC endpoint (on the router's pod) gets a Service and a NetworkPolicy
    opening its port; ``--min/--max-replicas`` and ``--target-ongoing-requests`` reach Serve's
    args, and KubeRay's autoscaler may add pods for ``max_replicas`` replicas."""
    assert main(["manifest", "-tp", "2", "--api-key-secret", "k", "--min-replicas", "1", "--max-replicas", "3",
                 "--target-ongoing-requests", "8", "--grpc-port", "50052"]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    (service,) = [d for d in docs if d["kind"] == "RayService"]
    assert not list(validators[("ray.io/v1", "RayService")].iter_errors(service)) + kuberay_rules(service)
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert (args["min_replicas"], args["max_replicas"], args["target_ongoing_requests"]) == (1, 3, 8.0)
    assert ServeArgs.from_dict(dict(args, allow_unauthenticated=True)).autoscaled
    groups = {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    model = worker_group(service)
    assert model["minReplicas"] == 1 and model["maxReplicas"] >= 3   # one pod per replica, surge included
    assert service["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"]
    router = groups["router"]
    role = router["template"]["metadata"]["labels"]["shardserve.io/role"]
    (grpc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-grpc")]
    assert grpc["spec"]["ports"] == [{"name": "grpc", "port": 50052, "targetPort": 50052, "appProtocol": "grpc"}]
    assert grpc["spec"]["selector"]["shardserve.io/role"] == role == "router"
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-grpc")]
    assert policy["spec"]["ingress"] == [{"ports": [{"port": 50052, "protocol": "TCP"}]}]
