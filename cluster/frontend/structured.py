"""Structured outputs: the constraint's wire form (proto), and later its grammar compile + cache.

A :class:`cluster.engine.request.StructuredOutputs` travels from the OpenAI front (parsed from
``response_format`` / ``structured_outputs``) or a gRPC client to the replica as
``pb.StructuredOutputs``; the functions here convert between the two.
"""

from __future__ import annotations

from shardserve.cluster.engine.request import StructuredOutputs
from shardserve.proto import inference_pb2 as pb


def structured_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputs:
    """Proto constraint -> :class:`StructuredOutputs`.

    Raises:
        ValueError: no kind set, ``json_object`` false, or an empty value (message starts
            ``structured_outputs:``).
    """
    kind = msg.WhichOneof("kind")
    compact = msg.disable_any_whitespace
    try:
        if kind is None or (kind == "json_object" and not msg.json_object):
            raise ValueError("set one of json, json_object (true), regex, choice or grammar")
        if kind == "json":
            return StructuredOutputs.json_schema(msg.json, compact)
        if kind == "json_object":
            return StructuredOutputs.json_object(compact)
        if kind == "choice":
            return StructuredOutputs.choice(list(msg.choice.choices))
        return StructuredOutputs(kind, getattr(msg, kind))
    except ValueError as exc:
        raise ValueError(f"structured_outputs: {exc}") from None


def structured_to_proto(spec: StructuredOutputs) -> pb.StructuredOutputs:
    """:class:`StructuredOutputs` -> proto (the router's and clients' side)."""
    msg = pb.StructuredOutputs(disable_any_whitespace=spec.disable_any_whitespace)
    if spec.kind == "json_object":
        msg.json_object = True
    elif spec.kind == "choice":
        msg.choice.choices.extend(spec.value)
    else:
        setattr(msg, spec.kind, spec.value)
    return msg

