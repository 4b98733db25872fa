"""The gRPC API of a running TP=2 replica on a real Ray cluster, through the generated stubs:
streaming, concurrency, cancellation, bad input, health, reflection, and a worker dying."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.replica.worker_group import GroupConfig
from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.ray, pytest.mark.slow]
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server(ray_cluster, replicas, smollm2_files):
    # recovery_timeout: far too short for a replacement rank to load, so the death test ends failed
    args = EngineArgs(model=str(smollm2_files.path), tensor_parallel_size=2, kv_cache_gib=0.05,
                      max_model_len=MAX_MODEL_LEN, recovery_timeout=0.5,
                      dtype="float32")   # compared with smollm2_llm
    handle = replicas.launch(args, GroupConfig(cpus_per_worker=1))
    address = ray_cluster.get(handle.start_grpc.remote(0, "127.0.0.1"))
    channel = grpc.insecure_channel(address)
    grpc.channel_ready_future(channel).result(timeout=60)
    try:
        yield handle, channel
    finally:
        channel.close()
        replicas.stop(handle)


def stub(server):
    return pb_grpc.InferenceStub(server[1])


def chat(text):
    return pb.Chat(messages=[pb.ChatMessage(role="user", content=text)])


def collect(responses):
    tokens, text, last = [], "", None
    for resp in responses:
        tokens += list(resp.token_ids)
        text += resp.text
        last = resp
    return tokens, text, last


def free_blocks_return_to_total(server, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = stub(server).ModelInfo(pb.ModelInfoRequest())
        if info.num_free_blocks == info.num_blocks and info.num_running == 0:
            return True
        time.sleep(0.05)
    return False


def test_health_and_reflection(server):
    health = health_pb2_grpc.HealthStub(server[1])
    for service in ("", "shardserve.v1.Inference"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(server[1])
    (answer,) = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in answer.list_services_response.service}
    assert {"shardserve.v1.Inference", "grpc.health.v1.Health"} <= names


def test_stream_matches_single_process_engine(server, smollm2_llm):
    request = pb.GenerateRequest(chat=chat("What is the capital of France?"),
                                 sampling=pb.SamplingParams(max_tokens=16, temperature=0.0, logprobs=2))
    responses = list(stub(server).Generate(request))
    tokens, text, last = collect(responses)
    (expected,) = smollm2_llm.generate([[{"role": "user", "content": "What is the capital of France?"}]],
                                       SamplingParams(max_tokens=16, temperature=0.0))
    assert len(responses) > 1 and tokens == expected.token_ids and text == expected.text
    assert "Paris" in text and last.finish_reason == expected.finish_reason
    prompt = stub(server).Tokenize(pb.TokenizeRequest(chat=chat("What is the capital of France?"))).token_ids
    assert last.usage.prompt_tokens == len(prompt) and last.usage.completion_tokens == len(tokens)
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert [lp.token_id for lp in logprobs] == tokens and all(len(lp.top) == 2 for lp in logprobs)


def test_eight_concurrent_streams_match_one_at_a_time(server):
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]

    def run(text):
        request = pb.GenerateRequest(chat=chat(text), sampling=pb.SamplingParams(max_tokens=12, temperature=0.0))
        return collect(stub(server).Generate(request))[:2]

    alone = [run(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, prompts))
    assert together == alone
    assert free_blocks_return_to_total(server)


def test_cancelled_stream_frees_its_blocks(server):
    request = pb.GenerateRequest(text="Tell me a very long story.",
                                 sampling=pb.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    call = stub(server).Generate(request)
    for i, _ in enumerate(call):
        if i == 3:
            call.cancel()
            break
    info = stub(server).ModelInfo(pb.ModelInfoRequest())
    assert info.num_blocks > 0
    assert free_blocks_return_to_total(server)


@pytest.mark.parametrize("request_kwargs,message", [
    ({"text": ""}, "prompt must not be empty"),
    ({"text": "hi", "sampling": pb.SamplingParams(max_tokens=-1)}, "max_tokens must be at least 1"),
    ({"text": "hi", "sampling": pb.SamplingParams(temperature=-1)}, "temperature"),
    ({"text": "hi", "sampling": pb.SamplingParams(temperature=2.5)}, "temperature must be in [0, 2]"),
    ({"text": "hi", "sampling": pb.SamplingParams(stop=list("abcde"))}, "at most 4 stop strings"),
    ({"token_ids": pb.TokenIds(ids=[42] * (MAX_MODEL_LEN + 10))}, f"context length is {MAX_MODEL_LEN}"),
    ({"text": "hi", "sampling": pb.SamplingParams(max_tokens=MAX_MODEL_LEN)}, "max_tokens asks for 512 more"),
    ({"chat": pb.Chat()}, "'messages' must be a non-empty list"),
    ({"text": "hi", "sampling": pb.SamplingParams(structured_outputs=pb.StructuredOutputs(json='{"type": "objekt"}'))},
     'structured_outputs: the JSON schema does not compile: Unsupported type "objekt"'),
    ({"text": "hi", "sampling": pb.SamplingParams(structured_outputs=pb.StructuredOutputs())},
     "structured_outputs: set one of json"),
    ({"text": "hi", "sampling": pb.SamplingParams(logit_bias={49152: 1.0})},
     "logit_bias: token id 49152 is outside the vocabulary [0, 49152)"),
    ({"text": "hi", "sampling": pb.SamplingParams(presence_penalty=3)}, "presence_penalty must be in [-2, 2]"),
])
def test_bad_input_is_invalid_argument_and_server_keeps_serving(server, request_kwargs, message):
    with pytest.raises(grpc.RpcError) as err:
        list(stub(server).Generate(pb.GenerateRequest(**request_kwargs)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    tokens, _, last = collect(stub(server).Generate(pb.GenerateRequest(
        text="Hello", sampling=pb.SamplingParams(max_tokens=2, temperature=0.0))))
    assert len(tokens) == 2 and last.finish_reason == "length"


def test_constrained_stream_over_grpc_matches_the_engine(server, smollm2_llm):
    from shardserve.cluster.engine.request import StructuredOutputs

    schema = '{"type": "object", "properties": {"capital": {"enum": ["Paris", "Lyon"]}}, "required": ["capital"]}'
    sampling = pb.SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.2,
                                 structured_outputs=pb.StructuredOutputs(json=schema, disable_any_whitespace=True))
    tokens, text, last = collect(stub(server).Generate(pb.GenerateRequest(chat=chat("What is the capital of France?"),
                                                                          sampling=sampling)))
    (expected,) = smollm2_llm.generate([[{"role": "user", "content": "What is the capital of France?"}]],
                                       SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.2,
                                                      structured_outputs=StructuredOutputs.json_schema(schema, True)))
    assert (tokens, text) == (expected.token_ids, expected.text)
    assert json.loads(text)["capital"] in ("Paris", "Lyon") and "\n" not in text   # one line
    assert last.finish_reason == "stop" and stub(server).ModelInfo(pb.ModelInfoRequest()).num_grammar_matchers == 0


def test_model_info(server, ray_cluster):
    info = stub(server).ModelInfo(pb.ModelInfoRequest())
    assert (info.architecture, info.tensor_parallel_size, info.max_model_len) == ("LlamaForCausalLM", 2, MAX_MODEL_LEN)
    assert info.vocab_size == 49152 and info.healthy and info.collective == "shm"
    # The ranks have mapped the all-reduce segment, and its name is already gone: however Ray stops
    # them (`ray stop`, SIGKILL), nothing is left in /dev/shm.
    name = ray_cluster.get(server[0].__ray_call__.remote(lambda coordinator: coordinator.group._segments[0].name))
    assert name and not (Path("/dev/shm") / name).exists()


def test_worker_death_ends_streams_with_unavailable_and_a_repair_out_of_time_fails_the_replica(server, ray_cluster):
    """Last in this module: kills a shard worker mid-stream. The in-place repair cannot finish within
    the recovery timeout (as when the rank's node is gone), so the replica gives up and its health
    check fails (under Serve, the replica is then replaced)."""
    handle, channel = server
    pids = ray_cluster.get(handle.worker_pids.remote())
    request = pb.GenerateRequest(text="Count to one thousand:",
                                 sampling=pb.SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
    call = stub(server).Generate(request)
    next(iter(call))
    os.kill(pids[1], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 30
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        list(stub(server).Generate(pb.GenerateRequest(text="hi")))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert not stub(server).ModelInfo(pb.ModelInfoRequest()).healthy

    def gave_up() -> str | None:
        try:
            ray_cluster.get(handle.check_health.remote())
        except RuntimeError as exc:
            return str(exc)
        return None

    deadline = time.monotonic() + 60
    while (message := gave_up()) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert message and "in-place recovery failed" in message and "TimeoutError" in message, message
    info = stub(server).ModelInfo(pb.ModelInfoRequest())
    assert not info.healthy and not info.recovering and info.worker_restarts == 0


def test_drain_finishes_the_running_stream_and_refuses_new_requests(ray_cluster, replicas, tmp_path):
    """What a replica does when Serve stops it (rolling upgrade, scale-down): ``Coordinator.drain``
    turns gRPC health NOT_SERVING, refuses new requests with UNAVAILABLE (the router retries them on
    another replica) and returns 0 only once the stream already running has ended in full. Its own
    tiny Llama coordinator at TP=1: the module's replica must keep serving for the other tests."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from tiny_checkpoints import write_tiny_llama

    write_tiny_llama(tmp_path, seed=3, tokenizer=True, max_position_embeddings=512)
    handle = replicas.launch(EngineArgs(model=str(tmp_path), kv_cache_gib=0.01, max_model_len=512),
                             GroupConfig(cpus_per_worker=1))
    try:
        with grpc.insecure_channel(ray_cluster.get(handle.start_grpc.remote(0, "127.0.0.1"))) as channel:
            inference = pb_grpc.InferenceStub(channel)
            call = inference.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2, 3, 4]), sampling=pb.SamplingParams(
                max_tokens=400, temperature=0.0, ignore_eos=True)), timeout=120)
            tokens = list(next(call).token_ids)
            drained = handle.drain.remote(60)
            for resp in call:   # the running stream is not cut
                tokens += resp.token_ids
                last = resp
            assert (len(tokens), last.finish_reason) == (400, "length")
            assert ray_cluster.get(drained, timeout=60) == 0
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(service="")).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                list(inference.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2, 3])), timeout=30))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
            assert inference.ModelInfo(pb.ModelInfoRequest()).draining
    finally:
        replicas.stop(handle)
