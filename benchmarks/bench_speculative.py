"""MTP speculative decoding: acceptance and speed for k = 1..3 vs plain decoding (k = 0).

Runs the single-process engine (greedy, ``ignore_eos``) on a checkpoint with MTP layers; by
default it writes tiny random DeepSeek-V3.2 and GLM-5 checkpoints with one MTP layer (the test
helper in ``tests/models/tiny_checkpoints.py``). For each k it prints the mean acceptance length
(tokens emitted per verifying sequence-step, accepted drafts + 1), the acceptance rate per draft
position, decode tokens per target forward per sequence, and wall-clock decode tokens/s (all
sequences) and speedup over k = 0.
Random weights make the MTP a poor predictor, so acceptance is near zero there; the ``oracle``
rows replay plain decoding's own tokens as drafts (the real MTP still runs, so its cost is paid)
to show what the mechanism gives when drafts are accepted. Greedy output is checked equal to
plain decoding in every row. Times are the best of 3 runs. On these 2- and 4-layer models one
MTP layer costs about half a target forward in Python overhead (on DeepSeek-V3.2's 61 layers it
is ~1/61), so the draft's share of the time is far larger here than on a real model.
Not a test: ``python benchmarks/bench_speculative.py``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "models"), str(ROOT / "tests" / "spec")]

from shardserve.cluster.config import EngineArgs  # noqa: E402
from shardserve.cluster.llm import LLM  # noqa: E402
from shardserve.cluster.engine.request import SamplingParams  # noqa: E402


class CountingExecutor:
    """Counts target forwards (engine steps) of the runner it wraps."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def execute(self, plan):
        self.calls += 1
        return self.inner.execute(plan)


def run(path: Path, k: int, prompts: list[list[int]], new_tokens: int, truth=None, repeats: int = 3,
        num_blocks: int = 64) -> dict:
    llm = LLM(EngineArgs(model=str(path), block_size=16, num_blocks=num_blocks, speculative_tokens=k), progress=False)
    counter = CountingExecutor(llm.core.executor)
    llm.core.executor = counter
    if truth is not None:
        from spec_helpers import install_oracle

        install_oracle(llm, truth)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))   # warm-up
    # decode-only figures: subtract a run that only prefills and emits one token; best of `repeats`
    prefill_s, total_s = float("inf"), float("inf")
    for _ in range(repeats):
        counter.calls, start = 0, time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        prefill_s, prefill_calls = min(prefill_s, time.perf_counter() - start), counter.calls
    for _ in range(repeats):
        stats = None
        if k:                                               # count one measured run only
            from shardserve.cluster.engine.speculative import SpecStats

            stats = llm.core.speculator.stats = SpecStats(k)
        counter.calls, start = 0, time.perf_counter()
        done = llm.generate(prompts, params)
        total_s = min(total_s, time.perf_counter() - start)
    decode_tokens = len(prompts) * (new_tokens - 1)
    decode_calls = counter.calls - prefill_calls
    return {"k": k, "tokens": [d.token_ids for d in done], "decode_tok_s": decode_tokens / (total_s - prefill_s),
            "tokens_per_forward": decode_tokens / decode_calls / len(prompts),
            "mean_acc_len": stats.mean_acceptance_length if stats else 1.0,
            "acc_rate": stats.acceptance_rate_per_position if stats else []}


def table(arch: str, path: Path, batch: int, new_tokens: int, oracle: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 24, (batch,), generator=gen)]
    base = run(path, 0, prompts, new_tokens)
    truth = {tuple(p): t for p, t in zip(prompts, base["tokens"])}
    rows = [base] + [run(path, k, prompts, new_tokens) for k in (1, 2, 3)]
    if oracle:
        rows += [dict(run(path, k, prompts, new_tokens, truth), k=f"{k} oracle") for k in (1, 2, 3)]
    print(f"\n{arch}, batch {batch}, {new_tokens} new tokens per request (greedy)")
    print(f"{'k':>9} | {'mean acc. len':>13} | {'acceptance rate per position':<28} | "
          f"{'tok/fwd/seq':>11} | {'decode tok/s':>12} | {'speedup':>7} | same output")
    for row in rows:
        rates = " ".join(f"{r:.3f}" for r in row["acc_rate"]) or "-"
        print(f"{row['k']!s:>9} | {row['mean_acc_len']:>13.3f} | {rates:<28} | {row['tokens_per_forward']:>11.2f} | "
              f"{row['decode_tok_s']:>12.1f} | {row['decode_tok_s'] / base['decode_tok_s']:>6.2f}x | "
              f"{row['tokens'] == base['tokens']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder with MTP layers (default: tiny random ones)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--no-oracle", action="store_true", help="skip the oracle-draft rows")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            models = [(Path(args.model).name, Path(args.model))]
        else:
            from tiny_checkpoints import write_tiny_checkpoint

            models = []
            for arch in ("deepseek_v32", "glm_moe_dsa"):
                write_tiny_checkpoint(arch, Path(tmp) / arch, mtp=True, tokenizer=True)
                models.append((f"tiny random {arch}", Path(tmp) / arch))
        for name, path in models:
            for batch in args.batch:
                table(name, path, batch, args.new_tokens, oracle=not args.no_oracle)


if __name__ == "__main__":
    main()
