"""The committed gRPC stubs equal a fresh grpcio-tools generation from proto/inference.proto."""

from __future__ import annotations

from pathlib import Path

from shardserve.proto.generate import STUBS, generate

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto"


def test_stubs_are_up_to_date(tmp_path):
    generate(tmp_path)
    for name in STUBS:
        fresh, committed = (tmp_path / name).read_text(), (PROTO_DIR / name).read_text()
        assert fresh == committed, f"proto/{name} is stale: run `python -m shardserve.proto.generate`"
