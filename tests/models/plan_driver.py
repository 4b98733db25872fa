"""Drive a :class:`ModelRunner` with hand-made step plans, as the coordinator would.

Blocks come from a shuffled free list, so sequences own scattered, interleaved blocks (a paging
bug shows up as wrong logits instead of hiding behind contiguous block ids).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from shardserve.workers.forward_context import forward_context
from shardserve.workers.messages import NewRequestData, SamplingOptions, ScheduledRequest, StepPlan
from shardserve.workers.model_runner import ModelRunner, RunnerConfig
from shardserve.workers.model_source import ModelFiles, load_config
from shardserve.workers.models import dsa_indexer


def make_runner(path: str | Path, block_size: int = 4, num_blocks: int = 96, tensor_split=None,
                decode_graphs: str = "auto", compile: str = "off", attention_dp_size: int = 1,
                moe_a2a: str = "allgather", **switches) -> ModelRunner:
    """A runner for the checkpoint at ``path``; ``decode_graphs`` is the runner's setting ("replay":
    the CPU stand-in of CUDA graphs); ``compile``, ``attention_dp_size`` and ``moe_a2a`` are
    :class:`RunnerConfig`'s; ``switches`` set ``shardserve_<name>`` on the model config
    (``dsa=False``, ``dsa_top_k=4``, ``hadamard=False``)."""
    files = ModelFiles(Path(path).name, Path(path))
    config = load_config(files)
    for name, value in switches.items():
        setattr(config, f"shardserve_{name}", value)
    return ModelRunner(files, config, RunnerConfig(block_size=block_size, num_blocks=num_blocks,
                                                   tensor_split=tensor_split, decode_graphs=decode_graphs,
                                                   compile=compile, attention_dp_size=attention_dp_size,
                                                   moe_a2a=moe_a2a), progress=False)


class PlanDriver:
    """Keeps each request's tokens and blocks and turns ``{req_id: new token ids}`` into plans."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.free = torch.randperm(runner.num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tokens: dict[str, list[int]] = {}
        self.num_blocks: dict[str, int] = {}
        self.free_slots = list(range(runner.num_state_slots))   # recurrent-state slots (hybrid models)
        self.slots: dict[str, int | None] = {}
        self.finished: list[str] = []

    def finish(self, *req_ids: str) -> None:
        """End these requests: the next plan lists them as finished and their state slots are free
        (their blocks are not reused)."""
        for req_id in req_ids:
            slot = self.slots.pop(req_id)
            if slot is not None:
                self.free_slots.append(slot)
        self.finished += req_ids

    def plan(self, work: dict[str, list[int]]) -> StepPlan:
        """One step computing ``work[req]`` for each request, every one sampling its last token."""
        plan = StepPlan(finished_req_ids=self.finished)
        self.finished = []
        for req_id, token_ids in work.items():
            if req_id not in self.tokens:
                slot = self.slots[req_id] = self.free_slots.pop() if self.free_slots else None
                plan.new_requests.append(NewRequestData(req_id, SamplingOptions(temperature=0), slot))
                self.tokens[req_id], self.num_blocks[req_id] = [], 0
            start = len(self.tokens[req_id])
            needed = math.ceil((start + len(token_ids)) / self.runner.block_size) - self.num_blocks[req_id]
            new_blocks = [self.free.pop() for _ in range(needed)]
            self.num_blocks[req_id] += needed
            self.tokens[req_id].extend(token_ids)
            plan.scheduled.append(ScheduledRequest(req_id, list(token_ids), start, new_blocks, True, 0))
        return plan

    def step(self, work: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Run one step; the last-token logits ``[vocab]`` of each request."""
        logits = self.runner.compute_logits(self.plan(work))
        return {req_id: logits[i] for i, req_id in enumerate(work)}

    @torch.inference_mode()
    def step_all_rows(self, work: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Run one step; logits of every computed token, ``[len(work[req]), vocab]`` per request."""
        plan = self.plan(work)
        runner = self.runner
        runner._apply_plan(plan)
        input_ids, meta, _ = runner._prepare_inputs(plan)
        with forward_context(meta):
            hidden = runner.model(input_ids, meta.positions)
        logits = runner.model.compute_logits(hidden)
        bounds = meta.query_start_loc.tolist()
        return {req_id: logits[bounds[i]:bounds[i + 1]] for i, req_id in enumerate(work)}

    def greedy(self, first: dict[str, torch.Tensor],
               steps: int) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Decode ``steps`` greedy tokens for every request in ``first`` (its last logits) together.

        Returns:
            the generated ids per request and the logits ``[steps, vocab]`` that produced
            tokens 2..steps+1 (the first token comes from ``first``).
        """
        generated = {req: [int(logits.argmax())] for req, logits in first.items()}
        decode_logits: dict[str, list[torch.Tensor]] = {req: [] for req in first}
        for _ in range(steps):
            out = self.step({req: [ids[-1]] for req, ids in generated.items()})
            for req, logits in out.items():
                decode_logits[req].append(logits)
                generated[req].append(int(logits.argmax()))
        vocab = next(iter(first.values())).shape[-1]
        return generated, {req: torch.stack(rows) if rows else torch.empty(0, vocab)
                           for req, rows in decode_logits.items()}


@torch.no_grad()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits ``[len(token_ids), vocab]`` float32 for one sequence (no cache)."""
    return model(torch.tensor([token_ids])).logits[0].float()


@contextmanager
def recorded_indexer_calls() -> Iterator[list[tuple[tuple, dict]]]:
    """Within the block, record the ``(args, kwargs)`` of every :func:`kernels.indexer_topk` call
    the DSA indexers make, in call order (layer by layer; the call still runs)."""
    calls: list[tuple[tuple, dict]] = []
    original = dsa_indexer.indexer_topk

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    dsa_indexer.indexer_topk = record
    try:
        yield calls
    finally:
        dsa_indexer.indexer_topk = original
