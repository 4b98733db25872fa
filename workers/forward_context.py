"""Per-step attention metadata, visible to every attention layer during one forward.

NOTE: the second of the two module-level globals (the first is the TP group in
``workers/distributed.py``). :func:`forward_context` installs it for one forward and always
resets it, so a failed step cannot leak metadata into the next.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens sit in the paged caches. ``T`` = tokens this step, ``B`` = sequences."""

    slot_mapping: torch.Tensor      # [T] int64, cache slot of each token
    positions: torch.Tensor         # [T] int64, position of each token in its sequence
    query_start_loc: torch.Tensor   # [B + 1] int64, cu_seqlens of the packed queries
    seq_lens: torch.Tensor          # [B] int64, context length after this step
    block_tables: torch.Tensor      # [B, max_blocks] int32, padded with 0
    max_query_len: int              # host copy of max(q_len)
    max_seq_len: int                # host copy of max(seq_lens)
    step_cache: dict = field(default_factory=dict)  # tensors derived from the above, built once per step
    state: object = None            # StateMetadata (workers/state_cache.py) of hybrid recurrent models, else None
    # Host copies of query_start_loc / seq_lens (plain lists), so prefill kernels can plan bounded
    # chunks without reading the device; None where the builder has none (then read when needed).
    query_start_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # Data-parallel attention (workers/models/moe_exchange.py): tokens of every attention group in
    # this step, from the plans on the host; None: plain TP (or every group runs this shape).
    dp_token_counts: list[int] | None = None


_CONTEXT: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata):
    """Install ``metadata`` for the duration of one forward pass."""
    global _CONTEXT
    _CONTEXT = metadata
    try:
        yield metadata
    finally:
        _CONTEXT = None


def get_attention_metadata() -> AttentionMetadata:
    """The current step's metadata.

    Raises:
        RuntimeError: called outside :func:`forward_context`, or in code that torch.compile traces
            (the graph would keep one step's values: read it inside an opaque call instead,
            ``workers/compilation.py``).
    """
    if torch.compiler.is_compiling():
        raise RuntimeError("the step's attention metadata is read in traced code; read it inside an opaque call")
    if _CONTEXT is None:
        raise RuntimeError("attention metadata requested outside forward_context()")
    return _CONTEXT
