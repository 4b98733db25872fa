"""gpu_check sections on whole models: placement, parity, graphs (greedy and seeded sampling),
speculative decoding and the KV budget (see ``benchmarks/gpu_check.py``)."""

from __future__ import annotations

import copy
import os
import tempfile
import time
from pathlib import Path

import torch

from gpu_check_core import Context, Report, section

FAMILIES = ("llama", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_next")


def make_runner(path, **config):
    from shardserve.workers.model_runner import ModelRunner, RunnerConfig
    from shardserve.workers.model_source import ModelFiles, load_config, resolve_model

    files = ModelFiles(Path(path).name, Path(path)) if Path(path).is_dir() else resolve_model(str(path))
    return ModelRunner(files, load_config(files), RunnerConfig(**{"block_size": 16, "num_blocks": 64, "max_num_seqs": 8,
                                                                  **config}), progress=False)


def make_llm(path, ctx: Context, graphs: bool, **args):
    """The single-process engine on the run's device, decode graphs on (captured, or the replay
    stand-in on CPU) or off."""
    from shardserve.cluster.config import EngineArgs
    from shardserve.cluster.llm import LLM

    class Args(EngineArgs):
        def runner_config(self):
            config = super().runner_config()
            config.decode_graphs = ctx.graphs if graphs else "off"
            return config

    defaults = dict(model=str(path), device=ctx.device, dtype="float32", num_blocks=128, max_num_seqs=8,
                    gpu_memory_utilization=0.3, enable_prefix_caching=False)
    return LLM(Args(**{**defaults, **args}), progress=False)


def forced_logits(runner, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Float32 CPU logits of every position: the prompt in one step, then one given token per step."""
    from plan_driver import PlanDriver

    driver = PlanDriver(runner)
    rows = [driver.step_all_rows({"a": tokens[:prompt_len]})["a"]]
    rows += [driver.step_all_rows({"a": [t]})["a"] for t in tokens[prompt_len:]]
    return torch.cat(rows).float().cpu()


def relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return ((logits - reference).abs().amax(-1) / reference.abs().amax(-1)).max().item()


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
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    begin = time.perf_counter()
    tokens, _ = driver.greedy(first, steps)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return tokens, time.perf_counter() - begin


@section("placement", "placement: every tensor on the device")
def placement(ctx: Context, report: Report) -> None:
    from plan_driver import PlanDriver

    for arch in ("llama", "deepseek_v32", "qwen3_next"):
        with report.attempt(f"placement: {arch}"):
            runner = make_runner(ctx.tiny(arch)[0], device=ctx.device, decode_graphs=ctx.graphs, max_num_seqs=4)
            driver = PlanDriver(runner)
            first = driver.step({"a": list(range(3, 30)), "b": [5, 6, 7]})
            driver.greedy(first, 1 if ctx.dry else 3)
            with torch.inference_mode():   # as the runner's own step: its buffers are inference tensors
                input_ids, meta, rows = runner._prepare_inputs(driver.plan({"a": [7]}))
            inputs = [("input_ids", input_ids), ("rows", rows), ("slot_mapping", meta.slot_mapping),
                      ("block_tables", meta.block_tables), ("seq_lens", meta.seq_lens)]
            wrong = runner.tensors_off_device(*inputs)
            report.check(not wrong and runner.device.type == ctx.device and runner.graphs is not None,
                         f"placement: {arch}", "; ".join(wrong[:3]) or
                         f"{len(runner.named_tensors())} tensors on {runner.device}, graphs {runner.graphs.backend}")


@section("parity", "parity: tiny checkpoints and SmolLM2 vs transformers")
def parity(ctx: Context, report: Report) -> None:
    archs = FAMILIES if not ctx.dry else ("llama", "deepseek_v32")
    for arch in archs:
        with report.attempt(f"parity: {arch}"):
            _parity_tiny(ctx, report, arch)
    with report.attempt("parity fp8: V3.2 FP8 kept == dequantized"):
        _parity_fp8(ctx, report)
    files = ctx.smollm2()
    if files is None or "smollm2" in ctx.skip:
        report.not_run("parity: smollm2", "--skip" if "smollm2" in ctx.skip else
                       "model not in the cache (benchmarks/gpu_prepare.sh carries it)")
        return
    with report.attempt("parity: smollm2"):
        _parity_smollm2(ctx, report, files, steps=2 if ctx.dry else 16)


def _parity_tiny(ctx: Context, report: Report, arch: str) -> None:
    """Float32 on the device vs transformers float32 (logits and greedy tokens); bf16 within the
    reference's own bf16 error."""
    path, hf = ctx.tiny(arch)
    tokens = torch.randint(2, 90, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref32 = hf.float()(torch.tensor([tokens])).logits[0].float()
        ref16 = copy.deepcopy(hf).to(torch.bfloat16)(torch.tensor([tokens])).logits[0].float()
    ours32 = forced_logits(make_runner(path, device=ctx.device, dtype="float32"), tokens, 16)
    diff = (ours32 - ref32).abs().max().item()
    same = ours32.argmax(-1).tolist() == ref32.argmax(-1).tolist()
    report.check(diff < 2e-3 and same, f"parity fp32: {arch}", f"max|dlogit| {diff:.2e}, argmax equal {same}")
    ours16 = relative_error(forced_logits(make_runner(path, device=ctx.device, dtype="bfloat16"), tokens, 16), ours32)
    bound = 1.25 * relative_error(ref16, ref32) + 0.02
    report.check(ours16 <= bound, f"parity bf16: {arch}", f"{ours16:.4f} <= {bound:.4f}")
    if ours16 > bound and not ctx.dry:
        _bisect_bf16(ctx, report, arch, path, tokens, ours32)


# The modules whose ops dispatch by ``use_triton`` (their module-level name is patched to force the
# torch reference for that module's ops alone); ``workers.layers.rotary`` reads the package's.
KERNEL_MODULES = ("norm", "rotary", "activation", "paged_attention", "fused_moe", "gated_delta", "causal_conv1d",
                  "mla_attention", "mla_prefill", "indexer", "hadamard", "fp8_linear")


def _bisect_bf16(ctx: Context, report: Report, arch: str, path, tokens: list[int], ours32: torch.Tensor) -> None:
    """Where a failed bf16 parity comes from, one info row per variant: the per-position error
    (prompt rows first, then decode rows), decode graphs off, all torch references on the GPU, and
    each kernel module's ops alone switched to their torch reference."""
    import importlib

    import shardserve.kernels as package

    def error(**config) -> torch.Tensor:
        logits = forced_logits(make_runner(path, device=ctx.device, dtype="bfloat16", **config), tokens, 16)
        return (logits - ours32).abs().amax(-1) / ours32.abs().amax(-1)

    per_position = error()
    report.info(f"parity bf16 bisect: {arch} per position", " ".join(f"{e:.3f}" for e in per_position.tolist()))
    report.info(f"parity bf16 bisect: {arch} decode graphs off", f"{error(decode_graphs='off').max().item():.4f}")
    before = os.environ.get("SHARDSERVE_KERNELS")
    os.environ["SHARDSERVE_KERNELS"] = "torch"
    try:
        report.info(f"parity bf16 bisect: {arch} all torch references", f"{error().max().item():.4f}")
    finally:
        os.environ.pop("SHARDSERVE_KERNELS")
        if before is not None:
            os.environ["SHARDSERVE_KERNELS"] = before
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"shardserve.kernels.{name}")
        patched = [(module, module.use_triton)] + ([(package, package.use_triton)] if name == "rotary" else [])
        try:
            for target, _ in patched:
                target.use_triton = lambda tensor: False
            report.info(f"parity bf16 bisect: {arch} torch {name} only", f"{error().max().item():.4f}")
        finally:
            for target, original in patched:
                target.use_triton = original


def _parity_fp8(ctx: Context, report: Report) -> None:
    from tiny_checkpoints import write_fp8_checkpoint

    path, _ = ctx.tiny("deepseek_v32")
    fp8 = write_fp8_checkpoint(path, Path(tempfile.mkdtemp()) / "fp8", (32, 32))
    tokens = torch.randint(2, 120, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    reference = forced_logits(make_runner(fp8, device="cpu"), tokens, 12)        # dequantized at load, float32
    if ctx.device == "cuda":
        runner = make_runner(fp8, device="cuda", dtype="float32")                 # FP8 kept: Triton W8A16
    else:                                                                          # the same storage, torch reference
        from shardserve.workers.checkpoint import open_checkpoint
        from shardserve.workers.weight_loader import build_model

        runner = make_runner(fp8, device="cpu")
        runner.model, _ = build_model(runner.hf_config, open_checkpoint(fp8), keep_fp8=True, progress=False)
        runner.allocate_kv_cache(runner.num_blocks)
    kept = sum(p.dtype == torch.float8_e4m3fn for p in runner.model.parameters())
    diff = (forced_logits(runner, tokens, 12) - reference).abs().max().item()
    report.check(kept > 0 and diff < 2e-3, "parity fp8: V3.2 FP8 kept == dequantized",
                 f"{kept} fp8 tensors, max|dlogit| {diff:.2e}")


def _parity_smollm2(ctx: Context, report: Report, files, steps: int) -> None:
    from transformers import AutoModelForCausalLM

    from shardserve.cluster.config import EngineArgs
    from shardserve.cluster.engine.request import SamplingParams
    from shardserve.cluster.llm import LLM

    device = ctx.device
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
        report.check(same >= min(4, steps), f"parity {dtype}: smollm2 prompt {i}", f"first {same}/{steps} tokens equal")


@section("graphs", "graphs: captured decode == eager")
def graphs(ctx: Context, report: Report) -> None:
    """Every family on a GPU; the dry run exercises the code on two (tests/workers/test_device_path.py
    checks every family's replay stand-in)."""
    steps, batch = (24, 5) if ctx.device == "cuda" else (2, 3)
    families = FAMILIES if ctx.device == "cuda" else ("llama", "qwen3_next")
    models = [(arch, lambda arch=arch: ctx.tiny(arch)[0]) for arch in families]
    if ctx.smollm2() is not None and ctx.device == "cuda" and "smollm2" not in ctx.skip:
        models.append(("smollm2", lambda: ctx.smollm2().path))
    for name, path in models:
        with report.attempt(f"graphs: {name} greedy"):
            eager = make_runner(path(), device=ctx.device, enforce_eager=True, decode_graphs="off", num_blocks=128)
            cap = make_runner(path(), device=ctx.device, decode_graphs=ctx.graphs, num_blocks=128)
            a, _ = decode_tokens(eager, batch, 12, steps)
            b, _ = decode_tokens(cap, batch, 12, steps)
            report.check(a == b and cap.graphs is not None, f"graphs: {name} greedy",
                         f"{cap.graphs.backend if cap.graphs else 'no graphs'}, sizes "
                         f"{cap.graphs.sizes if cap.graphs else []}, {steps} steps x {batch} sequences")
    with report.attempt("graphs: seeded sampling"):
        _sampled(ctx, report)
    with report.attempt("graphs: host time of a captured step"):
        _host_time(ctx, report, make_runner(ctx.tiny("llama")[0], device=ctx.device, decode_graphs=ctx.graphs))


def _sampled(ctx: Context, report: Report) -> None:
    """Seeded sampled decoding (temperature, top-k / top-p / min-p, logprobs) from the graphs ==
    eager, through the engine."""
    from shardserve.cluster.engine.request import SamplingParams

    length = 4 if ctx.dry else 12
    for arch in ("llama", "qwen3_next") if not ctx.dry else ("qwen3_next",):
        path = ctx.tiny(arch, tokenizer=True)[0]
        params = [SamplingParams(max_tokens=length, temperature=0.8, seed=7, ignore_eos=True),
                  SamplingParams(max_tokens=length - 1, temperature=1.0, top_k=20, top_p=0.9, seed=3, ignore_eos=True,
                                 logprobs=2),
                  SamplingParams(max_tokens=length, temperature=0.6, min_p=0.05, seed=11, ignore_eos=True)]
        prompts = [[0, 5, 9, 17, 33, 2], [0, 40, 41], [0, 7, 7, 8, 9, 10, 11, 12, 13]]
        runs = []
        for graphs_on in (False, True):
            llm = make_llm(path, ctx, graphs_on)
            runs.append([(d.token_ids, [lp.logprob for lp in d.logprobs]) for d in llm.generate(prompts, params)])
            graphed = llm.runner.graphs is not None
        tokens_equal = [a[0] for a in runs[0]] == [b[0] for b in runs[1]]
        lp_diff = max((abs(x - y) for a, b in zip(runs[0], runs[1]) for x, y in zip(a[1], b[1])), default=0.0)
        report.check(tokens_equal and lp_diff < 1e-3 and graphed, f"graphs: {arch} seeded sampling",
                     f"tokens equal {tokens_equal}, max|dlogprob| {lp_diff:.1e}")


def _host_time(ctx: Context, report: Report, runner) -> None:
    """Host time of one captured decode step (batch 1), the device idle before each call."""
    from plan_driver import PlanDriver

    from shardserve.workers.step_inputs import build_host_batch

    driver = PlanDriver(runner)
    driver.step({"h": [5, 6, 7, 8]})
    plan = driver.plan({"h": [9]})
    runner._apply_plan(plan)
    host = build_host_batch(plan, {"h": runner.requests["h"].block_ids}, runner.block_size)
    samples = []
    for _ in range(50 if ctx.device == "cuda" else 3):
        ctx.sync()
        begin = time.perf_counter()
        with torch.inference_mode():   # as the runner's own step: the graphs' buffers are inference tensors
            runner.graphs.run(host, runner.stager)
        samples.append(time.perf_counter() - begin)
    ctx.sync()
    micros = sorted(samples)[len(samples) // 2] * 1e6
    report.info("graphs: host time of a captured decode step",
                f"{micros:.0f} us median (upload + table copy + replay launch; target <= 50 us on CUDA)")


@section("speculative", "speculative: MTP greedy == no speculation")
def speculative(ctx: Context, report: Report) -> None:
    from shardserve.cluster.engine.request import SamplingParams

    with report.attempt("speculative: deepseek_v32 MTP k=2 greedy"):
        path = ctx.tiny("deepseek_v32", mtp=True, tokenizer=True)[0]
        prompts = [[0, 5, 9, 17, 33, 2, 8], [0, 40, 41], [0, 7, 7, 8, 9, 10, 11, 12, 13, 14]]
        params = SamplingParams(max_tokens=6 if ctx.dry else 16, temperature=0, ignore_eos=True)
        plain = [d.token_ids for d in make_llm(path, ctx, True).generate(prompts, params)]
        spec_llm = make_llm(path, ctx, True, speculative_tokens=2)
        spec = [d.token_ids for d in spec_llm.generate(prompts, params)]
        stats = spec_llm.core.speculator.stats
        report.check(plain == spec and stats.num_drafts > 0, "speculative: deepseek_v32 MTP k=2 greedy",
                     f"tokens equal {plain == spec}, mean acceptance length {stats.mean_acceptance_length:.2f}")


@section("memory", "memory: the KV budget of --gpu-memory-utilization")
def memory(ctx: Context, report: Report) -> None:
    with report.attempt("memory: KV budget"):
        files = ctx.smollm2()
        path = files.path if (files is not None and ctx.device == "cuda") else ctx.tiny("llama")[0]
        runner = make_runner(path, device=ctx.device, num_blocks=None, max_num_batched_tokens=2048,
                             max_model_len=4096 if ctx.device == "cuda" else 128, gpu_memory_utilization=0.5,
                             kv_cache_bytes=1 << 26)
        if ctx.device == "cuda":
            plan = runner.plan
            blocks = runner.max_num_blocks()
            report.check(0 < plan.kv_budget_bytes and blocks * runner.bytes_per_block <= plan.kv_budget_bytes,
                         f"memory: KV budget of {Path(path).name} at 0.5", plan.summary() + f"; {blocks} blocks")
        else:
            runner.profile_memory()   # the profiling forward runs; nothing is measured on CPU
            report.check(runner.max_num_blocks() == (1 << 26) // runner.bytes_per_block,
                         "memory: KV budget (CPU: --kv-cache-gib)", f"{runner.max_num_blocks()} blocks")
