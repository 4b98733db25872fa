"""Async scheduling on a real Ray cluster (actor calls): the coordinator sends step N+1 before step
N's tokens are back, and rank 0 fills each decode's placeholder with its own sample (and shares it
with the other ranks at TP=2). Outputs
must be exactly the single-process engine's (float32, SmolLM2), through everything that ends or
interrupts a request between a step's send and its result: EOS, max_tokens, a stop string, seeded
sampling (its per-request RNG stream is indexed by the output position, placeholders included),
preemption when the KV pool runs out, and a client that cancels mid-stream; the next turn of a chat
finds the prompt's and the answer's blocks in the prefix cache; structured outputs
(a constrained request waits for its token in flight) and penalties (rank 0's counts include its
own samples) give the single-process engine's tokens too."""

from __future__ import annotations

import grpc
import pytest

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.engine.request import SamplingParams, StructuredOutputs
from shardserve.cluster.replica.worker_group import GroupConfig
from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc
from procs import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = ["Once upon a time, in a small village,", "The capital of France is", "def fibonacci(n):\n    ",
           "Three primary colors are", "The history of the Roman Empire", "1, 2, 3, 4,",
           "The best way to learn a language is", "Water boils at", "A cat as JSON:", "Describe the sea:",
           "Once upon a time, in a small village,"]
CAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
       "required": ["name", "age"], "additionalProperties": False}
PARAMS = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=30, temperature=0),                      # may end on EOS
          SamplingParams(max_tokens=24, temperature=0, stop=["\n"]),          # a stop string
          SamplingParams(max_tokens=33, temperature=0.9, seed=11),            # seeded sampling
          SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=48, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=1, temperature=0),                        # done by the prefill step
          SamplingParams(max_tokens=27, temperature=0.7, top_k=20, seed=3),
          # structured outputs (a constrained request does not run ahead) and rank 0's penalty state
          SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputs.json_schema(CAT)),
          SamplingParams(max_tokens=24, temperature=0.8, seed=5, structured_outputs=StructuredOutputs.regex(
              r"[A-Z][a-z]{2,8}( [a-z]{2,8}){2,5}\.")),
          SamplingParams(max_tokens=30, temperature=0, presence_penalty=0.8, frequency_penalty=0.3,
                         repetition_penalty=1.2, logit_bias={28: 5.0}, min_tokens=6)]


@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.extended), 2])   # TP=2 also shares placeholders
def test_async_scheduling_matches_the_single_process_engine(ray_cluster, replicas, smollm2_files, smollm2_llm, tp):
    """6 KV blocks of 16 tokens hold a fraction of the 8 requests at once: requests are preempted
    and recomputed, some while a step that samples for them is in flight."""
    ids = [smollm2_llm.encode(p) for p in PROMPTS]
    expected = [(d.token_ids, d.text, d.finish_reason) for d in smollm2_llm.generate(ids, PARAMS)]
    assert {reason for *_, reason in expected} == {"length", "stop"}
    args = EngineArgs(model=str(smollm2_files.path), num_blocks=6, dtype="float32",
                      tensor_parallel_size=tp)
    handle = replicas.launch(args, GroupConfig(cpus_per_worker=1, dispatch="calls"))
    try:
        assert ray_cluster.get(handle.model_info.remote())["async_scheduling"]
        done = ray_cluster.get([handle.complete.remote(x, p) for x, p in zip(ids, PARAMS)])
        assert [(d["token_ids"], d["text"], d["finish_reason"]) for d in done] == expected
        info = ray_cluster.get(handle.model_info.remote())
        assert info["num_preemptions"] > 0, f"the pool was meant to run out: {info}"
        assert info["num_free_blocks"] == info["num_blocks"] and not info["num_running"]
        # A gRPC stream cancelled after 3 tokens gives its blocks back; the next request is unaffected.
        address = ray_cluster.get(handle.start_grpc.remote(0, "127.0.0.1"))
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            call = pb_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=ids[5]), sampling=pb.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)))
            streamed = []
            for response in call:
                streamed += response.token_ids
                if len(streamed) >= 3:
                    call.cancel()
                    break
        assert streamed[:3] == expected[5][0][:3]
        again = ray_cluster.get(handle.complete.remote(ids[0], PARAMS[0]))
        assert again["token_ids"] == expected[0][0]
        wait_for("the cancelled stream's blocks back", lambda: _all_blocks_free(ray_cluster, handle), 30)
        # The chat's next turn (the prompt and its answer) reuses every full block from the prefix cache:
        # blocks filled while decoding are registered, and a prefill's blocks while a step is sent ahead.
        turn, follow = ids[0] + expected[0][0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        hits = ray_cluster.get(handle.model_info.remote())["prefix_cache_hit_tokens"]
        assert ray_cluster.get(handle.complete.remote(turn, follow))["token_ids"] == \
            smollm2_llm.generate([turn], [follow])[0].token_ids
        hit = ray_cluster.get(handle.model_info.remote())["prefix_cache_hit_tokens"] - hits
        assert hit == (len(turn) - 1) // 16 * 16 >= 32, (hit, len(turn))
    finally:
        replicas.stop(handle)


def _all_blocks_free(ray_cluster, handle) -> bool:
    info = ray_cluster.get(handle.model_info.remote())
    return info["num_free_blocks"] == info["num_blocks"]
