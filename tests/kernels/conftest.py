"""Kernel tests run the Triton kernels on CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` only takes effect if it is set before ``triton`` is first imported, so it
is set here, at collection time; ``kernels`` itself imports Triton lazily for this reason.
"""

from __future__ import annotations

import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1; "
                       "run with TRITON_INTERPRET=1 in the environment")
# NOTE: this is process-wide: later tests in the same pytest run also see the interpreter (the
# kernel tests pass CPU tensors only; GPU runs use benchmarks/kernels_gpu.sh, not pytest).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same RNG state (deterministic, order-independent)."""
    torch.manual_seed(0)
