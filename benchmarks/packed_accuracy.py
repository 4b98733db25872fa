"""What the CPU default path (packed Q4/Q8 weights, bfloat16 compute) costs in accuracy.

Against transformers in float32 on the same GGUF file, for our engine with ``--dtype auto`` (the
default) and ``--dtype float32`` (the exact path):

- greedy generation on the parity prompts of ``tests/e2e/test_llama_parity.py``: tokens generated
  before the first difference (chaotic: one near-tie flips a whole continuation);
- next-token prediction after 60 prefixes (40-89 tokens) of a text (tinyshakespeare beside the
  checkout, else the prompts repeated): top-1 agreement and the mean ``KL(p_ref || p_ours)`` in nats,
  the steadier figure; and the largest logit difference seen anywhere.

The packed path runs twice: without dense copies (``--packed-dense-rows 0``: every matmul on the
packed kernels) and with them where they pay (``auto``: prefill on dense bfloat16 copies where this
CPU runs those faster). Run with ``make bench``; not a test.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

PROMPTS = [[{"role": "user", "content": "What is the capital of France?"}],
           [{"role": "user", "content": "Write a short poem about the sea."}],
           "Once upon a time, in a small village,", "def fibonacci(n):\n    "]
ROOT = Path(__file__).resolve().parent.parent


def corpus() -> str:
    """tinyshakespeare beside the checkout (``../shared/data``), else the text prompts repeated."""
    for base in (ROOT.parent, ROOT.parent.parent):
        path = base / "shared" / "data" / "tinyshakespeare.txt"
        if path.is_file():
            return path.read_text()[:20000]
    return " ".join(p for p in PROMPTS if isinstance(p, str)) * 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from shardserve.cluster.config import EngineArgs
    from shardserve.cluster.llm import LLM
    from shardserve.cluster.engine.request import SamplingParams
    from shardserve.workers.model_source import resolve_model

    files = resolve_model(args.model)
    hf = AutoModelForCausalLM.from_pretrained(str(files.folder), gguf_file=files.path.name, dtype=torch.float32).eval()
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    text = corpus()
    print(f"{files.name} vs transformers (float32): greedy {args.new_tokens} tokens on {len(PROMPTS)} prompts; "
          f"next token after 60 text prefixes")
    print(f"{'dtype':<8} {'path':<34} {'greedy tokens before a difference':<34} {'top-1':>6} {'mean KL':>8} "
          f"{'max |dlogit|':>12}")
    for dtype, dense_rows in (("auto", "0"), ("auto", "auto"), ("float32", "0")):
        llm = LLM(EngineArgs(model=str(files.path), kv_cache_gib=0.1, dtype=dtype, packed_dense_rows=dense_rows),
                  progress=False)
        agree, worst = [], 0.0
        for prompt in PROMPTS:
            ids = llm.encode(prompt)
            with torch.no_grad():
                ref = hf.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
            ours = llm.generate([ids], greedy)[0].token_ids
            agree.append(next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref)))
        text_ids = llm.encode(text)
        top1, kl = 0, 0.0
        for start in range(0, 60 * 97, 97):
            ids = text_ids[start:start + 40 + start % 50]
            with torch.no_grad():
                ref_logits = hf(torch.tensor([ids])).logits[0, -1].float()
            logits = llm.core.prompt_logits(ids).float()
            top1 += int(logits.argmax() == ref_logits.argmax())
            kl += torch.nn.functional.kl_div(logits.log_softmax(-1), ref_logits.log_softmax(-1), log_target=True,
                                             reduction="sum").item()
            worst = max(worst, (logits - ref_logits).abs().max().item())
        runner = llm.runner
        rows = next((m.packed.dense_rows for m in runner.model.modules() if getattr(m, "packed", None)), 0)
        path = ("dequantized, float32" if runner.dtype == torch.float32 else
                f"packed, {str(runner.dtype).removeprefix('torch.')}, dense from {rows or '-'} rows")
        print(f"{dtype:<8} {path:<34} {' / '.join(map(str, agree)) + f' (of {args.new_tokens})':<34} "
              f"{top1:>3}/60 {max(kl / 60, 0.0):>8.5f} {worst:>12.3f}", flush=True)


if __name__ == "__main__":
    main()
