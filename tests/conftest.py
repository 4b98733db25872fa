"""Shared fixtures: the real SmolLM2 GGUF (fetched once into the shardserve cache), our engine on
it, and transformers' model on the same file as the oracle."""

from __future__ import annotations

import os

import pytest
import torch

# Compiled forwards in tests (and the processes they start) keep Inductor's size/stride asserts,
# which a served one leaves out (workers/compilation.py): a fake that disagrees with its op fails here.
os.environ.setdefault("SHARDSERVE_COMPILE_ASSERTS", "1")


@pytest.fixture(scope="session")
def smollm2_files():
    from shardserve.workers.model_source import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_files):
    """Our engine on the exact path (``dtype="float32"``: weights dequantized as transformers does),
    the one compared with transformers token for token."""
    from shardserve.cluster.config import EngineArgs
    from shardserve.cluster.llm import LLM

    return LLM(EngineArgs(model=str(smollm2_files.path), kv_cache_gib=0.25, dtype="float32"), progress=False)


@pytest.fixture(scope="session")
def smollm2_llm_packed(smollm2_files):
    """Our engine with its defaults on CPU: packed Q4_1 / Q8_0 weights, bfloat16 compute."""
    from shardserve.cluster.config import EngineArgs
    from shardserve.cluster.llm import LLM

    return LLM(EngineArgs(model=str(smollm2_files.path), kv_cache_gib=0.05), progress=False)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_files):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_files.folder), gguf_file=smollm2_files.path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster with 8 logical CPUs (enough bundles for TP=3 + a coordinator on
    this 2-core machine), whose Serve ingress is what ``shardserve serve`` starts by default (Ray
    Serve's HAProxy, cluster/ingress.py); shut down at the end of the session, even on failure."""
    import os
    from unittest import mock

    import ray

    from shardserve.cluster.ingress import controller_env, ingress_env

    env = {**ingress_env("haproxy", local=True), **controller_env()}   # as `shardserve serve` sets them
    with mock.patch.dict(os.environ, env):   # read by the processes it starts
        ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


class Replicas:
    """Starts coordinators (+ shard workers, in their own placement group) and always stops them."""

    def __init__(self, ray_mod) -> None:
        self.ray = ray_mod
        self.groups: dict = {}

    def launch(self, args, group):
        from shardserve.cluster.replica.coordinator import launch_coordinator

        handle, pg = launch_coordinator(args, group)
        self.groups[handle] = pg
        return handle

    def stop(self, handle) -> None:
        """Shut a replica down and release its placement group (frees its CPUs for the next)."""
        from shardserve.cluster.replica.coordinator import stop_coordinator

        stop_coordinator(handle, self.groups.pop(handle), timeout_s=60)

    def stop_all(self) -> None:
        for handle in list(self.groups):
            self.stop(handle)


@pytest.fixture(scope="session")
def replicas(ray_cluster):
    """:class:`Replicas` for the session; whatever is still running is stopped at the end."""
    manager = Replicas(ray_cluster)
    try:
        yield manager
    finally:
        manager.stop_all()
