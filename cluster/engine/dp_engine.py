"""Engine of a replica with data-parallel attention (issue 29): one :class:`EngineCore` per
attention group.

Each attention group owns its own KV + indexer cache pool (the per-rank budget), so it gets its
own block manager and scheduler: the existing :class:`cluster.engine.engine.EngineCore`, composed
here rather than rewritten, so preemption, prefix caching, chunked prefill, stop handling and
async-scheduling placeholders work per group exactly as in plain TP. What is added:

- placement: a new request goes to the group holding the longest cached prefix of its prompt
  (whole blocks, the block manager's own lookup), else to the least-loaded group (fewest
  unfinished requests, then most free blocks, then the lowest index); it stays there for life
  (preemption recomputes it in the same group);
- one step = every group's batch in one :class:`workers.messages.DataParallelPlan` (a group with
  nothing to run sends an empty plan and still joins the MoE exchange), answered by a
  :class:`workers.messages.DataParallelResult` whose per-group results go back to their cores.

The object offers the part of ``EngineCore``'s interface the coordinator and ``cluster/llm.py``
use, with replica-wide views (:class:`PooledBlocks`, :class:`PooledSchedulers`): block counts,
free blocks and prefix hits are sums over the groups, so the reported KV capacity is D times a
group's.

MTP speculative decoding is refused with DP attention (:data:`MTP_REFUSAL`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace

from shardserve.cluster.engine.engine import EngineCore, RequestOutput
from shardserve.cluster.engine.scheduler import ScheduledBatch, SchedulerConfig
from shardserve.workers.messages import DataParallelPlan, DataParallelResult, StepPlan, StepResult

MTP_REFUSAL = ("--speculative-tokens with --enable-dp-attention is not supported yet: the MTP draft worker "
               "mirrors one block pool, and each attention group has its own")


@dataclass(slots=True)
class DataParallelBatch:
    """One step of every group: each core's :class:`ScheduledBatch` and the plan sent to the ranks."""

    batches: list[ScheduledBatch]
    plan: DataParallelPlan = field(init=False)

    def __post_init__(self) -> None:
        self.plan = DataParallelPlan([batch.plan for batch in self.batches])

    @property
    def requests(self) -> list:
        return [request for batch in self.batches for request in batch.requests]


def _summed(parts: str, name: str) -> property:
    """A read-only property: ``name`` summed over the per-group objects in ``self.<parts>``."""
    return property(lambda self: sum(getattr(part, name) for part in getattr(self, parts)),
                    doc=f"``{name}`` summed over the attention groups")


class PooledBlocks:
    """The groups' block managers seen as one pool (ModelInfo, metrics, the router's cache events).

    NOTE: the cache events are the union of the groups' streams; a hash one group drops while
    another still holds it is reported removed (the router's view of prefix hits is a hint).
    """

    def __init__(self, cores: list[EngineCore]) -> None:
        self._managers = [core.block_manager for core in cores]
        self.block_size = self._managers[0].block_size

    num_blocks = _summed("_managers", "num_blocks")
    num_free_blocks = _summed("_managers", "num_free_blocks")
    prefix_hits = _summed("_managers", "prefix_hits")
    prefix_queries = _summed("_managers", "prefix_queries")

    @property
    def events(self):
        return None if all(bm.events is None for bm in self._managers) else [e for bm in self._managers
                                                                            for e in bm.events or []]

    @events.setter
    def events(self, value) -> None:
        for bm in self._managers:
            bm.events = value if value is None else []

    def listen(self) -> list[int]:
        return sorted({digest for bm in self._managers for digest in bm.listen()})

    def take_events(self) -> list[tuple[int, int]]:
        return [event for bm in self._managers for event in bm.take_events()]

    def reset_prefix_cache(self) -> None:
        for bm in self._managers:
            bm.reset_prefix_cache()


class PooledSchedulers:
    """The groups' schedulers seen as one (queue lengths, preemptions, admission pause)."""

    def __init__(self, cores: list[EngineCore]) -> None:
        self._schedulers = [core.scheduler for core in cores]

    @property
    def admit_new(self) -> bool:
        return self._schedulers[0].admit_new

    @admit_new.setter
    def admit_new(self, value: bool) -> None:
        for scheduler in self._schedulers:
            scheduler.admit_new = value

    @property
    def running(self) -> list:
        return [r for s in self._schedulers for r in s.running]

    @property
    def waiting(self) -> list:
        return [r for s in self._schedulers for r in s.waiting]

    num_preemptions = _summed("_schedulers", "num_preemptions")
    num_unfinished = _summed("_schedulers", "num_unfinished")


class DataParallelEngine:
    """``num_groups`` :class:`EngineCore` s (one per attention group) behind one executor.

    Args:
        executor: runs a :class:`DataParallelPlan` on every rank and returns a
            :class:`DataParallelResult` (``cluster/replica/worker_group.py``).
        num_groups: attention groups ``D`` (>= 2).
        num_blocks: KV blocks of *one* group (every group has the per-rank budget).
        scheduler_config: the replica's limits: each group's scheduler gets ``max_num_seqs // D``
            sequences and ``max_num_batched_tokens // D`` tokens a step (SGLang divides
            ``chunked_prefill_size`` and ``max_running_requests`` by the DP size), so one step of all
            groups stays within the replica's budget, which sizes the ranks' exchange buffers.
        Other arguments: as :class:`EngineCore`.

    Raises:
        ValueError: a speculator (MTP) was given (:data:`MTP_REFUSAL`); a budget below one
            sequence or token per group.
    """

    def __init__(self, executor, tokenizer, num_blocks: int, block_size: int, scheduler_config: SchedulerConfig,
                 eos_token_ids: set[int], vocab_size: int, enable_prefix_caching: bool = True, *,
                 num_groups: int, speculator=None, num_state_slots: int = 0, grammar_compiler=None) -> None:
        if speculator is not None:
            raise ValueError(MTP_REFUSAL)
        assert num_groups >= 2, f"num_groups={num_groups}: one group is plain TP (EngineCore)"
        self.executor = executor
        per_group = dataclasses.replace(scheduler_config, max_num_seqs=scheduler_config.max_num_seqs // num_groups,
                                        max_num_batched_tokens=scheduler_config.max_num_batched_tokens // num_groups)
        if not per_group.max_num_seqs or not per_group.max_num_batched_tokens:
            raise ValueError(f"a step budget of {scheduler_config.max_num_seqs} sequences and "
                             f"{scheduler_config.max_num_batched_tokens} tokens leaves nothing for each of "
                             f"{num_groups} attention groups")
        self.cores = [EngineCore(executor, tokenizer, num_blocks, block_size, dataclasses.replace(per_group),
                                 eos_token_ids, vocab_size, enable_prefix_caching, num_state_slots=num_state_slots,
                                 grammar_compiler=grammar_compiler) for _ in range(num_groups)]
        self.tokenizer, self.vocab_size, self.grammar_compiler = tokenizer, vocab_size, grammar_compiler
        self.speculator = None
        self.max_model_len = self.cores[0].max_model_len
        self.block_manager = PooledBlocks(self.cores)
        self.scheduler = PooledSchedulers(self.cores)
        self.requests = collections.ChainMap(*[core.requests for core in self.cores])   # id -> tracked request
        self.group_of: dict[str, int] = {}   # unfinished request id -> its attention group
        self.num_placed = [0] * num_groups   # requests placed on each group so far
        self._ids = itertools.count()

    # -- requests ---------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params) -> None:
        """Raises ValueError for a request the engine cannot serve (:meth:`EngineCore.validate`)."""
        self.cores[0].validate(prompt_token_ids, params)

    def place(self, prompt_token_ids: list[int], cache_seed: int = 0) -> int:
        """The attention group for a new request: the longest cached prefix, else the least loaded."""
        probe = SimpleNamespace(all_token_ids=prompt_token_ids, cache_seed=cache_seed)
        hits = [core.block_manager.get_computed_blocks(probe)[1] for core in self.cores]
        load = [(-hits[g], core.scheduler.num_unfinished, -core.block_manager.num_free_blocks, g)
                for g, core in enumerate(self.cores)]
        return min(load)[3]

    def add_request(self, prompt_token_ids: list[int], params, request_id: str | None = None,
                    cache_seed: int = 0, compiled_grammar=None) -> str:
        """Queue a request on the group :meth:`place` picks; returns its id.

        Raises:
            ValueError: as :meth:`EngineCore.add_request` (also for an id in use in any group).
        """
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.group_of:
            raise ValueError(f"request id {request_id!r} is already in use")
        group = self.place(prompt_token_ids, cache_seed)
        self.cores[group].add_request(prompt_token_ids, params, request_id, cache_seed, compiled_grammar)
        self.group_of[request_id] = group
        self.num_placed[group] += 1
        return request_id

    def abort(self, request_id: str) -> None:
        """Cancel a request and free its blocks (no-op for unknown or finished ids)."""
        group = self.group_of.pop(request_id, None)
        if group is not None:
            self.cores[group].abort(request_id)

    def has_unfinished(self) -> bool:
        return any(core.has_unfinished() for core in self.cores)

    def has_started(self) -> bool:
        return any(core.has_started() for core in self.cores)

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> DataParallelBatch:
        """Every group's batch (``plan.scheduled`` is empty when no group has anything to run)."""
        return DataParallelBatch([core.schedule() for core in self.cores])

    def update(self, batch: DataParallelBatch, result: DataParallelResult) -> list[RequestOutput]:
        """Hand each group's result to its core; the deltas of every group."""
        outputs = []
        for core, group_batch, group_result in zip(self.cores, batch.batches, result.results):
            outputs += core.update(group_batch, group_result or StepResult())
        return self._forget_finished(outputs)

    def step(self) -> list[RequestOutput]:
        """Schedule every group, execute (blocking), update."""
        batch = self.schedule()
        if not batch.plan.scheduled:
            return []
        return self.update(batch, self.executor.execute(batch.plan))

    def _forget_finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            if out.finished:
                self.group_of.pop(out.request_id, None)
        return outputs

    # -- probes, reload and recovery -------------------------------------------------------------
    def probe_plan(self, prompt_ids: list[int]) -> tuple[DataParallelPlan, object]:
        """:meth:`EngineCore.probe_plan` on group 0 (the others idle); the logits come back in
        ``result.results[0]``.

        Raises:
            ValueError: as :meth:`EngineCore.probe_plan`.
        """
        plan, probe = self.cores[0].probe_plan(prompt_ids)
        return DataParallelPlan([plan] + [StepPlan() for _ in self.cores[1:]]), probe

    def release_probe(self, probe) -> None:
        self.cores[0].release_probe(probe)

    def interrupt_started(self, message: str) -> list[RequestOutput]:
        return self._forget_finished([out for core in self.cores for out in core.interrupt_started(message)])

    def drop_cached_prefixes(self) -> None:
        for core in self.cores:
            core.drop_cached_prefixes()

    def reset_after_worker_loss(self) -> None:
        for core in self.cores:
            core.reset_after_worker_loss()

    def fail_all(self, message: str) -> list[RequestOutput]:
        return self._forget_finished([out for core in self.cores for out in core.fail_all(message)])


def make_engine(num_groups: int, executor, *args, **kwargs) -> EngineCore | DataParallelEngine:
    """:class:`EngineCore` for plain TP (``num_groups == 1``), else :class:`DataParallelEngine`
    (same arguments as :class:`EngineCore`)."""
    if num_groups == 1:
        return EngineCore(executor, *args, **kwargs)
    return DataParallelEngine(executor, *args, num_groups=num_groups, **kwargs)
