"""MTP speculative decoding: speed and acceptance of k = 1..3 (fixed) and the adaptive policy
against plain decoding (k = 0), through the single-process engine (``LLM``).

Every configuration runs in this one process, on this one thread, interleaved with the others
(k = 0, k = 1, ..., adaptive, then again), ``--repeats`` times; the table gives each one's median
and its ratio to k = 0's median of the same run. Two clocks per row:

- wall clock: the whole ``generate`` (prefill included): all new tokens / seconds;
- decode-only: from the step in which the last request got its first token to the end, the tokens
  emitted in that window / its time (tokens early requests decoded while later prompts were still
  being prefilled are not in it: counted there, they made drafting that is slower by the wall clock
  look 20 % faster at batch 32).

Every configuration runs on one engine (its own speculator swapped in, see :func:`measure`). The
last row, ``k=0 again``, is k = 0 timed a second time in each round: its ratio is the run's noise
floor, and a ratio within it of 1.0x does not tell faster from slower. The ``paired`` column is a
second estimate of the wall-clock ratio that cancels the machine's drift: in each round, the mean of
that round's two k = 0 times over this configuration's time, and the median of that over the rounds
(on the two k = 0 rows it reads their own spread around that mean).

Prefix caching is off, so every repetition prefills its prompts again. The draft model runs on the
engine's own thread: earlier versions ran it on a second torch thread, whose OpenMP team made GNU
OpenMP throttle every parallel region's spin-wait, so every forward of the process (k = 0's too,
once any speculating engine had run) was up to 3x slower than timed alone (issue 31).

By default it writes tiny random DeepSeek-V3.2 and GLM-5 checkpoints with one MTP layer (the test
helper in ``tests/models/tiny_checkpoints.py``): random weights make the MTP a poor predictor, so
acceptance is near zero there and the adaptive policy should draft (almost) nothing; ``--model``
(e.g. ``~/.cache/shardserve/shakespeare-dsa-mtp``, see ``benchmarks/bench_demo.py``) measures a
real one. Greedy output is checked equal to k = 0's in every row (``same``). Numbers on a machine
other processes load are noisy: compare ratios within one run.
Not a test: ``python benchmarks/bench_speculative.py [--model PATH] [--batch 1 8 32] [--configs k=3 adaptive]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "models")]

from shardserve.cluster.config import EngineArgs  # noqa: E402
from shardserve.cluster.engine.request import SamplingParams  # noqa: E402
from shardserve.cluster.engine.speculative import Speculator  # noqa: E402
from shardserve.cluster.llm import LLM  # noqa: E402

CONFIGS = [("k=0", 0, "fixed"), ("k=1", 1, "fixed"), ("k=2", 2, "fixed"), ("k=3", 3, "fixed"),
           ("adaptive", 3, "adaptive"), ("k=0 again", 0, "fixed")]


@dataclass
class Row:
    """One configuration's measurements over the repetitions."""

    name: str
    wall_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)   # per run, emitted in its decode-only window
    tokens: list[list[int]] = field(default_factory=list)
    new_tokens: int = 0
    acceptance_length: float | None = None
    depth_steps: list[int] = field(default_factory=list)

    def wall_tok_s(self) -> float:
        return self.new_tokens / statistics.median(self.wall_s)

    def decode_tok_s(self) -> float:
        return statistics.median(n / max(t, 1e-9) for n, t in zip(self.decode_tokens, self.decode_s))


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float, int, list]:
    """``LLM.generate``'s loop with two clocks: ``(wall s, decode-only s, tokens emitted in the
    decode-only window, token ids per prompt)``. The window opens once every request has its first
    token; only tokens emitted after that count in it. (Counting every token but the first of each
    request, as this did, credited the window with what early requests decoded while later prompts
    were still being prefilled: at batch 32 of the demo model k = 2 read 1.20x "decode-only" where
    its wall clock read 0.95x, and the same drafts without the prompt passes 1.01x; issue 31.)"""
    core = llm.core
    started = time.perf_counter()
    ids = [core.add_request(list(p), params) for p in prompts]
    tokens = {i: [] for i in ids}
    first_all, before_window = None, 0
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
        if first_all is None and all(tokens[i] for i in ids):
            first_all, before_window = time.perf_counter(), sum(map(len, tokens.values()))
    ended = time.perf_counter()
    emitted = sum(map(len, tokens.values()))
    return ended - started, ended - (first_all or ended), emitted - before_window, [tokens[i] for i in ids]


def make_engine(path: Path, max_k: int, batch: int, prompt_len: int, new_tokens: int) -> LLM:
    """One engine whose draft model and buffers serve every configuration up to ``max_k``."""
    blocks = batch * (-(-(prompt_len + new_tokens + 8) // 16)) + 8
    return LLM(EngineArgs(model=str(path), block_size=16, num_blocks=blocks, speculative_tokens=max_k,
                          max_num_seqs=max(batch, 1), enable_prefix_caching=False), progress=False)


def measure(path: Path, prompts: list[list[int]], new_tokens: int, repeats: int, configs=CONFIGS) -> list[Row]:
    """Interleaved runs of every configuration on ``prompts`` (greedy, ``ignore_eos``).

    Every configuration runs on one engine (one copy of the weights, caches and draft model in
    memory): each has its own :class:`Speculator` (its policy keeps what it learned across runs),
    swapped in before its run; k = 0 runs with none. Separate engines per configuration differed by
    up to 15 % between two runs of the same command (k=1 read 1.24x, then 1.04x), which is where
    each engine's tensors landed, not what it computes."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm = make_engine(path, max(k for _, k, _ in configs), len(prompts), max(map(len, prompts)), new_tokens)
    core = llm.core
    speculators = [Speculator(llm.drafter, k, policy) if k else None for _, k, policy in configs]
    rows = [Row(name) for name, _, _ in configs]
    for repeat in range(-1, repeats):                               # repeat -1: warm-up (not timed)
        for row, speculator in zip(rows, speculators):
            core.speculator = speculator
            before = (speculator.stats.num_drafts, speculator.stats.num_accepted_tokens,
                      list(speculator.stats.depth_steps)) if speculator else None
            wall, decode, decode_tokens, tokens = timed_generate(llm, prompts, params)
            if repeat < 0:
                continue
            row.wall_s.append(wall)
            row.decode_s.append(decode)
            row.decode_tokens.append(decode_tokens)
            row.tokens = tokens
            row.new_tokens = sum(map(len, tokens))
            if speculator is not None:
                stats = speculator.stats
                drafts, accepted = stats.num_drafts - before[0], stats.num_accepted_tokens - before[1]
                row.acceptance_length = 1 + accepted / drafts if drafts else None
                row.depth_steps = [a - b for a, b in zip(stats.depth_steps, before[2])]
    return rows


def paired_ratio(rows: list[Row], row: Row) -> float:
    """Median over rounds of ``mean(k=0's time, k=0 again's time) / row's time`` (wall clock): each
    round's own k = 0 runs, first and last, are its baseline, so a machine slowing down or speeding
    up between rounds cancels out. On the two k = 0 rows it reads their spread around that mean."""
    first, last = rows[0].wall_s, rows[-1].wall_s
    return statistics.median((a + b) / 2 / t for a, b, t in zip(first, last, row.wall_s))


def print_table(title: str, rows: list[Row]) -> None:
    base = rows[0]
    print(f"\n{title}")
    print(f"{'config':>8} | {'wall tok/s':>10} | {'vs k=0':>6} | {'paired':>6} | {'decode tok/s':>12} | {'vs k=0':>6} | "
          f"{'acc. len':>8} | {'depths 0..k (seq-steps)':<24} | same")
    for row in rows:
        acc = f"{row.acceptance_length:.2f}" if row.acceptance_length else "-"
        depths = " ".join(map(str, row.depth_steps)) or "-"
        print(f"{row.name:>8} | {row.wall_tok_s():>10.1f} | {row.wall_tok_s() / base.wall_tok_s():>5.2f}x | "
              f"{paired_ratio(rows, row):>5.2f}x | "
              f"{row.decode_tok_s():>12.1f} | {row.decode_tok_s() / base.decode_tok_s():>5.2f}x | {acc:>8} | "
              f"{depths:<24} | {row.tokens == base.tokens}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder with MTP layers (default: tiny random ones)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--configs", nargs="+", default=[name for name, _, _ in CONFIGS],
                        choices=[name for name, _, _ in CONFIGS],
                        help="configurations to run (k=0 always runs, first; 'k=0 again' last)")
    args = parser.parse_args()
    configs = [c for c in CONFIGS if c[0] in ("k=0", "k=0 again") or c[0] in args.configs]
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
            gen = torch.Generator().manual_seed(0)
            vocab = 120 if not args.model else 1000
            for batch in args.batch:
                prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(batch)]
                rows = measure(path, prompts, args.new_tokens, args.repeats, configs)
                print_table(f"{name}, batch {batch}, {args.prompt_len}-token prompts, {args.new_tokens} new tokens "
                            f"(greedy), median of {args.repeats}", rows)


if __name__ == "__main__":
    main()
