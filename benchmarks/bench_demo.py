"""DSA and MTP measured on real weights: the trained ``shakespeare-dsa-mtp`` demo model through shardserve.

Prints whether its greedy tokens equal transformers' with DSA active and how many of the float
indexer's selections the fp8 indexer (``--indexer-cache-dtype fp8``) keeps, then three tables
(train the model first: ``python benchmarks/train_demo.py``):

1. Validation perplexity (the held-out last 10% of tinyshakespeare, non-overlapping windows,
   every position scored) with dense attention (``--no-dsa``) and DSA at ``--dsa-top-k`` 64 and 256,
   at context 512 and 2048, through shardserve's model runner.
2. MTP speculative decoding: acceptance rate per draft position and mean acceptance length
   (tokens per verifying sequence-step, accepted drafts + 1) for k = 1, 2, 3, greedy and at
   temperature 0.8, 8 validation prompts of 64 tokens, 128 new tokens each.
3. Tokens/s of the single-process engine without (k = 0) and with speculation (k = 1..3 fixed, and
   the adaptive policy with k <= 3), at batch 1, 8 and 32 (greedy, 64 new tokens each,
   ``benchmarks/bench_speculative.py``'s timing: every configuration interleaved in this process,
   median of ``--repeats``; wall clock of the whole ``generate`` and decode-only).

Numbers on a machine other processes load are noisy; compare ratios within one run.
Not a test: ``python benchmarks/bench_demo.py [--model PATH] [--sections speed]``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests" / "models"), str(ROOT / "tests" / "spec")]

from bench_speculative import measure, print_table  # noqa: E402
from plan_driver import PlanDriver, make_runner, recorded_indexer_calls  # noqa: E402
from shardserve.cluster.config import EngineArgs  # noqa: E402
from shardserve.cluster.llm import LLM  # noqa: E402
from shardserve.cluster.engine.request import SamplingParams  # noqa: E402
from shardserve.workers.model_source import resolve_model  # noqa: E402
from train_demo import MODEL_NAME, default_data_path, encode_corpus, split_tokens  # noqa: E402

BLOCK_SIZE = 16
VARIANTS = {"dense": {"dsa": False}, "DSA top-k 64": {"dsa_top_k": 64}, "DSA top-k 256": {"dsa_top_k": 256}}


@torch.inference_mode()
def perplexity(path: Path, windows: list[list[int]], **switches) -> float:
    """exp(mean next-token NLL) over every position of every window, one window per forward."""
    runner = make_runner(path, block_size=BLOCK_SIZE, num_blocks=-(-len(windows[0]) // BLOCK_SIZE) + 1, **switches)
    nll, count = 0.0, 0
    for window in windows:
        logits = PlanDriver(runner).step_all_rows({"w": window})["w"]               # [len, vocab]
        nll += F.cross_entropy(logits[:-1], torch.tensor(window[1:]), reduction="sum").item()
        count += len(window) - 1
    return math.exp(nll / count)


def perplexity_table(path: Path, validation: torch.Tensor, contexts: list[int], max_windows: int) -> None:
    print("\nValidation perplexity (lower is better; DSA vs dense in parentheses)")
    print(f"{'context':>7} | {'windows':>7} | " + " | ".join(f"{name:>22}" for name in VARIANTS))
    for context in contexts:
        count = min(max_windows, validation.numel() // context)
        windows = [validation[i * context:(i + 1) * context].tolist() for i in range(count)]
        values = {name: perplexity(path, windows, **switches) for name, switches in VARIANTS.items()}
        dense = values["dense"]
        cells = [f"{v:>8.3f} ({100 * (v / dense - 1):+6.2f}%)" if name != "dense" else f"{v:>22.3f}"
                 for name, v in values.items()]
        print(f"{context:>7} | {count:>7} | " + " | ".join(f"{c:>22}" for c in cells), flush=True)


def acceptance(path: Path, prompts: list[list[int]], k: int, temperature: float, new_tokens: int) -> tuple:
    """``(mean acceptance length, acceptance rate per position)`` of one batched generation."""
    llm = LLM(EngineArgs(model=str(path), block_size=BLOCK_SIZE, num_blocks=len(prompts) * 16 + 16,
                         speculative_tokens=k, speculative_policy="fixed"), progress=False)
    params = [SamplingParams(max_tokens=new_tokens, temperature=temperature, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    llm.generate(prompts, params if temperature else params[0])
    stats = llm.core.speculator.stats
    return stats.mean_acceptance_length, stats.acceptance_rate_per_position


def acceptance_table(path: Path, prompts: list[list[int]], new_tokens: int) -> None:
    print(f"\nMTP acceptance ({len(prompts)} prompts of {len(prompts[0])} tokens, {new_tokens} new tokens each)")
    print(f"{'sampling':>8} | {'k':>2} | {'mean acc. len':>13} | acceptance rate per draft position")
    for temperature in (0.0, 0.8):
        for k in (1, 2, 3):
            mean, rates = acceptance(path, prompts, k, temperature, new_tokens)
            name = "greedy" if temperature == 0 else f"T={temperature}"
            print(f"{name:>8} | {k:>2} | {mean:>13.3f} | " + "  ".join(f"{r:.3f}" for r in rates), flush=True)


def speed_table(path: Path, prompts: list[list[int]], new_tokens: int, batches: list[int], repeats: int) -> None:
    for batch in batches:
        rows = measure(path, prompts[:batch], new_tokens, repeats)
        print_table(f"Tokens/s through shardserve, batch {batch}, {len(prompts[0])}-token prompts, {new_tokens} new "
                    f"tokens each (greedy), median of {repeats}", rows)


@torch.inference_mode()
def fp8_agreement(path: Path, window: list[int], top_k: int) -> None:
    """Share of the float path's selected keys that the fp8 indexer also selects, per layer, over
    the rows that choose (positions >= ``top_k``; the others keep every key). End to end: the fp8
    run's own selections (layer 0's inputs equal the float run's; later layers inherit earlier
    differences). Same inputs: fp8 keys and queries, and fp8 keys with float queries (the bound on
    what fp8 queries can reach), scored on the float run's own q, k and weights."""
    from shardserve.kernels.indexer import indexer_scores_ref, quantize_index_keys, quantize_index_queries, select_topk
    from shardserve.workers.models.dsa_indexer import selection_mask

    chosen, float_calls = {"same fp8": [], "same fp8 keys": []}, []
    for cache_dtype in ("auto", "fp8"):
        runner = make_runner(path, block_size=BLOCK_SIZE, num_blocks=-(-len(window) // BLOCK_SIZE) + 1,
                             dsa_top_k=top_k, indexer_cache_dtype=cache_dtype)
        layers = [layer for layer in runner.model.attention_layers() if layer.indexer is not None]
        for layer in layers:
            layer.record_topk = True
        with recorded_indexer_calls() as calls:
            PlanDriver(runner).step({"w": window})
        chosen[cache_dtype] = [layer.last_topk for layer in layers]
        float_calls = float_calls or calls
    for (q, weights, k_cache, block_tables, seq_lens, _, starts, width), _ in float_calls:
        packed = quantize_index_keys(k_cache.flatten(0, 1)).view(*k_cache.shape[:2], -1)
        q_fp8, q_scale = quantize_index_queries(q)
        for name, query, scale in (("same fp8", q_fp8, q_scale), ("same fp8 keys", q, None)):
            logits = indexer_scores_ref(query, weights, packed, block_tables, seq_lens, starts, width, q_scale=scale)
            chosen[name].append(select_topk(logits, top_k))
    rows = torch.arange(len(window)) >= top_k

    def shares(name: str) -> str:
        out = []
        for reference, selection in zip(chosen["auto"], chosen[name]):
            reference = selection_mask(reference, len(window))[rows]
            out.append((reference & selection_mask(selection, len(window))[rows]).sum().item() / reference.sum().item())
        return " ".join(f"{100 * share:.2f}%" for share in out)

    print(f"fp8 indexer top-{top_k} agreement with the float path, {int(rows.sum())} choosing rows of "
          f"{len(window)} tokens, per layer:", flush=True)
    for label, name in (("end to end, fp8 keys + queries", "fp8"), ("same inputs, fp8 keys + queries", "same fp8"),
                        ("same inputs, fp8 keys, float queries", "same fp8 keys")):
        print(f"  {label + ':':<38}{shares(name)}", flush=True)


def transformers_parity(path: Path, prompts: list[list[int]], new_tokens: int = 32) -> None:
    """Greedy tokens of transformers' ``DeepseekV32ForCausalLM`` vs shardserve's, DSA active."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()           # its load report lists the MTP layer as unexpected keys
    hf = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", dtype=torch.float32).eval()
    llm = LLM(EngineArgs(model=str(path), block_size=BLOCK_SIZE, num_blocks=len(prompts) * 40 + 8), progress=False)
    ours = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    with torch.no_grad():
        theirs = [hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    same = [d.token_ids == t for d, t in zip(ours, theirs)]
    print(f"\nGreedy tokens equal to transformers' (DSA top-k {hf.config.index_topk}, {len(prompts)} prompts of "
          f"{len(prompts[0])} tokens, {new_tokens} new): {same}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL_NAME, help="demo model name or checkpoint folder")
    parser.add_argument("--data", type=Path, default=default_data_path(), help="tinyshakespeare.txt")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--max-windows", type=int, default=16, help="validation windows per context")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens per prompt (acceptance table)")
    parser.add_argument("--speed-tokens", type=int, default=64, help="new tokens per prompt (speed table)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="batch sizes of the speed table")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions of the speed table")
    parser.add_argument("--sections", nargs="+", default=["parity", "fp8", "perplexity", "acceptance", "speed"],
                        choices=["parity", "fp8", "perplexity", "acceptance", "speed"])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    files = resolve_model(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(files.path))
    _, validation = split_tokens(encode_corpus(tokenizer, args.data))
    started = time.perf_counter()
    print(f"{files.name} ({files.path}); validation: {validation.numel()} tokens")
    if "parity" in args.sections:
        transformers_parity(files.path, [validation[i * 4096:i * 4096 + 512].tolist() for i in range(2)])
    if "fp8" in args.sections:
        for top_k in (64, 256):
            fp8_agreement(files.path, validation[:2048].tolist(), top_k)
    if "perplexity" in args.sections:
        perplexity_table(files.path, validation, args.contexts, args.max_windows)
    prompts = [validation[i * 512:i * 512 + 64].tolist() for i in range(max(8, *args.batches))]
    if "acceptance" in args.sections:
        acceptance_table(files.path, prompts[:8], args.new_tokens)
    if "speed" in args.sections:
        speed_table(files.path, prompts, args.speed_tokens, args.batches, args.repeats)
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
