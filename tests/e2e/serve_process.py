"""A real ``shardserve serve`` in a process group of its own (its own local Ray cluster), for the
recovery and reload tests: start, wait until every replica is ready, read ModelInfo, stop."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc

from procs import BIN, free_port, stop_process_group, subprocess_env
from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc


def http(url: str, body: dict | None = None, timeout: float = 120, key: str | None = None) -> tuple[int, dict]:
    """``(status, JSON body)`` of a GET (no body) or a JSON POST (``key``: sent as the bearer key)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file (CI shows a failed test's message, not the files
    the test wrote)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"


def wait_for(what: str, check, timeout_s: float, period_s: float = 0.1):
    """Poll ``check()`` until it returns something truthy; returns it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            result = check()
        except (OSError, ValueError, grpc.RpcError):
            result = None
        if result:
            return result
        time.sleep(period_s)
    raise TimeoutError(f"{what}: not within {timeout_s} s")


class ServeProcess:
    """``shardserve serve MODEL *flags`` on free loopback ports until :meth:`stop`.

    Attributes:
        base: ``http://127.0.0.1:PORT``. grpc_address: replica 0's own gRPC ``host:port``
            (``--replica-grpc-port``: per-replica ModelInfo, workers, counters). grpc_endpoint: the
            app's one gRPC endpoint (``--grpc-port``, the router's).
        metadata: gRPC metadata of ModelInfo calls (``admin_key``: with it, the prefix-cache counter).
    """

    def __init__(self, model: str, flags: list[str], log_path: Path, ready_timeout_s: float = 400,
                 admin_key: str | None = None) -> None:
        self.metadata = (("authorization", f"Bearer {admin_key}"),) if admin_key else ()
        http_port, grpc_port, replica_port = free_port(), free_port(), free_port()
        self.base, self.grpc_address = f"http://127.0.0.1:{http_port}", f"127.0.0.1:{replica_port}"
        self.grpc_endpoint = f"127.0.0.1:{grpc_port}"
        self.log_path = log_path   # the server's stderr
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [str(BIN / "shardserve"), "serve", model, "--port", str(http_port), "--grpc-port", str(grpc_port),
             "--replica-grpc-port", str(replica_port), *flags],
            env=subprocess_env(), stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True)
        self._lines: list[str] = []
        threading.Thread(target=lambda: self._lines.extend(iter(self.proc.stdout.readline, "")), daemon=True).start()
        try:
            wait_for("shardserve serve ready", self._ready, ready_timeout_s, period_s=0.5)
        except TimeoutError as exc:
            self.stop()
            raise TimeoutError(f"{exc}; the last lines of {log_path}:\n{log_tail(log_path)}") from None
        except BaseException:
            self.stop()
            raise
        self.channel = grpc.insecure_channel(self.grpc_address)
        self.stub = pb_grpc.InferenceStub(self.channel)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            self._log.flush()
            raise AssertionError(f"shardserve serve exited with {self.proc.returncode}; the last lines of "
                                 f"{self._log.name}:\n{log_tail(self.log_path)}")
        return any("Press Ctrl-C to stop." in line for line in self._lines)

    def health(self) -> int:
        return http(self.base + "/health", timeout=10)[0]

    def model_info(self) -> pb.ModelInfoResponse:
        return self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=10, metadata=self.metadata)

    def workers(self) -> dict[tuple[str, int], pb.WorkerProcess]:
        """``(role, rank) -> WorkerProcess`` as the replica last saw its workers."""
        return {(w.role, w.rank): w for w in self.model_info().workers}

    def replaced(self, role: str, rank: int, old_pid: int) -> dict | None:
        """:meth:`workers` once the worker ``(role, rank)`` has reported from a process other than
        ``old_pid`` (the replica refreshes its view every few idle seconds), else None."""
        workers = self.workers()
        worker = workers.get((role, rank))
        return workers if worker is not None and worker.pid != old_pid else None

    def metrics(self) -> str:
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as resp:
            return resp.read().decode()

    def stop(self) -> None:
        """Ctrl-C, then SIGKILL whatever is left of the process group."""
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        stop_process_group(self.proc, signal.SIGINT, 60)   # never `ray stop`: other Rays run on this machine
        if not self._log.closed:
            self._log.close()
