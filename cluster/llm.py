"""Single-process engine: tokenizer + local model runner + engine core, with a batch ``generate``."""

from __future__ import annotations

import time
from dataclasses import dataclass

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.engine.engine import EngineCore
from shardserve.cluster.engine.request import Logprob, SamplingParams, SpecUsage
from shardserve.cluster.engine.scheduler import SchedulerConfig
from shardserve.cluster.frontend.structured import GrammarCompiler
from shardserve.cluster.tokenizer import encode_chat, encode_prompt, eos_token_ids, load_tokenizer
from shardserve.cluster.replica.weight_swap import LocalHolder, ReloadResult, check_replacement, swap_weights
from shardserve.workers.checkpoint_compat import CheckpointManifest
from shardserve.workers.device import resolve_device
from shardserve.workers.model_runner import ModelRunner
from shardserve.workers.model_source import load_config, model_context_length, resolve_model


@dataclass(slots=True)
class Completion:
    """A finished request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[Logprob]
    spec_decode: SpecUsage | None = None    # its speculative decoding (speculation on)


class LLM:
    """Everything in this process (TP=1). The cluster's coordinator uses the same
    :class:`EngineCore` with Ray shard workers instead of the local runner.

    Args:
        args: engine arguments (``tensor_parallel_size`` must be 1 here).
        progress: show the weight-loading progress bar (stderr).
        drafter: the engine's draft hook: a draft model used instead of the checkpoint's MTP layer
            (any object with ``propose(DraftBatch) -> DraftResult``, e.g. a test oracle, proposing
            for greedy requests); needs ``args.speculative_tokens``. Without one, :attr:`mtp` is the
            checkpoint's MTP draft worker (tests may wrap it in :attr:`drafter` afterwards).
    """

    def __init__(self, args: EngineArgs, progress: bool = True, drafter=None) -> None:
        args.validate()
        if args.tensor_parallel_size != 1:
            raise ValueError("the single-process engine runs TP=1; use the cluster for tensor parallelism")
        resolve_device(args.device)   # --device cuda without a GPU fails here, before any model is read
        self.args = args
        self.files = resolve_model(args.model)
        self.hf_config = args.model_config(load_config(self.files))
        args.check_model_limits(self.hf_config)
        self.tokenizer = load_tokenizer(self.files)
        if drafter is not None and not args.speculative_tokens:
            raise ValueError("a drafter needs speculative_tokens >= 1")
        config, self.drafter, self.mtp = args.runner_config(), drafter, None
        if args.speculative_tokens and drafter is None:
            # the MTP draft model, on this thread, loaded first: its caches share the runner's block
            # ids, and its weights and caches count in the runner's plan (workers/plan.py)
            from shardserve.workers.draft_worker import DraftWorker

            self.drafter = self.mtp = DraftWorker(inline=True)
            self.mtp.load_weights(self.files, self.hf_config, args.draft_buffer_sizes(), args.block_size,
                                  args.dtype, seed=args.seed, device=args.device)
            self.mtp.release_buffer_name()   # one process: nobody else maps the buffers' shared file
            config.draft_on_device = True   # its weights and caches in this runner's plan
        self.runner = ModelRunner(self.files, self.hf_config, config, progress=progress)
        if not self.runner.num_blocks:
            self.runner.allocate_kv_cache(self.runner.max_num_blocks())
        max_len = args.fit_max_model_len(model_context_length(self.hf_config),
                                         self.runner.num_blocks)
        speculator = None
        if args.speculative_tokens:
            from shardserve.cluster.engine.speculative import Speculator

            if self.mtp is not None:
                self.mtp.allocate_caches(self.runner.num_blocks)
                self.runner.attach_draft_buffers(self.mtp.buffers)
            speculator = Speculator(self.drafter, args.speculative_tokens, args.speculative_policy)
        eos_ids = eos_token_ids(self.tokenizer, self.hf_config)
        self.core = EngineCore(
            self.runner, self.tokenizer, self.runner.num_blocks, args.block_size,
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max_len,
                            max_prefill_tokens=args.prefill_budget(self.runner.device.type == "cpu")),
            eos_ids, self.hf_config.vocab_size, args.enable_prefix_caching, speculator=speculator,
            num_state_slots=self.runner.num_state_slots,
            grammar_compiler=GrammarCompiler(self.tokenizer, self.hf_config.vocab_size, eos_ids))
        self.weights_version = 1   # +1 per reload that changed a tensor

    def reload_weights(self, model: str | None = None) -> ReloadResult:
        """Hot-swap the weights that changed, in place, between :meth:`generate` calls (see
        :mod:`cluster.replica.weight_swap`); the prefix cache and every KV / indexer / draft cache are dropped.

        Args:
            model: the new checkpoint (default: the served files, changed on disk).

        Raises:
            InvalidCheckpoint: it cannot replace the served weights (nothing was changed).
        """
        started = time.monotonic()
        owners = [self.runner] + ([self.mtp] if self.mtp is not None else [])
        shapes = {name: shape for owner in owners for name, shape in owner.weight_record.shapes.items()}
        served = CheckpointManifest.from_config(self.files.path, self.hf_config, shapes)
        files, _ = check_replacement(served, model or str(self.files.path))
        changed, unchanged = swap_weights([LocalHolder(owners)], files)
        self.core.drop_cached_prefixes()
        self.files = files
        self.weights_version += bool(changed)
        return ReloadResult(len(changed), len(unchanged), time.monotonic() - started, self.weights_version)

    def encode(self, prompt: str | list[int] | list[dict]) -> list[int]:
        """Token ids of a raw prompt (str), a chat (list of messages), or ids as given."""
        if isinstance(prompt, str):
            return encode_prompt(self.tokenizer, prompt)
        if prompt and isinstance(prompt[0], dict):
            return encode_chat(self.tokenizer, prompt)
        return list(prompt)

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run all ``prompts`` together (continuous batching) to completion, in input order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.core.add_request(self.encode(p), sp) for p, sp in zip(prompts, params_list)]
        results = {i: Completion(i, self.core.requests[i].request.prompt_token_ids, [], "", None, []) for i in ids}
        while self.core.has_unfinished():
            for out in self.core.step():
                done = results[out.request_id]
                done.token_ids += out.new_token_ids
                done.text += out.new_text
                done.logprobs += out.new_logprobs
                done.spec_decode = out.spec_decode
                if out.finished:
                    done.finish_reason = out.finish_reason
        return [results[i] for i in ids]
