"""gpu_check section: decode throughput of SmolLM2 and a 1.2B Llama-shaped model at batch 1 / 32 /
256, with the fraction of the GPU's HBM bandwidth reached (weights + KV read per step; see
``benchmarks/gpu_check.py``)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from gpu_check_core import Context, Report, section
from gpu_check_models import decode_tokens, make_runner


def ctx_sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Measured device-to-device copy bandwidth, bytes read + written per second."""
    src = torch.empty(1 << 29, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ctx_sync(device)
    begin = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    ctx_sync(device)
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


@section("throughput", "throughput: decode tok/s and HBM fraction")
def throughput(ctx: Context, report: Report) -> None:
    device, dry = ctx.device, ctx.dry
    models = []
    files = ctx.smollm2()
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
    spec = ctx.hbm_bandwidth()
    measured = copy_bandwidth(torch.device(device)) if not dry else None
    if measured:
        report.info(f"HBM: {peak_name}", f"copy {measured / 1e12:.2f} TB/s measured, spec "
                    f"{spec / 1e12:.2f} TB/s" if spec else f"copy {measured / 1e12:.2f} TB/s measured, spec unknown")
    prompt_len, steps = (16, 8) if dry else (128, 64)
    max_len = prompt_len + steps + 16
    for name, path in models:
        with report.attempt(f"throughput: {name}"):
            _decode_rates(ctx, report, name, path, batches, prompt_len, steps, max_len, spec)


def _decode_rates(ctx: Context, report: Report, name: str, path, batches, prompt_len: int, steps: int, max_len: int,
                  spec: float | None) -> None:
    """Greedy decode at each batch size; one info line per batch (tok/s, ms/step, GB/s, % of HBM)."""
    runner = make_runner(path, device=ctx.device, dtype="bfloat16", max_num_seqs=max(batches), max_model_len=max_len,
                         num_blocks=max(batches) * -(-max_len // 16) + 8, max_num_batched_tokens=8192,
                         decode_graphs=ctx.graphs)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    per_token_kv = runner.bytes_per_block / runner.block_size
    rates = []
    for batch in batches:
        _, seconds = decode_tokens(runner, batch, prompt_len, steps, seed=batch)
        step = seconds / steps
        kv_read = batch * (prompt_len + steps / 2) * per_token_kv
        bandwidth = (weight_bytes + kv_read) / step
        frac = f", {100 * bandwidth / spec:.0f}% of spec HBM" if spec else ""
        rates.append(batch / step)
        report.info(f"decode {name} batch {batch}",
                    f"{batch / step:9.1f} tok/s, {step * 1e3:7.2f} ms/step, {bandwidth / 1e9:8.1f} GB/s{frac}")
    report.check(all(rate > 0 for rate in rates), f"throughput: {name}", f"batches {list(batches)} decoded")


