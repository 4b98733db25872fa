"""Custom ops that ``torch.compile`` keeps opaque, registered with torch's low-level library API.

``torch.library.custom_op`` wraps every call in Python checks (outputs must not alias inputs, a
``torch._disable_dynamo`` frame, argument conversion): ~5-10 us a call, and a compiled SmolLM2
decode step makes 30 such calls (one per attention block; 60 more all-reduces at TP=2, 120 packed
matmuls with dense copies). Registered here, a call is the dispatcher and the Python kernel only.
The kernels keep custom_op's contract themselves: they return new tensors (never their inputs
or views of them) and mutate no argument.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIBRARY = torch.library.Library("shardserve", "FRAGMENT")


def define_op(schema: str, kernel: Callable, fake: Callable) -> None:
    """Define ``shardserve::<schema>`` (e.g. ``"all_reduce(Tensor tensor) -> Tensor"``) with one
    Python ``kernel`` for every device and its ``fake`` (shapes and dtypes only, for tracing)."""
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"shardserve::{name}", fake, lib=_LIBRARY)
