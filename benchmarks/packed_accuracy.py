"""What the CPU default path (packed Q4/Q8 weights, bfloat16 compute) costs in accuracy.

On the parity prompts of ``tests/e2e/test_llama_parity.py`` it compares greedy generation of our
engine, with ``--dtype auto`` (the default) and ``--dtype float32`` (the exact path), against
transformers' ``generate`` in float32 on the same GGUF file: tokens generated before the first
difference, and the largest difference of the prefill logits. Run with ``make bench``; not a test.
"""

from __future__ import annotations

import argparse

import torch

PROMPTS = [[{"role": "user", "content": "What is the capital of France?"}],
           [{"role": "user", "content": "Write a short poem about the sea."}],
           "Once upon a time, in a small village,", "def fibonacci(n):\n    "]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
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
    print(f"{files.name}: greedy {args.new_tokens} tokens vs transformers (float32) on {len(PROMPTS)} prompts")
    print(f"{'dtype':<8} {'path':<22} {'tokens equal before the first difference':<44} {'max |logit diff|':>16}")
    for dtype in ("auto", "float32"):
        llm = LLM(EngineArgs(model=str(files.path), kv_cache_gib=0.05, dtype=dtype), progress=False)
        agree, worst = [], 0.0
        for prompt in PROMPTS:
            ids = llm.encode(prompt)
            with torch.no_grad():
                ref = hf.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
                ref_logits = hf(torch.tensor([ids])).logits[0, -1].float()
            ours = llm.generate([ids], greedy)[0].token_ids
            agree.append(next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref)))
            worst = max(worst, (llm.core.prompt_logits(ids) - ref_logits).abs().max().item())
        path = "packed, " + str(llm.runner.dtype).removeprefix("torch.") if llm.runner.dtype != torch.float32 \
            else "dequantized, float32"
        print(f"{dtype:<8} {path:<22} {' / '.join(map(str, agree)) + f' (of {args.new_tokens})':<44} {worst:>16.4f}")


if __name__ == "__main__":
    main()
