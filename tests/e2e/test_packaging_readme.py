"""shardserve as a new user gets it: the built wheel installed into a fresh virtual environment beside
proto-plus (``import proto`` must still be proto-plus's), and the README's ``shardserve`` command
lines run as written, by bash, with that wheel's console script.

The fresh environment borrows this checkout's dependencies (torch, ray, ...) through a ``.pth``
line naming our venv's site-packages; ``.pth`` files found through such a line are not processed,
so the editable install of this checkout stays invisible there, and only the wheel provides
``shardserve``. Commands run from a temporary folder, so the repository's ``proto/`` folder is not
on ``sys.path`` either."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import jsonschema
import pytest

from shardserve.cluster.cli import build_parser

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory) -> dict:
    """``{"bin": venv bin folder, "python": its interpreter, "cwd": a folder outside the repo, "env"}``."""
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(root / "dist"), str(REPO)], check=True, timeout=600, capture_output=True)
    (wheel,) = (root / "dist").glob("shardserve-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, timeout=300, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    cwd = root / "work"
    cwd.mkdir()
    return {"bin": venv / "bin", "python": python, "site": site, "cwd": cwd, "env": env}


def test_the_wheel_installs_one_shardserve_package_beside_proto_plus(wheel_env):
    script = ("import proto, shardserve.cluster.cli, shardserve.proto.inference_pb2 as pb, importlib.metadata as md; "
              "print(proto.Message.__module__, proto.__file__, shardserve.cluster.cli.__file__, "
              "md.distribution('shardserve').metadata['License-Expression'])")
    out = subprocess.run([str(wheel_env["python"]), "-c", script], cwd=wheel_env["cwd"], env=wheel_env["env"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    module, proto_file, cli_file, license_ = out.stdout.split()
    assert module.startswith("proto.") and "site-packages/proto/" in proto_file      # proto-plus, not ours
    assert cli_file.startswith(wheel_env["site"])                                     # the wheel, not the checkout
    assert license_ == "Apache-2.0"


def readme_commands() -> list[str]:
    """The README's fenced bash lines that start with ``shardserve`` (continuations joined)."""
    text = (REPO / "README.md").read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines += [line.strip() for line in re.sub(r"\\\n\s*", " ", block).splitlines()
                  if line.strip().startswith("shardserve ")]
    return lines


def bash_argv(line: str) -> list[str]:
    """The argv bash hands ``shardserve`` for ``line`` (quotes, escapes and comments as bash reads them)."""
    shim = f'shardserve() {{ "{sys.executable}" -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@"; }}\n'
    out = subprocess.run(["bash", "-c", shim + line], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_every_readme_command_line_parses(smollm2_files):
    commands = readme_commands()
    assert len(commands) >= 9 and any('--stop "\\n\\n"' in c for c in commands), commands
    parser = build_parser()
    for line in commands:
        parser.parse_args(bash_argv(line))   # argparse exits (fails the test) on an unknown flag or bad value


@pytest.mark.extended   # five CLI runs, one on a Ray cluster: ~3 min (the lines are parsed in make test)
def test_readme_generate_lines_run_as_written(wheel_env, smollm2_files):
    """Each ``generate`` line whose placeholder can be filled (``path/to/model.gguf``: the SmolLM2
    GGUF) and that needs no GPU runs through bash with the wheel's ``shardserve`` (the ``-tp 2`` line
    on a local Ray cluster); ``--stop "\\n\\n"`` must stop there."""
    runnable = [line.replace("path/to/model.gguf", str(smollm2_files.path)) for line in readme_commands()
                if line.startswith("shardserve generate") and "path/to/hf-checkpoint-folder" not in line
                and "--device cuda" not in line]
    assert len(runnable) == 5, runnable
    (make_schema,) = [line for line in (REPO / "README.md").read_text().splitlines() if "> city.schema.json" in line]
    subprocess.run(["bash", "-c", make_schema], cwd=wheel_env["cwd"], check=True, timeout=60)
    schema = json.loads((wheel_env["cwd"] / "city.schema.json").read_text())
    for line in runnable:
        out = subprocess.run(["bash", "-c", line], cwd=wheel_env["cwd"], env=wheel_env["env"], capture_output=True,
                             text=True, timeout=900)
        assert out.returncode == 0, (line, out.stderr[-2000:])
        assert "INFO" not in out.stdout and "INFO" in out.stderr   # the completion on stdout, logs on stderr
        if "France" in line:
            assert "Paris" in out.stdout
        if "--json-schema" in line:   # the constrained answer parses and fits the schema
            jsonschema.validate(json.loads(out.stdout), schema)
        if "--regex" in line:
            assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.stdout.strip()), out.stdout
        if "--stop" in line:   # this sampled story (seed 0, bf16) has its first blank line after 47 of the 128 tokens
            assert "finish_reason=stop" in out.stderr and "\n\n" not in out.stdout.rstrip("\n"), out.stdout
