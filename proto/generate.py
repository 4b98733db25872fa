"""Regenerate ``proto/inference_pb2.py`` and ``proto/inference_pb2_grpc.py`` with grpcio-tools.

Run ``python -m proto.generate`` from the repo root (or pass ``--out DIR``). Stubs are generated,
never hand-edited; ``tests/cluster/test_proto_stubs.py`` compares them with a fresh generation.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STUBS = ("inference_pb2.py", "inference_pb2_grpc.py", "inference_pb2.pyi")


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs for ``proto/inference.proto`` into ``out_dir``; returns their paths.

    Raises:
        RuntimeError: protoc failed.
    """
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        # -I at the repo root makes the stubs import each other as ``proto.inference_pb2``.
        code = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                            f"--grpc_python_out={tmp}", str(ROOT / "proto" / "inference.proto")])
        if code != 0:
            raise RuntimeError(f"protoc exited with {code}")
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for name in STUBS:
            shutil.copy(Path(tmp) / "proto" / name, out_dir / name)
            paths.append(out_dir / name)
        return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "proto")
    for path in generate(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
