"""Everything GPU-side in one run (``benchmarks/gpu_check.sh``): kernels, device placement, parity,
NCCL, CUDA graphs, memory sizing and decode throughput on one CUDA GPU.

Sections, in the order they run (each prints ``ok``/``FAIL``/``SKIP`` lines; exit 1 on any FAIL):

1. placement: a tiny Llama and a tiny DeepSeek-V3.2 runner on the GPU; after prefill and graphed
   decode steps no parameter, buffer, cache or input tensor is off the GPU.
2. parity: tiny Llama / DeepSeek-V3 / V3.2 / GLM-5 checkpoints (written by transformers) on the GPU
   in float32 (logits within 2e-3 of transformers, greedy tokens equal) and bfloat16 (error within
   1.25x transformers' own bf16 error + 0.02); an FP8 block-scaled V3.2 kept in FP8 (Triton W8A16)
   against its dequantized weights; SmolLM2-135M GGUF in bf16 against transformers bf16 on the GPU
   (the first greedy tokens equal).
3. nccl: a CuPy NCCL communicator bound to the GPU: all-reduce and all-gather values, eager and
   captured in a CUDA graph (two processes when two GPUs are visible).
4. graphs: greedy decode with captured CUDA graphs == eager (``enforce_eager``), and the host time
   of one captured decode step.
5. memory: the KV budget of ``--gpu-memory-utilization`` (weights, profiled activations, other).
6. kernels: every Triton kernel against its torch reference (fp32 small, bf16 serving shapes, timed).
7. throughput: batch 1 / 32 / 256 decode tok/s of SmolLM2 and of a 1.2B Llama-shaped bf16 model
   (random weights), with the fraction of the GPU's HBM bandwidth reached (weights + KV read per step).

``--cpu-dry-run`` runs the same code on the CPU: kernels under the Triton interpreter on small
shapes, CUDA graphs through their eager stand-in, the memory profile's forward without measuring, a
small Llama-shaped model for throughput; NCCL is skipped (no GPU). Numbers printed there mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "models"))
sys.path.insert(0, str(ROOT / "benchmarks"))

# Spec-sheet HBM bandwidth (bytes/s) by device-name substring; the measured copy bandwidth is printed too.
HBM_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "H800": 3.35e12, "A100": 2.039e12, "A800": 2.039e12,
                 "L40S": 0.864e12, "A10G": 0.6e12, "4090": 1.008e12, "B200": 8.0e12}


class Report:
    """Collects ok / FAIL / SKIP lines."""

    def __init__(self) -> None:
        self.failures = 0
        self.start = time.time()

    def line(self, status: str, name: str, detail: str = "") -> None:
        self.failures += status == "FAIL"
        print(f"{status:<4} {name:<48} {detail}", flush=True)

    def check(self, ok: bool, name: str, detail: str = "") -> None:
        self.line("ok" if ok else "FAIL", name, detail)

    def section(self, title: str, fn, *args) -> None:
        print(f"== {title} ({time.time() - self.start:.0f} s)", flush=True)
        try:
            fn(self, *args)
        except Exception as exc:  # noqa: BLE001 - report and run the other sections
            traceback.print_exc()
            self.line("FAIL", title, f"{type(exc).__name__}: {exc}")


def make_runner(path, **config):
    from shardserve.workers.model_runner import ModelRunner, RunnerConfig
    from shardserve.workers.model_source import ModelFiles, load_config, resolve_model

    files = ModelFiles(Path(path).name, Path(path)) if Path(path).is_dir() else resolve_model(str(path))
    return ModelRunner(files, load_config(files), RunnerConfig(**{"block_size": 16, "num_blocks": 64, "max_num_seqs": 8,
                                                                  **config}),
                       progress=False)


def forced_logits(runner, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Float32 CPU logits of every position: the prompt in one step, then one given token per step."""
    from plan_driver import PlanDriver

    driver = PlanDriver(runner)
    rows = [driver.step_all_rows({"a": tokens[:prompt_len]})["a"]]
    rows += [driver.step_all_rows({"a": [t]})["a"] for t in tokens[prompt_len:]]
    return torch.cat(rows).float().cpu()


def relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return ((logits - reference).abs().amax(-1) / reference.abs().amax(-1)).max().item()


# -- sections ----------------------------------------------------------------------------------------

def kernels(report: Report, dry: bool, quick: bool) -> None:
    from kernels_gpu import run_kernel_checks

    failures = run_kernel_checks(interpret=dry, quick=quick)
    report.check(failures == 0, "kernels: every Triton kernel == its reference", f"{failures} failure(s)")


def placement(report: Report, device: str, tiny) -> None:
    from plan_driver import PlanDriver

    for arch in ("llama", "deepseek_v32"):
        runner = make_runner(tiny(arch)[0], device=device, decode_graphs="auto" if device == "cuda" else "replay",
                             max_num_seqs=4)
        driver = PlanDriver(runner)
        first = driver.step({"a": list(range(3, 30)), "b": [5, 6, 7]})
        driver.greedy(first, 3)
        input_ids, meta, rows = runner._prepare_inputs(driver.plan({"a": [7]}))
        inputs = [("input_ids", input_ids), ("rows", rows), ("slot_mapping", meta.slot_mapping),
                  ("block_tables", meta.block_tables), ("seq_lens", meta.seq_lens)]
        wrong = runner.tensors_off_device(*inputs)
        report.check(not wrong and runner.device.type == device and runner.graphs is not None,
                     f"placement: {arch} on {runner.device} ({len(runner.named_tensors())} tensors)",
                     "; ".join(wrong[:3]) or f"graphs: {runner.graphs.backend}")


def parity_tiny(report: Report, device: str, tiny) -> None:
    """Tiny checkpoints: float32 on the device vs transformers float32; bf16 within the reference's bf16 error."""
    archs = ("llama", "deepseek_v3", "deepseek_v32", "glm_moe_dsa") if device == "cuda" else ("llama", "deepseek_v32")
    for arch in archs:
        path, hf = tiny(arch)
        tokens = torch.randint(2, 90, (24,), generator=torch.Generator().manual_seed(3)).tolist()
        with torch.no_grad():
            ref32 = hf.float()(torch.tensor([tokens])).logits[0].float()
            ref16 = copy.deepcopy(hf).to(torch.bfloat16)(torch.tensor([tokens])).logits[0].float()
        ours32 = forced_logits(make_runner(path, device=device, dtype="float32"), tokens, 16)
        diff = (ours32 - ref32).abs().max().item()
        same = ours32.argmax(-1).tolist() == ref32.argmax(-1).tolist()
        report.check(diff < 2e-3 and same, f"parity fp32: {arch} vs transformers",
                     f"max|dlogit| {diff:.2e}, argmax equal {same}")
        ours16 = relative_error(forced_logits(make_runner(path, device=device, dtype="bfloat16"), tokens, 16), ours32)
        bound = 1.25 * relative_error(ref16, ref32) + 0.02
        report.check(ours16 <= bound, f"parity bf16: {arch} within reference bf16 error",
                     f"{ours16:.4f} <= {bound:.4f}")


def parity_fp8(report: Report, device: str, tiny) -> None:
    from tiny_checkpoints import write_fp8_checkpoint

    path, _ = tiny("deepseek_v32")
    fp8 = write_fp8_checkpoint(path, Path(tempfile.mkdtemp()) / "fp8", (32, 32))
    tokens = torch.randint(2, 120, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    reference = forced_logits(make_runner(fp8, device="cpu"), tokens, 12)        # dequantized at load, float32
    if device == "cuda":
        runner = make_runner(fp8, device="cuda", dtype="float32")                  # FP8 kept: Triton W8A16
    else:                                                                           # the same storage, torch reference
        from shardserve.workers.checkpoint import open_checkpoint
        from shardserve.workers.weight_loader import build_model

        runner = make_runner(fp8, device="cpu")
        runner.model, _ = build_model(runner.hf_config, open_checkpoint(fp8), keep_fp8=True, progress=False)
        runner.allocate_kv_cache(runner.num_blocks)
    kept = sum(p.dtype == torch.float8_e4m3fn for p in runner.model.parameters())
    diff = (forced_logits(runner, tokens, 12) - reference).abs().max().item()
    report.check(kept > 0 and diff < 2e-3, "parity fp8: V3.2 FP8 kept == dequantized",
                 f"{kept} fp8 tensors, max|dlogit| {diff:.2e}")


def smollm2_files():
    from shardserve.workers.model_source import KNOWN_MODELS, cache_dir, resolve_model

    name = "smollm2-135m-instruct"
    if not (cache_dir() / name / Path(KNOWN_MODELS[name][1]).name).is_file():
        return None
    return resolve_model(name)


def parity_smollm2(report: Report, device: str, steps: int) -> None:
    files = smollm2_files()
    if files is None:
        report.line("SKIP", "parity smollm2", "model not in the cache (see benchmarks/gpu_prepare.sh)")
        return
    from transformers import AutoModelForCausalLM

    from shardserve.cluster.config import EngineArgs
    from shardserve.cluster.llm import LLM
    from shardserve.cluster.engine.request import SamplingParams

    dtype = "bfloat16" if device == "cuda" else "float32"
    llm = LLM(EngineArgs(model=str(files.path), device=device, dtype=dtype, kv_cache_gib=0.25, max_model_len=512,
                         gpu_memory_utilization=0.15), progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(files.folder), gguf_file=files.path.name,
                                              dtype=getattr(torch, dtype)).to(device).eval()
    prompts = [[{"role": "user", "content": "What is the capital of France?"}], "Once upon a time, in a small village,",
               "def fibonacci(n):\n    "]
    ids = [llm.encode(p) for p in prompts]
    ours = llm.generate(ids, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    for i, (prompt, done) in enumerate(zip(ids, ours)):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=steps, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        same = next((k for k, (a, b) in enumerate(zip(done.token_ids, ref)) if a != b), steps)
        need = min(4, steps)
        report.check(same >= need, f"parity {dtype} smollm2 prompt {i} vs transformers",
                     f"first {same}/{steps} tokens equal")
    del hf, llm
    if device == "cuda":
        torch.cuda.empty_cache()


def nccl(report: Report, device: str) -> None:
    if device != "cuda":
        report.line("SKIP", "nccl", "no CUDA device (dry run)")
        return
    from shardserve.workers.comm_nccl import CupyNcclGroup, nccl_unique_id

    group = CupyNcclGroup(0, 1, nccl_unique_id())
    x = torch.randn(1024, 576, device="cuda", dtype=torch.bfloat16)
    ok = torch.equal(group.all_reduce(x.clone()), x) and torch.equal(group._all_gather_equal(x)[0], x)
    static = torch.zeros(64, 128, device="cuda")
    out = [None]
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        group.all_reduce(static.clone() * 2)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out[0] = group.all_reduce(static * 2)
    static.copy_(torch.arange(64 * 128, device="cuda", dtype=torch.float32).view(64, 128))
    graph.replay()
    torch.cuda.synchronize()
    ok = ok and torch.equal(out[0], static * 2)
    group.close()
    report.check(ok, "nccl: 1-rank communicator, eager + in a CUDA graph",
                 f"cupy NCCL on {torch.cuda.get_device_name()}")
    if torch.cuda.device_count() < 2:
        report.line("SKIP", "nccl: 2 ranks", "one GPU visible (NCCL allows one rank per GPU)")
        return
    import torch.multiprocessing as mp

    uid = nccl_unique_id()
    mp.spawn(_nccl_rank, args=(uid,), nprocs=2, join=True)
    report.check(True, "nccl: 2-rank all-reduce / all-gather (+ graph)", "values checked in each rank")


def _nccl_rank(rank: int, uid) -> None:
    from shardserve.workers.comm_nccl import CupyNcclGroup

    torch.cuda.set_device(rank)
    group = CupyNcclGroup(rank, 2, uid)
    x = torch.full((4096,), float(rank + 1), device="cuda")
    assert torch.equal(group.all_reduce(x.clone()), torch.full_like(x, 3.0))
    gathered = group.all_gather(torch.full((8, 3 - rank), float(rank), device="cuda"), [3, 2])
    assert gathered.shape == (8, 5) and gathered[:, :3].eq(0).all() and gathered[:, 3:].eq(1).all()
    static, graph = torch.ones(1024, device="cuda") * (rank + 1), torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        group.all_reduce(static.clone())
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = group.all_reduce(static.clone())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 3.0))
    group.close()


def decode_tokens(runner, batch: int, prompt_len: int, steps: int, seed: int = 0) -> tuple[dict, float]:
    """Greedy decode of ``batch`` random prompts; ``(tokens per request, seconds of the decode steps)``."""
    from plan_driver import PlanDriver

    driver = PlanDriver(runner, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.hf_config.vocab_size
    chunk = max(1, runner.config.max_num_batched_tokens // prompt_len)
    first = {}
    names = [f"r{i}" for i in range(batch)]
    for start in range(0, batch, chunk):
        work = {n: torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for n in names[start:start + chunk]}
        first.update(driver.step(work))
    _sync(runner.device)
    begin = time.perf_counter()
    tokens, _ = driver.greedy(first, steps)
    _sync(runner.device)
    return tokens, time.perf_counter() - begin


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graphs(report: Report, device: str, tiny) -> None:
    from shardserve.workers.step_inputs import build_host_batch

    steps = 24 if device == "cuda" else 4
    models = [("llama", tiny("llama")[0]), ("deepseek_v32", tiny("deepseek_v32")[0])]
    files = smollm2_files()
    if files is not None and device == "cuda":
        models.append(("smollm2", files.path))
    graphed = "auto" if device == "cuda" else "replay"
    for name, path in models:
        eager = make_runner(path, device=device, enforce_eager=True, decode_graphs="off", max_num_seqs=8,
                            num_blocks=128)
        cap = make_runner(path, device=device, decode_graphs=graphed, max_num_seqs=8, num_blocks=128)
        a, _ = decode_tokens(eager, 5, 12, steps)
        b, _ = decode_tokens(cap, 5, 12, steps)
        report.check(a == b and cap.graphs is not None, f"graphs: {name} decode, graphs == eager",
                     f"{cap.graphs.backend if cap.graphs else 'none'}, sizes {cap.graphs.sizes if cap.graphs else []}")
    # Host time of one captured decode step (batch 1), the GPU idle before each call.
    runner = cap
    from plan_driver import PlanDriver

    driver = PlanDriver(runner)
    driver.step({"h": [5, 6, 7, 8]})
    plan = driver.plan({"h": [9]})
    runner._apply_plan(plan)
    host = build_host_batch(plan, {"h": runner.requests["h"].block_ids}, runner.block_size)
    samples = []
    for _ in range(50 if device == "cuda" else 3):
        _sync(runner.device)
        begin = time.perf_counter()
        runner.graphs.run(host, runner.stager)
        samples.append(time.perf_counter() - begin)
    _sync(runner.device)
    micros = sorted(samples)[len(samples) // 2] * 1e6
    report.line("info", "graphs: host time of a captured decode step",
                f"{micros:.0f} us median (upload + table copy + replay launch; target <= 50 us on CUDA)")


def memory(report: Report, device: str, tiny) -> None:
    files = smollm2_files()
    path = files.path if (files is not None and device == "cuda") else tiny("llama")[0]
    runner = make_runner(path, device=device, num_blocks=None, max_num_batched_tokens=2048,
                         max_model_len=4096 if device == "cuda" else 128, gpu_memory_utilization=0.5,
                         kv_cache_bytes=1 << 26)
    if device == "cuda":
        plan = runner.plan
        blocks = runner.max_num_blocks()
        ok = 0 < plan.kv_budget_bytes and blocks * runner.bytes_per_block <= plan.kv_budget_bytes
        report.check(ok, f"memory: {Path(path).name} at --gpu-memory-utilization 0.5",
                     plan.summary() + f"; {blocks} blocks")
    else:
        runner.profile_memory()   # the profiling forward runs; nothing is measured on CPU
        report.check(runner.max_num_blocks() == (1 << 26) // runner.bytes_per_block,
                     "memory: profiling forward ran (CPU: --kv-cache-gib budget)", f"{runner.max_num_blocks()} blocks")


def long_context(report: Report, device: str) -> None:
    """Issue 25 on the GPU: a DeepSeek-V3.2-shaped attention layer (TP=8 slice, bf16, Triton) prefills
    a 2,048-token chunk at the end of 32K and 128K contexts, DSA and dense: seconds, peak bytes above
    the caches (flat in the context), and a decode step (benchmarks/bench_long_context.py)."""
    if device != "cuda":
        report.line("SKIP", "long context", "CPU dry run: a V3.2-shaped layer is too slow interpreted")
        return
    from bench_long_context import Meter, attach_caches, build_layer, layer_step, metadata

    meter, cuda, dtype, contexts = Meter(torch.device("cuda")), torch.device("cuda"), torch.bfloat16, (32768, 131072)
    for dsa in (True, False):
        layer = build_layer(dsa, contexts[-1] + 8, dtype, cuda)
        tables = attach_caches(layer, contexts[-1], 1, dtype, cuda)
        top_k, name, peaks = (2048 if dsa else None), ("DSA" if dsa else "dense MLA"), []
        for context in contexts:
            prefill, decode = metadata(tables, [context], [2048], cuda), metadata(tables, [context], [1], cuda)
            layer_step(layer, prefill, top_k, dtype, cuda)                     # compile
            seconds, peak = meter(lambda: layer_step(layer, prefill, top_k, dtype, cuda))
            layer_step(layer, decode, top_k, dtype, cuda)
            decode_s = min(meter(lambda: layer_step(layer, decode, top_k, dtype, cuda))[0] for _ in range(3))
            peaks.append(peak)
            report.line("info", f"long context: {name} at {context // 1024}K",
                        f"prefill 2048 tokens {seconds * 1e3:.1f} ms, peak {peak / 2**20:.0f} MiB; "
                        f"decode {decode_s * 1e3:.2f} ms")
        report.check(peaks[1] <= 1.05 * peaks[0] + (64 << 20), f"long context: {name} prefill memory flat",
                     f"{peaks[0] / 2**20:.0f} MiB at 32K, {peaks[1] / 2**20:.0f} MiB at 128K")
        del layer, tables
        torch.cuda.empty_cache()


def copy_bandwidth(device: torch.device) -> float:
    """Measured device-to-device copy bandwidth, bytes read + written per second."""
    src = torch.empty(1 << 29, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    begin = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    _sync(device)
    return 2 * src.numel() * 10 / (time.perf_counter() - begin)


def write_llama(path: Path, device: str, **shape) -> Path:
    """A Llama-shaped bf16 checkpoint with random weights (no tokenizer needed by the runner)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(**shape, tie_word_embeddings=True)
    config.save_pretrained(str(path))
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = hidden // heads
    gen = torch.Generator(device=device).manual_seed(0)
    rand = lambda *s: (torch.randn(*s, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()  # noqa: E731
    tensors = {"model.embed_tokens.weight": rand(shape["vocab_size"], hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
                        p + "self_attn.k_proj.weight": rand(kv * head_dim, hidden),
                        p + "self_attn.v_proj.weight": rand(kv * head_dim, hidden),
                        p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                        p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
                        p + "mlp.down_proj.weight": rand(hidden, inter),
                        p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                        p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def throughput(report: Report, device: str) -> None:
    dry = device != "cuda"
    models = []
    files = smollm2_files()
    if files is not None and not dry:
        models.append(("smollm2-135m bf16", files.path))
    shape = (dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512) if dry else
             dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096))
    llama = write_llama(Path(tempfile.mkdtemp()), device, **shape)
    models.append((f"llama-shaped {'tiny' if dry else '1.2B'} bf16", llama))
    batches = (1, 4, 8) if dry else (1, 32, 256)
    peak_name = torch.cuda.get_device_name() if not dry else "cpu"
    spec = next((bw for key, bw in HBM_BANDWIDTH.items() if key in peak_name), None)
    measured = copy_bandwidth(torch.device(device)) if not dry else None
    if measured:
        report.line("info", f"HBM: {peak_name}", f"copy {measured / 1e12:.2f} TB/s measured, spec "
                    f"{spec / 1e12:.2f} TB/s" if spec else f"copy {measured / 1e12:.2f} TB/s measured, spec unknown")
    prompt_len, steps = (16, 8) if dry else (128, 64)
    max_len = prompt_len + steps + 16
    for name, path in models:
        runner = make_runner(path, device=device, dtype="bfloat16", max_num_seqs=max(batches), max_model_len=max_len,
                             num_blocks=max(batches) * -(-max_len // 16) + 8, max_num_batched_tokens=8192,
                             decode_graphs="auto" if not dry else "replay")
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        per_token_kv = runner.bytes_per_block / runner.block_size
        for batch in batches:
            _, seconds = decode_tokens(runner, batch, prompt_len, steps, seed=batch)
            step = seconds / steps
            kv_read = batch * (prompt_len + steps / 2) * per_token_kv
            bandwidth = (weight_bytes + kv_read) / step
            frac = f", {100 * bandwidth / spec:.0f}% of spec HBM" if (spec and not dry) else ""
            report.line("info", f"decode {name} batch {batch}",
                        f"{batch / step:9.1f} tok/s, {step * 1e3:7.2f} ms/step, {bandwidth / 1e9:8.1f} GB/s{frac}")
        del runner
        if not dry:
            torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="run the same checks on the CPU (see the docstring)")
    parser.add_argument("--quick", action="store_true",
                        help="skip the timed bf16 kernel cases and the throughput table")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip (e.g. smollm2,throughput)")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    dry = args.cpu_dry_run
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"          # before triton is imported (kernel section)
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; run it on a GPU machine, or pass --cpu-dry-run")
        return 2
    device = "cpu" if dry else "cuda"
    if not dry:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    print(f"gpu_check: {'CPU dry run' if dry else torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    from tiny_checkpoints import write_tiny_checkpoint, write_tiny_llama

    root, cache = Path(tempfile.mkdtemp(prefix="gpu_check_")), {}

    def tiny(arch: str):
        if arch not in cache:
            path = root / arch
            hf = write_tiny_llama(path) if arch == "llama" else write_tiny_checkpoint(arch, path, seed=0)
            cache[arch] = path, hf
        return cache[arch]

    report = Report()
    # The new checks first, the long kernel timings and the throughput table last (a run cut by the
    # time limit still reports the rest).
    sections = [("placement", placement, device, tiny), ("parity", parity_tiny, device, tiny),
                ("fp8", parity_fp8, device, tiny), ("nccl", nccl, device), ("graphs", graphs, device, tiny),
                ("memory", memory, device, tiny), ("long_context", long_context, device),
                ("smollm2", parity_smollm2, device, 2 if dry else 16),
                ("kernels", kernels, dry, args.quick), ("throughput", throughput, device)]
    for name, fn, *fn_args in sections:
        if name in skip or (name == "throughput" and args.quick):
            report.line("SKIP", name, "--skip" if name in skip else "--quick")
            continue
        report.section(name, fn, *fn_args)
    print(f"gpu_check: {report.failures} failure(s) in {time.time() - report.start:.0f} s", flush=True)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
