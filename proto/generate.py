"""Regenerate ``proto/inference_pb2.py`` and ``proto/inference_pb2_grpc.py`` with grpcio-tools.

Run ``python -m shardserve.proto.generate`` (or pass ``--out DIR``). Stubs are generated, never
hand-edited; ``tests/cluster/test_proto_stubs.py`` compares them with a fresh generation. The
``.proto`` file is compiled from a temporary ``shardserve/proto/`` tree, so the stubs import each
other as ``shardserve.proto.inference_pb2`` (the installed package name), not as a top-level
``proto`` (which would collide with proto-plus).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
STUBS = ("inference_pb2.py", "inference_pb2_grpc.py", "inference_pb2.pyi")


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs for ``inference.proto`` into ``out_dir``; returns their paths.

    Raises:
        RuntimeError: protoc failed.
    """
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        # The include root holds shardserve/proto/inference.proto: the stubs' imports follow that path.
        source = Path(tmp) / "src" / "shardserve" / "proto" / "inference.proto"
        source.parent.mkdir(parents=True)
        shutil.copy(PROTO_DIR / "inference.proto", source)
        code = protoc.main(["grpc_tools.protoc", f"-I{Path(tmp) / 'src'}", f"--python_out={tmp}",
                            f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(source)])
        if code != 0:
            raise RuntimeError(f"protoc exited with {code}")
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for name in STUBS:
            shutil.copy(Path(tmp) / "shardserve" / "proto" / name, out_dir / name)
            paths.append(out_dir / name)
        return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=PROTO_DIR)
    for path in generate(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
