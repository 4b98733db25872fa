"""Structured outputs: constrained vs unconstrained decoding, same engine, same run; grammar compile time.

Decode tokens/s at batch 1 and 32 of the single-process engine on SmolLM2 (its CPU defaults),
unconstrained (``ignore_eos``) and constrained by a JSON schema that cannot end within the
measured tokens (an array with ``minItems``), so both decode exactly ``--new-tokens`` tokens per
request. The rate is ``batch * (n - 1) / (t(n) - t(1))`` (prefill and start-up cancel out); runs
alternate (free, constrained, free, ...) and the median of ``--repeats`` is kept, so load changes
hit both. A third row adds presence / frequency / repetition penalties and a logit_bias. Also
printed: where the constrained step's extra time goes (the engine's per-step bitmask fill, rank
0's mask + controls application), and the compile time of a 50-property schema (cold: a fresh
xgrammar compiler; warm: the cache). The goal (issue 26): constrained within 10% of free.

Run: ``.venv/bin/python benchmarks/bench_structured.py`` (about 3 minutes on a quiet 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.engine.grammar import GrammarState
from shardserve.cluster.engine.request import SamplingParams, StructuredOutputs
from shardserve.cluster.frontend.structured import GrammarCompiler
from shardserve.cluster.llm import LLM
from shardserve.workers.model_runner import ModelRunner

PRODUCT = {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24},
    "tags": {"type": "array", "items": {"enum": ["new", "sale", "eco", "日本製"]}, "maxItems": 3},
    "price": {"type": "number"}, "stock": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
    "required": ["id", "name", "tags", "price", "stock"], "additionalProperties": False}
CATALOG = {"type": "object", "properties": {"products": {"type": "array", "items": PRODUCT, "minItems": 1000}},
           "required": ["products"], "additionalProperties": False}
PROMPT = [{"role": "user", "content": "List the products of a small shop as JSON."}]


def fifty_property_schema(tag: str) -> dict:
    """50 properties of mixed kinds (strings, numbers, enums, nested objects, arrays, anyOf)."""
    kinds = [{"type": "string", "maxLength": 32}, {"type": "integer", "minimum": 0}, {"type": "number"},
             {"type": "boolean"}, {"enum": ["red", "green", "青", "赤"]},
             {"type": "array", "items": {"type": "string"}, "maxItems": 4},
             {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}, "required": ["x"]},
             {"anyOf": [{"type": "string"}, {"type": "null"}]}]
    props = {f"{tag}_field_{i}": kinds[i % len(kinds)] for i in range(50)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


class Timer:
    """Wall time spent inside a method, accumulated (patched on the class for the run)."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name, self.seconds, self.calls = owner, name, 0.0, 0
        self.inner = getattr(owner, name)
        timer = self

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return timer.inner(*args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - start
                timer.calls += 1

        setattr(owner, name, timed)

    def take(self) -> float:
        seconds, self.seconds, self.calls = self.seconds, 0.0, 0
        return seconds


def run(llm: LLM, batch: int, new_tokens: int, extra: dict) -> float:
    params = [SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, **extra) for _ in range(batch)]
    start = time.perf_counter()
    done = llm.generate([PROMPT] * batch, params)
    assert all(len(d.token_ids) == new_tokens for d in done), [len(d.token_ids) for d in done]
    return time.perf_counter() - start


def rates(llm: LLM, batch: int, new_tokens: int, repeats: int, variants: dict[str, dict]) -> dict[str, float]:
    """Median decode tok/s per variant, runs interleaved."""
    for extra in variants.values():
        run(llm, batch, 4, extra)   # warm-up (and compile: the cache then holds the grammar)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, extra in variants.items():
            t_short, t_long = run(llm, batch, 1, extra), run(llm, batch, new_tokens, extra)
            samples[name].append(batch * (new_tokens - 1) / (t_long - t_short))
    return {name: statistics.median(values) for name, values in samples.items()}


def compile_times(llm: LLM) -> tuple[float, float, float]:
    """(reading the vocabulary, cold compile of a 50-property schema (median of 3 schemas), cached
    compile) in seconds."""
    compiler = GrammarCompiler(llm.tokenizer, llm.hf_config.vocab_size, llm.core.eos_token_ids)
    start = time.perf_counter()
    xgr_compiler = compiler._xgr_compiler()
    vocab_s = time.perf_counter() - start
    cold = []
    for tag in ("a", "b", "c"):
        xgr_compiler.clear_cache()
        start = time.perf_counter()
        compiler.compile(StructuredOutputs.json_schema(fifty_property_schema(tag)))
        cold.append(time.perf_counter() - start)
    start = time.perf_counter()
    compiler.compile(StructuredOutputs.json_schema(fifty_property_schema("c")))
    return vocab_s, statistics.median(cold), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(EngineArgs(model=args.model, kv_cache_gib=0.5), progress=False)
    spec = StructuredOutputs.json_schema(json.dumps(CATALOG))
    variants = {"free": {}, "json schema": {"structured_outputs": spec},
                "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
                              "logit_bias": {28: 1.0}}}
    print(f"model {llm.files.path.name}, torch threads {torch.get_num_threads()}, {args.new_tokens} new tokens, "
          f"median of {args.repeats}")
    print(f"{'batch':>5} | {'free tok/s':>10} | {'json schema tok/s':>17} | {'ratio':>6} | {'penalties tok/s':>15} | "
          f"{'ratio':>6}")
    for batch in args.batches:
        got = rates(llm, batch, args.new_tokens, args.repeats, variants)
        free = got["free"]
        print(f"{batch:>5} | {free:>10.1f} | {got['json schema']:>17.1f} | {got['json schema'] / free:>5.2f}x | "
              f"{got['penalties']:>15.1f} | {got['penalties'] / free:>5.2f}x")
    fill, apply = Timer(GrammarState, "bitmask"), Timer(ModelRunner, "_process_logits")
    for batch in args.batches:
        fill.take(), apply.take()
        wall = run(llm, batch, args.new_tokens, variants["json schema"])
        steps = apply.calls
        print(f"batch {batch:>2} constrained: {steps} steps, {1e3 * wall / steps:.1f} ms/step; bitmask fill "
              f"{1e3 * fill.take() / steps:.2f} ms/step, rank-0 mask apply {1e3 * apply.take() / steps:.2f} ms/step")
    vocab_s, cold_s, warm_s = compile_times(llm)
    print(f"grammar compile, 50-property schema: cold {1e3 * cold_s:.1f} ms, cached {1e3 * warm_s:.3f} ms "
          f"(reading the {llm.hf_config.vocab_size}-token vocabulary once: {1e3 * vocab_s:.0f} ms)")


if __name__ == "__main__":
    main()
