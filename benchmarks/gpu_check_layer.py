"""gpu_check section: one DeepSeek-V3.2 decoder layer as rank 0 of TP=8 holds it (16 of 128 heads,
32 of 256 routed experts, its shared-expert and vocabulary slices; transformers' default
``DeepseekV32Config`` is the released model's shape), at 32K tokens of context per sequence: the
decode step time, eager and from a captured CUDA graph (see ``benchmarks/gpu_check.py``).

Random bf16 weights (the router picks experts as it would; FP8 experts would read half the bytes),
zero caches (the kernels read every selected key anyway). The all-reduces are identities here:
this measures one rank's compute, not NCCL. ``--cpu-dry-run``: the tiny V3.2 at 256 tokens, TP=1.
"""

from __future__ import annotations

import time

import torch

from gpu_check_core import Context, Report, section
from shardserve.workers.distributed import TensorParallelGroup, get_tp_group, set_tp_group


class _OneRankOf(TensorParallelGroup):
    """Rank 0 of ``tp_size`` for building and timing one rank's shard: collectives are identities."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _all_gather_equal(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor] * self.tp_size


def _build(ctx: Context):
    """``(model, config, context tokens, tp_size)``: one MoE layer with its own indexer."""
    from shardserve.workers.models.deepseek_v32 import DeepseekV32ForCausalLM

    if ctx.dry:
        from tiny_checkpoints import tiny_config

        config, context, tp_size = tiny_config("deepseek_v32", num_hidden_layers=1, first_k_dense_replace=0,
                                               mlp_layer_types=["sparse"]), 256, 1
    else:
        from transformers import DeepseekV32Config

        config, context, tp_size = DeepseekV32Config(num_hidden_layers=1, first_k_dense_replace=0), 32768, 8
    dtype = torch.float32 if ctx.dry else torch.bfloat16
    with torch.device(ctx.device):
        model = DeepseekV32ForCausalLM(config, dtype=dtype)
    model = model.to(ctx.device).eval()   # the RoPE tables are made on the CPU
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(0.0 if "bias" in name else 1.0)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    return model, config, context, tp_size


def _metadata(ctx: Context, batch: int, context: int, block_size: int):
    from shardserve.workers.forward_context import AttentionMetadata

    blocks_per_seq = -(-context // block_size)
    device = ctx.device
    tables = torch.arange(batch * blocks_per_seq, device=device, dtype=torch.int32).view(batch, blocks_per_seq)
    pos = torch.full((batch,), context - 1, device=device, dtype=torch.int64)
    slots = tables[:, -1].long() * block_size + (context - 1) % block_size
    return AttentionMetadata(slot_mapping=slots, positions=pos, query_start_loc=torch.arange(batch + 1, device=device),
                             seq_lens=torch.full((batch,), context, device=device, dtype=torch.int64),
                             block_tables=tables, max_query_len=1, max_seq_len=context)


def _time(ctx: Context, fn, repeats: int) -> float:
    if not ctx.dry:   # warm-up
        fn()
    ctx.sync()
    begin = time.perf_counter()
    for _ in range(repeats):
        fn()
    ctx.sync()
    return (time.perf_counter() - begin) / repeats


@section("layer", "layer: a DeepSeek-V3.2 layer (one TP=8 rank) at 32K context")
def layer(ctx: Context, report: Report) -> None:
    from shardserve.workers.forward_context import forward_context
    from shardserve.workers.model_runner import allocate_caches

    before = get_tp_group()
    batches = (1, 4) if ctx.dry else (1, 16, 64)
    try:
        with report.attempt("layer: build"):
            set_tp_group(_OneRankOf(0, 8 if not ctx.dry else 1))
            model, config, context, tp_size = _build(ctx)
            block_size = 64
            allocate_caches(model.attention_layers(), max(batches) * -(-context // block_size), block_size, ctx.device)
        name = f"layer: V3.2 (TP={tp_size} rank) decode at {context} tokens"
        for batch in batches:
            with report.attempt(f"{name}, batch {batch}"):
                meta = _metadata(ctx, batch, context, block_size)
                ids = torch.randint(0, config.vocab_size // tp_size, (batch,), device=ctx.device)

                @torch.inference_mode()
                def step():
                    with forward_context(meta):
                        return model(ids, meta.positions)

                eager_out = step().clone()
                eager_s = _time(ctx, step, 1 if ctx.dry else 20)
                graph_s, graph_out = _graphed(ctx, step)
                same = torch.allclose(graph_out.float(), eager_out.float(), atol=1e-2, rtol=1e-2)
                report.check(bool(torch.isfinite(eager_out).all()) and same, f"{name}, batch {batch}",
                             f"eager {eager_s * 1e3:.2f} ms, graph {graph_s * 1e3:.2f} ms per layer "
                             f"(x61 layers: {61 * graph_s * 1e3:.0f} ms/step, {batch / (61 * graph_s):.0f} tok/s "
                             "per rank without communication)")
    finally:
        set_tp_group(before)


def _graphed(ctx: Context, step) -> tuple[float, torch.Tensor]:
    """Seconds per replay of ``step`` captured in a CUDA graph, and its output (CPU: the replay
    stand-in, ``step`` under the host-sync guard)."""
    from shardserve.workers.sync_guard import no_host_sync

    if ctx.dry:
        with no_host_sync("the V3.2 layer's decode step"):
            out = step()
        return _time(ctx, step, 1), out
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return _time(ctx, graph.replay, 50), out
