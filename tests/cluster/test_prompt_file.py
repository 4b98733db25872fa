"""``shardserve generate --prompt-file FILE`` / ``-`` (issue 25) and the long-prompt bad inputs, run
in this process through ``cli.main`` on a tiny DeepSeek-V3.2 checkpoint (word-level tokenizer).

Bad input is one line on stderr and exit code 2, found before the model loads where it can be:
a missing / empty / non-UTF-8 file, ``--prompt`` and ``--prompt-file`` together or neither,
``--dsa-top-k`` 0 or negative. A prompt over ``--max-model-len`` names both numbers.
``--dsa-top-k`` above the context keeps every key: the output equals dense MLA's.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

from shardserve.cluster import cli  # noqa: E402
from shardserve.cluster.prompt_file import read_prompt  # noqa: E402

PROMPT = " ".join(f"w{i:03d}" for i in (5, 17, 33, 90, 41, 8, 77, 12, 64, 99, 23, 50))   # 12 tokens > top-k 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("v32")
    write_tiny_checkpoint("deepseek_v32", path, seed=0, tokenizer=True)
    return str(path)


def _generate(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["generate", "--max-tokens", "6", "--block-size", "4", "--kv-cache-gib", "0.01", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _error_line(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("shardserve: error:") or ": error:" in line]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_prompt_file_and_stdin_give_the_prompt_flags_output(model, tmp_path, capsys, monkeypatch):
    code, expected, _ = _generate(capsys, "--model", model, "--prompt", PROMPT)
    assert code == 0 and len(expected.split()) == 6
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT + "\n")                      # an editor's trailing line break is dropped
    assert _generate(capsys, "--model", model, "--prompt-file", str(prompt_file))[:2] == (0, expected)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(PROMPT.encode())))
    assert _generate(capsys, "--model", model, "--prompt-file", "-")[:2] == (0, expected)


def test_read_prompt_keeps_the_text_but_one_trailing_line_break(tmp_path):
    path = tmp_path / "p.txt"
    for raw, text in [("a\n\n", "a\n"), ("a\r\n", "a"), (" a b ", " a b "), ("héllo\n", "héllo")]:
        path.write_bytes(raw.encode())
        assert read_prompt(None, str(path)) == text
    assert read_prompt("x", None) == "x"


@pytest.mark.parametrize("case,message", [
    ("missing", "--prompt-file {dir}/none.txt: No such file or directory"),
    ("empty", "holds no prompt (empty)"),
    ("binary", "is not UTF-8 text (byte 1)"),
    ("both", "argument --prompt-file: not allowed with argument --prompt"),
    ("neither", "one of the arguments --prompt --prompt-file is required"),
    ("top-k 0", "--dsa-top-k must be >= 1, got 0"),
    ("top-k negative", "--dsa-top-k must be >= 1, got -3"),
])
def test_bad_prompt_input_is_one_line_before_loading(case, message, tmp_path, capsys):
    """The model path does not exist: every error here is found before anything loads."""
    (tmp_path / "empty.txt").write_text("\n")
    (tmp_path / "binary.txt").write_bytes(b"a\xff")
    args = {"missing": ["--prompt-file", str(tmp_path / "none.txt")],
            "empty": ["--prompt-file", str(tmp_path / "empty.txt")],
            "binary": ["--prompt-file", str(tmp_path / "binary.txt")],
            "both": ["--prompt", "x", "--prompt-file", "-"], "neither": [],
            "top-k 0": ["--prompt", "x", "--dsa-top-k", "0"],
            "top-k negative": ["--prompt", "x", "--dsa-top-k", "-3"]}[case]
    try:
        code = cli.main(["generate", "--model", str(tmp_path / "no-model"), *args])
    except SystemExit as exc:          # argparse's own errors
        code = exc.code
    line = _error_line(code, capsys.readouterr().err)
    assert message.format(dir=tmp_path) in line, line


def test_prompt_over_max_model_len_names_both_numbers(model, tmp_path, capsys):
    prompt_file = tmp_path / "long.txt"
    prompt_file.write_text(" ".join(["w005"] * 40))
    code, _, err = _generate(capsys, "--model", model, "--prompt-file", str(prompt_file), "--max-model-len", "32")
    line = _error_line(code, err)
    assert "prompt has 40 tokens; this model's context length is 32 tokens" in line, line


def test_dsa_top_k_above_the_context_keeps_every_key(model, capsys):
    code, dense, _ = _generate(capsys, "--model", model, "--prompt", PROMPT, "--no-dsa")
    assert code == 0
    assert _generate(capsys, "--model", model, "--prompt", PROMPT, "--dsa-top-k", "100000")[:2] == (0, dense)
    code, sparse, _ = _generate(capsys, "--model", model, "--prompt", PROMPT)
    assert code == 0 and sparse != dense, "top-k 8 of 12+ keys should change the output"
