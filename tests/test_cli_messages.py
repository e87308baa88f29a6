"""Messages a user trial found wrong or unclear: each case runs the real command line (a
subprocess, or typer's CliRunner over a fake pipeline) and asserts the exact words and exit code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "DFLASH_DEBUG": ""}
DATA_DIR = Path(__file__).resolve().parent / "data"


def dflash_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash", *args], capture_output=True, text=True,
                          env=ENV, timeout=300, cwd=cwd)  # fmt: skip


def error_lines(p: subprocess.CompletedProcess) -> list[str]:
    """The ``error:`` line and its ``hint:`` line: exit code 1, nothing else on stderr (no
    traceback, no blank line before the error)."""
    assert p.returncode == 1, (p.returncode, p.stderr)
    lines = p.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), p.stderr
    return lines


# -- 1. one list of backends -------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "benchmark"])
def test_an_unknown_backend_lists_every_backend_openai_included(command):
    """`dflash generate tensorflow` listed 'transformers, mlx' and left out openai (user trial)."""
    args = ["hi"] if command == "generate" else ["--dataset", "gsm8k", "--base-url", "http://x"]
    assert error_lines(dflash_cli(command, "tensorflow", *args)) == [
        "error: Unknown backend 'tensorflow'; choose one of transformers, mlx or openai.",
        f"hint: the backend is the first argument: dflash {command} transformers ...",
    ]


def test_every_backend_list_comes_from_one_place():
    from dflash import api
    from dflash.backend_names import BACKENDS, LOCAL_BACKENDS, backend_help
    from dflash.bench import command

    assert BACKENDS == ("transformers", "mlx", "openai") and api.BACKENDS == LOCAL_BACKENDS
    assert all(f"{name} (" in backend_help() for name in BACKENDS)
    assert command.BACKENDS is BACKENDS
