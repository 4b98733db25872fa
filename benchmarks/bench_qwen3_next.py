"""Qwen3-Next (hybrid gated DeltaNet) on CPU: our engine vs transformers ``generate`` on the same
random checkpoint (a scaled-down Qwen3-Next shape written by transformers), same machine, same run.

Prints decode tokens/s at batch 1 and 8 (rate = (tokens(N) - tokens(1)) / (time(N) - time(1)), so
prefill and start-up cancel out), prefill time of one long prompt (ours in 512-token chunks through
the chunked gated delta rule, transformers in one forward), and our decode step time at growing
context: only the attention layers (1 in 4) read a growing cache, the DeltaNet layers' state is
fixed-size. Run with ``python benchmarks/bench_qwen3_next.py``; not a test.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
from plan_driver import PlanDriver, make_runner  # noqa: E402
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

from shardserve.cluster.config import EngineArgs  # noqa: E402
from shardserve.cluster.llm import LLM  # noqa: E402
from shardserve.cluster.engine.request import SamplingParams  # noqa: E402

SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
             layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
             num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
             linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=16,
             num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=256,
             decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=8192)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def prompts(batch: int, length: int = 24) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return [torch.randint(3, SHAPE["vocab_size"], (length,), generator=gen).tolist() for _ in range(batch)]


def ours_rate(llm: LLM, batch: int, new_tokens: int) -> float:
    def run(n):
        return llm.generate(prompts(batch), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))

    run(2)
    t_short, t_long = timed(lambda: run(1)), timed(lambda: run(new_tokens))
    return batch * (new_tokens - 1) / (t_long - t_short)


def hf_rate(model, batch: int, new_tokens: int) -> float:
    ids = torch.tensor(prompts(batch))

    def run(n):
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)

    run(2)
    t_short, t_long = timed(lambda: run(1)), timed(lambda: run(new_tokens))
    return batch * (new_tokens - 1) / (t_long - t_short)


def decode_ms(path: Path, context: int, steps: int = 8, chunk: int = 512) -> float:
    runner = make_runner(path, block_size=64, num_blocks=context // 64 + 4)
    driver = PlanDriver(runner)
    prompt = prompts(1, context)[0]
    for start in range(0, context, chunk):
        last = driver.step({"s": prompt[start:start + chunk]})["s"]
    token = int(last.argmax())
    driver.step({"s": [token]})
    started = time.perf_counter()
    for _ in range(steps):
        token = int(driver.step({"s": [token]})["s"].argmax())
    return (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        hf = write_tiny_checkpoint("qwen3_next", tmp, seed=0, tokenizer=True, **SHAPE)
        llm = LLM(EngineArgs(model=tmp, kv_cache_gib=0.5, max_num_seqs=16, max_num_batched_tokens=512),
                  progress=False)
        print(f"Qwen3-Next shape: hidden 512, 8 layers (6 DeltaNet + 2 attention), 16 experts top-4; "
              f"torch threads {torch.get_num_threads()}")
        print(f"{'batch':>5} | {'shardserve tok/s':>16} | {'transformers tok/s':>18} | {'ratio':>6}")
        for batch in (1, 8):
            ours, ref = ours_rate(llm, batch, args.new_tokens), hf_rate(hf, batch, args.new_tokens)
            print(f"{batch:>5} | {ours:>16.1f} | {ref:>18.1f} | {ours / ref:>5.2f}x", flush=True)
        long_prompt = prompts(1, args.prefill)
        ours_s = timed(lambda: llm.generate(long_prompt, SamplingParams(max_tokens=1, temperature=0.0)))
        with torch.no_grad():
            hf_s = timed(lambda: hf(torch.tensor(long_prompt)))
        print(f"prefill {args.prefill} tokens: shardserve {ours_s:.2f} s (512-token chunks), "
              f"transformers {hf_s:.2f} s (one forward), ratio {hf_s / ours_s:.2f}x")
        for context in (int(c) for c in args.contexts.split(",")):
            print(f"decode step at context {context:>5}: {decode_ms(Path(tmp), context):7.2f} ms", flush=True)


if __name__ == "__main__":
    main()
