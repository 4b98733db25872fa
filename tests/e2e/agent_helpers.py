"""What the agent end-to-end tests share: one greedy chat asked twice (streamed and not) and read
the way a client assembles it."""

from __future__ import annotations


def token_usage(usage) -> dict:
    """``usage`` less ``spec_decode``: the adaptive speculation policy drafts by measured step costs,
    so two runs of one greedy answer may verify different drafts (the tokens are the same)."""
    return {k: v for k, v in usage.model_dump().items() if k != "spec_decode"}


def both(client, **kwargs) -> tuple[dict, dict]:
    """The same greedy chat non-streamed and streamed, each as ``{"message", "finish", "usage"}``."""
    kwargs = dict({"model": "m", "temperature": 0, "max_tokens": 160}, **kwargs)
    kwargs["model"] = client.models.list().data[0].id
    plain = client.chat.completions.create(**kwargs)
    choice = plain.choices[0]
    whole = {"message": {"content": choice.message.content or "",
                         "reasoning": getattr(choice.message, "reasoning_content", None) or "",
                         "calls": [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]},
             "finish": choice.finish_reason, "usage": token_usage(plain.usage)}
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
                "finish": finish, "usage": token_usage(chunks[-1].usage)}
    return whole, streamed

