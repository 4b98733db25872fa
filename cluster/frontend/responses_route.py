"""``POST /v1/responses`` answers: a started chat run (one choice) read to its end, as one
response object or as the Responses event stream (``event:`` + ``data:`` lines, no ``[DONE]``).
See :mod:`cluster.frontend.responses_api` for the mapping and :mod:`cluster.frontend.openai_router`
for how the run is admitted (validation, routing, first response)."""

from __future__ import annotations

import json

import grpc
from starlette.responses import JSONResponse, Response

from shardserve.cluster.frontend.chat_output import ChoiceDelta
from shardserve.cluster.frontend.responses_api import ResponseBuilder, responses_usage


def _usage(core, run, builder: ResponseBuilder) -> dict:
    choice = run.choices[0]
    thinking = "".join(part["text"] for item in builder.output if item["type"] == "reasoning"
                       for part in item["content"])
    reasoning_tokens = len(core.tokenizer(thinking, add_special_tokens=False)["input_ids"]) if thinking else 0
    return responses_usage(choice.prompt_tokens, choice.completion_tokens,
                           min(reasoning_tokens, choice.completion_tokens), choice.cached_tokens)


def _status(run) -> tuple[str, str | None]:
    return ("incomplete", "max_output_tokens") if run.choices[0].finish_reason == "length" else ("completed", None)


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def respond(core, run, echo: dict) -> Response:
    """The answer to a Responses request whose run has started (``run.choices[0].output`` set)."""
    builder = ResponseBuilder(echo, run.model, run.created)
    if run.parsed.stream:
        from shardserve.cluster.frontend.openai_router import _EventStream

        run.status = 200
        return _EventStream(_events(core, run, builder), lambda: core._finish(run))
    error = await core._read_run(run)
    if error is not None:
        return error
    output = run.choices[0].output
    builder.add(output.feed(run.choices[0].text))
    builder.add(output.finish())
    status, reason = _status(run)
    builder.finish(status, _usage(core, run, builder), reason)
    return JSONResponse(builder.response(status, _usage(core, run, builder), reason))


async def _events(core, run, builder: ResponseBuilder):
    choice, output = run.choices[0], run.choices[0].output
    try:
        for event in builder.start():
            yield _sse(event)
        text = choice.text                          # what the first response carried
        done = choice.finish_reason is not None
        while True:
            delta = output.feed(text) if text else ChoiceDelta()
            if done:
                delta.extend(output.finish())
            for event in builder.add(delta):
                yield _sse(event)
            if done:
                break
            resp = await run.calls[0].read()
            if resp is grpc.aio.EOF:
                text, done = "", True
                continue
            core._absorb(run, 0, resp)
            text, done = resp.text, bool(resp.finish_reason)
        status, reason = _status(run)
        for event in builder.finish(status, _usage(core, run, builder), reason):
            yield _sse(event)
        run.outcome = "finished"
    except grpc.aio.AioRpcError as exc:
        err = core._failed(run, exc)
        run.status = 200   # the stream had started: the error is its last event
        yield _sse({"type": "error", "sequence_number": builder._seq, **err.body()["error"]})
    finally:
        core._finish(run)
