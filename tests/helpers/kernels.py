"""Shared by the Triton kernel tests: a script run under the interpreter in a subprocess, and a
kernel compiled for sm_90 (the H200) without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -c script args`` with ``TRITON_INTERPRET=1`` and the repository on the path
    (the interpreter must be on before Triton is imported, hence a fresh process)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    return subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def compile_for_hopper(fn, signature: dict, constexprs: dict, **options):
    """``fn`` compiled for sm_90 (``options``: num_warps, num_stages...); skips the test when
    this Triton install cannot (no ptxas)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), **({"options": options} if options else {}))
    except RuntimeError as e:  # no ptxas in this Triton install
        pytest.skip(f"cannot compile for sm_90 here: {e}")
