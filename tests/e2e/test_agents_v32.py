"""Tool calls and thinking end to end on a tiny DeepSeek-V3.2 with MTP at TP=2: a real Ray
coordinator (2 shard workers + the MTP draft worker, speculating 2 tokens per step), its real gRPC
server, and the router's real HTTP app (uvicorn on a free port) with ``--tool-call-parser
deepseek_v32 --reasoning-parser deepseek_v3``, driven by the official ``openai`` client.

The checkpoint gets a byte-level tokenizer (any text is expressible, DeepSeek's special tokens
are single tokens) and no chat template, so the server renders DeepSeek-V3.2's format with its
built-in template. A random model writes no markup by itself: DSML is driven by a regex constraint
(the answer must be a sentence then DSML calls), and ``tool_choice`` named / ``required`` by the
tools' schemas; the calls that come back must validate against the schema (jsonschema),
streamed and not, with the same finish_reason and usage."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import jsonschema
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "models"))

from agent_helpers import both  # noqa: E402
from procs import free_port  # noqa: E402
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z杭州]{1,10}$"},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "东京"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in 杭州 for 3 days?"}]
DSML = "｜DSML｜"


def write_byte_tokenizer(path: Path) -> int:
    """A byte-level BPE without merges plus DeepSeek's special tokens; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=SPECIALS[0], eos_token=SPECIALS[1])
    tokenizer.add_tokens(SPECIALS[2:])
    tokenizer.save_pretrained(str(path))
    return len(tokenizer)


class RouterServer:
    """The router's HTTP app on a free port, in a thread, in front of one replica's gRPC address."""

    def __init__(self, model: str, grpc_address: str, info: dict, parsers) -> None:
        import uvicorn

        from shardserve.cluster.frontend.openai_app import build_openai_app
        from shardserve.cluster.frontend.openai_router import RouterCore
        from shardserve.cluster.tokenizer import load_tokenizer
        from shardserve.workers.model_source import resolve_model

        status = {"state": "ready", "address": grpc_address, "error": None, "info": info}

        async def fetch() -> dict:
            return status

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = None

        async def serve() -> None:
            core = RouterCore(model, [model], [fetch], lambda: load_tokenizer(resolve_model(model)), parsers=parsers)
            core.start()
            try:
                await core.wait_started()
                self.server = uvicorn.Server(uvicorn.Config(build_openai_app(core), host="127.0.0.1", port=self.port,
                                                            log_level="warning", lifespan="off"))
                await self.server.serve()
            finally:
                await core.close()

        self.thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not (self.server is not None and self.server.started):
            assert self.thread.is_alive() and time.monotonic() < deadline, "the router did not start"
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=300)

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def v32(ray_cluster, replicas, tmp_path_factory):
    from shardserve.cluster.config import EngineArgs
    from shardserve.cluster.frontend.chat_output import ParserConfig
    from shardserve.cluster.replica.worker_group import GroupConfig

    path = tmp_path_factory.mktemp("v32-agent")
    vocab = write_byte_tokenizer(path)
    write_tiny_checkpoint("deepseek_v32", path, seed=0, mtp=True, mtp_own_head=True, vocab_size=vocab,
                          bos_token_id=vocab - 6, eos_token_id=vocab - 5, max_position_embeddings=4096)
    args = EngineArgs(model=str(path), block_size=16, kv_cache_gib=0.05, max_model_len=4096,
                      tensor_parallel_size=2, speculative_tokens=2, seed=0)
    handle = replicas.launch(args, GroupConfig(cpus_per_worker=1))
    address = ray_cluster.get(handle.start_grpc.remote(0, "127.0.0.1"))
    info = ray_cluster.get(handle.model_info.remote())
    server = RouterServer(str(path), address, {k: info[k] for k in ("max_model_len", "num_blocks", "num_free_blocks",
                                                                    "healthy")},
                          ParserConfig("deepseek_v32", True, "deepseek_v3"))
    try:
        yield server, handle, ray_cluster
    finally:
        server.stop()
        replicas.stop(handle)


def test_free_answers_stream_like_whole_with_thinking_and_tools(v32):
    server, _, _ = v32
    for thinking, max_tokens in ((True, 40), (False, 12)):
        whole, streamed = both(server.client, messages=ASK, tools=[WEATHER, TIME], max_tokens=max_tokens,
                               extra_body={"chat_template_kwargs": {"thinking": thinking}})
        assert whole == streamed
        assert "｜" not in whole["message"]["content"] or DSML not in whole["message"]["content"]
        if not thinking:
            assert whole["message"]["reasoning"] == ""


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_calls_validate_against_the_schema(v32, choice):
    """``required`` thinks first: its constraint starts after ``</think>`` (a logit bias makes the
    random model close its thinking soon; the grammar masks ``</think>`` afterwards); the named
    call answers in chat mode, constrained from the first token."""
    server, _, _ = v32
    if choice == "named":
        tool_choice, extra = {"type": "function", "function": {"name": "get_weather"}}, {}
    else:
        from shardserve.cluster.tokenizer import load_tokenizer
        from shardserve.workers.model_source import resolve_model

        model = server.client.models.list().data[0].id
        end = load_tokenizer(resolve_model(model)).convert_tokens_to_ids("</think>")
        tool_choice = "required"
        extra = {"chat_template_kwargs": {"thinking": True}, "logit_bias": {str(end): 6}}
    # one call: a random model would add calls to the array until max_tokens
    whole, streamed = both(server.client, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
                           max_tokens=200, parallel_tool_calls=False, extra_body=extra)
    assert whole == streamed and whole["finish"] == "tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    assert len(whole["message"]["calls"]) == 1
    for name, arguments in whole["message"]["calls"]:
        jsonschema.validate(json.loads(arguments), schemas[name])
        assert choice == "required" or name == "get_weather"
    assert "</think>" not in whole["message"]["reasoning"] and "<" not in whole["message"]["content"]


def test_dsml_calls_are_parsed_across_speculative_steps(v32):
    """The answer is forced to be a sentence then DSML calls (a regex constraint, in chat mode: the
    whole answer is constrained); the parser must return the sentence as content and
    the call, however MTP grouped the tokens, streamed as whole."""
    server, _, _ = v32
    param = f'<{DSML}parameter name="city" string="true">[a-z杭州]{{1,4}}</{DSML}parameter>\n' \
            f'<{DSML}parameter name="days" string="false">[1-9]</{DSML}parameter>'
    invoke = f'<{DSML}invoke name="get_weather">\n{param}\n</{DSML}invoke>'
    pattern = f"[A-Z][a-z ]{{0,8}}\\.\n\n<{DSML}function_calls>\n{invoke}\n</{DSML}function_calls>"
    whole, streamed = both(server.client, messages=ASK, tools=[WEATHER, TIME], max_tokens=320,
                           extra_body={"chat_template_kwargs": {"thinking": False},
                                       "structured_outputs": {"regex": pattern}})
    assert whole == streamed and whole["finish"] == "tool_calls" and whole["message"]["reasoning"] == ""
    assert whole["message"]["content"].endswith(".") and "｜" not in whole["message"]["content"]
    assert len(whole["message"]["calls"]) == 1
    for name, arguments in whole["message"]["calls"]:
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_tool_history_renders_through_the_builtin_template(v32):
    """Assistant calls (content "", null or absent) and tool results (a string or text parts)
    render as DSML and function results: the prompt the server counts is the template's."""
    server, handle, ray = v32
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "杭州", "days": 3}'}}
    model = server.client.models.list().data[0].id
    counts = set()
    # text parts join with newlines (vLLM's rule), so these two are the same result
    results = ("sunny,\n25°C", [{"type": "text", "text": "sunny,"}, {"type": "text", "text": "25°C"}])
    for i, assistant in enumerate(({"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": "look up"},
                                   {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": "look up"},
                                   {"role": "assistant", "tool_calls": [call], "reasoning_content": "look up"})):
        messages = ASK + [assistant, {"role": "tool", "tool_call_id": "call_1", "content": results[i % 2]}]
        reply = server.client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                                      max_tokens=1, temperature=0,
                                                      extra_body={"chat_template_kwargs": {"thinking": True}})
        counts.add(reply.usage.prompt_tokens)
    from shardserve.cluster.frontend.chat_request import chat_messages, parse_chat_options
    from shardserve.cluster.tokenizer import encode_chat, load_tokenizer
    from shardserve.workers.model_source import resolve_model

    tokenizer = load_tokenizer(resolve_model(model))
    body = {"messages": messages, "tools": [WEATHER]}
    ids = encode_chat(tokenizer, chat_messages(messages), tools=parse_chat_options(body).tools,
                      template_kwargs={"thinking": True})
    text = tokenizer.decode(ids)
    assert counts == {len(ids)}
    assert f'<{DSML}parameter name="city" string="true">杭州</{DSML}parameter>' in text
    assert "<function_results>\n<result>sunny,\n25°C</result>\n</function_results>\n\n<think>" in text
    assert "<｜Assistant｜><think>look up</think>" in text


def test_responses_api_with_function_tools(v32):
    server, _, _ = v32
    model = server.client.models.list().data[0].id
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
    response = server.client.responses.create(model=model, input="Weather in 杭州?", tools=tools,
                                              tool_choice="required", max_output_tokens=200, temperature=0,
                                              parallel_tool_calls=False)
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and calls
    for item in calls:
        jsonschema.validate(json.loads(item.arguments), WEATHER["function"]["parameters"])
    events = list(server.client.responses.create(model=model, input="Weather in 杭州?", tools=tools,
                                                 tool_choice="required", max_output_tokens=200, temperature=0,
                                                 parallel_tool_calls=False, stream=True))
    done = events[-1]
    assert done.type == "response.completed"
    assert [(i.name, i.arguments) for i in done.response.output if i.type == "function_call"] == \
        [(i.name, i.arguments) for i in calls]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_grpc_chat_with_tools_parses_like_the_http_api(v32):
    import grpc

    from shardserve.proto import inference_pb2 as pb
    from shardserve.proto import inference_pb2_grpc as pb_grpc

    server, handle, ray = v32
    address = ray.get(handle.start_grpc.remote(0, "127.0.0.1"))
    tool = pb.Tool(name="get_weather", description=WEATHER["function"]["description"],
                   parameters=json.dumps(WEATHER["function"]["parameters"]))
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content=ASK[0]["content"])], tools=[tool],
                   template_kwargs=json.dumps({"thinking": True}))
    parsing = pb.OutputParsing(tool_call_parser="deepseek_v32", reasoning_parser="deepseek_v3")
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        replies = list(stub.Generate(pb.GenerateRequest(chat=chat, parsing=parsing, sampling=pb.SamplingParams(
            max_tokens=40, temperature=0)), timeout=300))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(chat=chat, parsing=pb.OutputParsing(tool_call_parser="nope")),
                               timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "deepseek_v32" in err.value.details()
        counted = stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=60).token_ids
    whole = server.client.chat.completions.create(
        model=server.client.models.list().data[0].id, messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": True}})
    message = whole.choices[0].message
    assert "".join(r.content for r in replies) == (message.content or "")
    assert "".join(r.reasoning for r in replies) == (message.reasoning_content or "")
    assert replies[-1].finish_reason == whole.choices[0].finish_reason
    assert len(counted) == whole.usage.prompt_tokens == replies[-1].usage.prompt_tokens
