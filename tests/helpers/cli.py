"""The CLI as a user runs it: ``python -m dflash`` in a subprocess (offline, no debug
tracebacks), and the checks of its one-line errors (``error:`` then at most one ``hint:``,
exit code 1, no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "DFLASH_DEBUG": ""}


def run(
    *args: str, cwd: Path | None = None, timeout: int = 300, **env: str
) -> subprocess.CompletedProcess:
    """``python -m dflash *args`` with ``ENV`` plus ``env``; text stdout/stderr captured."""
    return subprocess.run([sys.executable, "-m", "dflash", *args], capture_output=True, text=True,
                          env={**ENV, **env}, timeout=timeout, cwd=cwd)  # fmt: skip


def run_many(*calls, timeout: int = 300, at_once: int = 2) -> list[subprocess.CompletedProcess]:
    """Independent CLI calls, ``at_once`` at a time (one torch thread each: CI has two cores and
    each call loads a model). Each call is a list of arguments, or (arguments, extra environment).
    A call that fails to finish in ``timeout`` seconds is killed with every other one."""
    done: list[subprocess.CompletedProcess] = []
    for i in range(0, len(calls), at_once):
        procs = []
        try:
            for call in calls[i : i + at_once]:
                args, extra = call if isinstance(call, tuple) else (call, {})
                procs.append(subprocess.Popen([sys.executable, "-m", "dflash", *args], stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True,
                                              env={**ENV, "OMP_NUM_THREADS": "1", **extra}))  # fmt: skip
            for p in procs:
                out, err = p.communicate(timeout=timeout)
                done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    return done


def assert_one_line_error(p: subprocess.CompletedProcess, fragment: str = "") -> str:
    """A one-line error containing ``fragment``, maybe with a ``hint:`` line; returns the
    ``error:`` line."""
    assert p.returncode == 1, (p.returncode, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in p.stderr
    assert lines and lines[0].startswith("error: "), p.stderr
    assert len(lines) <= 2 and all(ln.startswith("hint: ") for ln in lines[1:]), p.stderr
    assert fragment in lines[0], p.stderr
    return lines[0]


def error_lines(p: subprocess.CompletedProcess) -> list[str]:
    """The ``error:`` line and its ``hint:`` line: exit code 1, nothing else on stderr (no
    traceback, no blank line before the error)."""
    assert p.returncode == 1, (p.returncode, p.stderr)
    lines = p.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), (
        p.stderr
    )
    return lines
