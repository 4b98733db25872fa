"""``shardserve`` command line: ``generate`` (one prompt, this process)."""

from __future__ import annotations

import argparse
import logging
import sys

from cluster.config import EngineArgs
from workers.model_source import DEFAULT_MODEL


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"known model name ({DEFAULT_MODEL}), a .gguf file or an HF checkpoint folder")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache budget per rank (GiB)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length cap (tokens)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-prefix-caching", action="store_true")


def _engine_args(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(model=ns.model, block_size=ns.block_size, kv_cache_gib=ns.kv_cache_gib,
                      max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
                      max_num_batched_tokens=ns.max_num_batched_tokens,
                      enable_prefix_caching=not ns.no_prefix_caching)


def _generate(ns: argparse.Namespace) -> int:

    from cluster.llm import LLM
    from cluster.request import SamplingParams

    llm = LLM(_engine_args(ns))
    prompt = [{"role": "user", "content": ns.prompt}] if ns.chat else ns.prompt
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            top_k=ns.top_k, seed=ns.seed, stop=ns.stop or [])
    (completion,) = llm.generate([prompt], params)
    sys.stdout.write(completion.text + "\n")
    logging.getLogger("shardserve").info("finish_reason=%s, %d prompt + %d output tokens",
                                         completion.finish_reason, len(completion.prompt_token_ids),
                                         len(completion.token_ids))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardserve", description="Ray-based tensor-parallel LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt in this process and print the text")
    _engine_flags(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template (prompt = user message)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardserve`` console script. Logs go to stderr, results to stdout."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as exc:
        print(f"shardserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
