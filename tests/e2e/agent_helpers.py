"""What the agent end-to-end tests share: one greedy chat asked twice (streamed and not) and read
the way a client assembles it."""

from __future__ import annotations


def both(client, **kwargs) -> tuple[dict, dict]:
    """The same greedy chat non-streamed and streamed, each as ``{"message", "finish", "usage"}``."""
    kwargs = dict({"model": "m", "temperature": 0, "max_tokens": 160}, **kwargs)
    kwargs["model"] = client.models.list().data[0].id
    plain = client.chat.completions.create(**kwargs)
    choice = plain.choices[0]
    whole = {"message": {"content": choice.message.content or "",
                         "reasoning": getattr(choice.message, "reasoning_content", None) or "",
                         "calls": [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]},
             "finish": choice.finish_reason, "usage": plain.usage.model_dump()}
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for c in chunk.choices:
            delta = c.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            assert (getattr(delta, "reasoning", None) or "") == (getattr(delta, "reasoning_content", None) or "")
            for piece in delta.tool_calls or []:
                if piece.id is not None:
                    assert piece.index not in calls and piece.type == "function" and piece.function.name
                    calls[piece.index] = [piece.function.name, ""]
                else:
                    assert piece.function.name is None
                calls[piece.index][1] += piece.function.arguments or ""
            finish = c.finish_reason or finish
    streamed = {"message": {"content": content, "reasoning": reasoning,
                            "calls": [tuple(calls[i]) for i in sorted(calls)]},
                "finish": finish, "usage": chunks[-1].usage.model_dump()}
    return whole, streamed

