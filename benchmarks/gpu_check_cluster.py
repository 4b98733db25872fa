"""gpu_check sections across processes: the NCCL communicator and the Ray worker group with async
scheduling (see ``benchmarks/gpu_check.py``)."""

from __future__ import annotations

import torch

from gpu_check_core import Context, Report, section


@section("nccl", "nccl: the CuPy NCCL communicator")
def nccl(ctx: Context, report: Report) -> None:
    if ctx.dry:
        report.not_run("nccl: 1-rank communicator, eager + captured", "no CUDA device (dry run)")
        report.not_run("nccl: multi-rank all-reduce / all-gather", "no CUDA device (dry run)")
        return
    with report.attempt("nccl: 1-rank communicator, eager + captured"):
        _one_rank(report)
    if torch.cuda.device_count() < 2:
        report.not_run("nccl: multi-rank all-reduce / all-gather", f"{torch.cuda.device_count()} GPU visible")
        return
    with report.attempt("nccl: multi-rank all-reduce / all-gather"):
        import torch.multiprocessing as mp

        from shardserve.workers.comm_nccl import nccl_unique_id

        mp.spawn(_nccl_rank, args=(nccl_unique_id(),), nprocs=2, join=True)
        report.check(True, "nccl: multi-rank all-reduce / all-gather", "2 ranks, eager + captured, values checked")


def _one_rank(report: Report) -> None:
    """A 1-rank group is the identity: this checks the CuPy binding and capture, not communication."""
    from shardserve.workers.comm_nccl import CupyNcclGroup, nccl_unique_id

    group = CupyNcclGroup(0, 1, nccl_unique_id())
    x = torch.randn(1024, 576, device="cuda", dtype=torch.bfloat16)
    ok = torch.equal(group.all_reduce(x.clone()), x) and torch.equal(group._all_gather_equal(x)[0], x)
    static, graph = torch.zeros(64, 128, device="cuda"), torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        group.all_reduce(static.clone() * 2)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = group.all_reduce(static * 2)
    static.copy_(torch.arange(64 * 128, device="cuda", dtype=torch.float32).view(64, 128))
    graph.replay()
    torch.cuda.synchronize()
    ok = ok and torch.equal(out, static * 2)
    group.close()
    report.check(ok, "nccl: 1-rank communicator, eager + captured", f"cupy NCCL on {torch.cuda.get_device_name()}")


def _nccl_rank(rank: int, uid) -> None:
    from shardserve.workers.comm_nccl import CupyNcclGroup

    torch.cuda.set_device(rank)
    group = CupyNcclGroup(rank, 2, uid)
    x = torch.full((4096,), float(rank + 1), device="cuda")
    assert torch.equal(group.all_reduce(x.clone()), torch.full_like(x, 3.0))
    gathered = group.all_gather(torch.full((8, 3 - rank), float(rank), device="cuda"), [3, 2])
    assert gathered.shape == (8, 5) and gathered[:, :3].eq(0).all() and gathered[:, 3:].eq(1).all()
    static, graph = torch.ones(1024, device="cuda") * (rank + 1), torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        group.all_reduce(static.clone())
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = group.all_reduce(static.clone())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 3.0))
    group.close()


@section("cluster", "cluster: the Ray worker group, async scheduling on")
def cluster(ctx: Context, report: Report) -> None:
    """A coordinator actor with its shard workers in a placement group (one GPU per rank), actor-call
    dispatch (async scheduling on), greedy and seeded requests == the single-process engine."""
    names = {tp: f"cluster: TP={tp} WorkerGroup on {ctx.device}, async scheduling" for tp in (1, 2)}
    try:
        import ray
    except ImportError as exc:
        for name in names.values():
            report.not_run(name, f"ray is not importable here ({exc})")
        return
    from gpu_check_models import make_llm

    from shardserve.cluster.config import EngineArgs
    from shardserve.cluster.engine.request import SamplingParams
    from shardserve.cluster.replica.coordinator import launch_coordinator, stop_coordinator
    from shardserve.cluster.replica.worker_group import GroupConfig

    num_gpus = 0 if ctx.dry else torch.cuda.device_count()
    path = ctx.tiny("llama", tokenizer=True)[0]
    prompts = [[0, 5, 9, 17, 33, 2], [0, 40, 41], [0, 7, 7, 8, 9, 10, 11, 12, 13]]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=1, temperature=0)]
    expected = [d.token_ids for d in make_llm(path, ctx, True).generate(prompts, params)]
    ray.init(num_cpus=8, num_gpus=num_gpus, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        for tp, name in names.items():
            if tp > max(num_gpus, 1):
                report.not_run(name, f"{tp} GPUs needed, {num_gpus} visible")
                continue
            with report.attempt(name):
                args = EngineArgs(model=str(path), tensor_parallel_size=tp, device=ctx.device, dtype="float32",
                                  num_blocks=64, max_num_seqs=8, gpu_memory_utilization=0.3 / tp)
                handle, pg = launch_coordinator(args, GroupConfig(tensor_parallel_size=tp, cpus_per_worker=1,
                                                                  gpus_per_worker=0 if ctx.dry else 1, dispatch="calls"))
                try:
                    done = ray.get([handle.complete.remote(p, sp) for p, sp in zip(prompts, params)], timeout=300)
                    info = ray.get(handle.model_info.remote(), timeout=60)
                finally:
                    stop_coordinator(handle, pg, timeout_s=60)
                got = [d["token_ids"] for d in done]
                report.check(got == expected and info["async_scheduling"], name,
                             f"tokens == single-process engine: {got == expected}, async scheduling "
                             f"{info['async_scheduling']}, collective {info['collective']}")
    finally:
        ray.shutdown()
