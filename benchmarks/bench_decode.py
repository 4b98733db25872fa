"""Decode throughput: our engine vs transformers ``generate`` on the same GGUF, same machine, same run.

Prints tokens/s for batch 1 and for 16 concurrent requests, and the ratios. Decode rate is
measured as (tokens(N) - tokens(1)) / (time(N) - time(1)) so prefill and start-up cancel out.
Not a test: run with ``make bench``.
"""

from __future__ import annotations

import argparse
import time

import torch

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.llm import LLM
from shardserve.cluster.engine.request import SamplingParams

PROMPTS = ["Once upon a time", "The history of Rome", "In computer science, a hash table",
           "My favourite recipe is", "The weather today", "Dear friend,", "import numpy as np\n",
           "Chapter 1.", "The quick brown fox", "Q: What is gravity?\nA:", "Shakespeare wrote",
           "Ladies and gentlemen,", "The stock market", "Mountains are", "Hello! My name is", "In 1969,"]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ours_rate(llm: LLM, batch: int, new_tokens: int) -> float:
    prompts = PROMPTS[:batch]

    def run(n):
        return llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))

    run(2)  # warm-up
    t_short, t_long = timed(lambda: run(1)), timed(lambda: run(new_tokens))
    return batch * (new_tokens - 1) / (t_long - t_short)


def hf_rate(model, tokenizer, batch: int, new_tokens: int) -> float:
    tokenizer.padding_side = "left"
    enc = tokenizer(PROMPTS[:batch], return_tensors="pt", padding=True)

    def run(n):
        with torch.no_grad():
            model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    run(2)
    t_short, t_long = timed(lambda: run(1)), timed(lambda: run(new_tokens))
    return batch * (new_tokens - 1) / (t_long - t_short)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    llm = LLM(EngineArgs(model=args.model, kv_cache_gib=0.5), progress=False)
    files = llm.files
    hf = AutoModelForCausalLM.from_pretrained(str(files.folder), gguf_file=files.path.name, dtype=torch.float32).eval()
    print(f"torch threads: {torch.get_num_threads()}, model: {files.path.name}, {args.new_tokens} new tokens")
    print(f"{'batch':>5} | {'shardserve tok/s':>16} | {'transformers tok/s':>18} | {'ratio':>6}")
    rows = {}
    for batch in (1, 16):
        ours, ref = ours_rate(llm, batch, args.new_tokens), hf_rate(hf, llm.tokenizer, batch, args.new_tokens)
        rows[batch] = (ours, ref)
        print(f"{batch:>5} | {ours:>16.1f} | {ref:>18.1f} | {ours / ref:>5.2f}x")
    print(f"16 concurrent vs transformers batch 1 (one request at a time): {rows[16][0] / rows[1][1]:.2f}x")


if __name__ == "__main__":
    main()
