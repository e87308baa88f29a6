"""Shared by the Triton kernel tests: a script run under the interpreter in a subprocess, and a
kernel compiled for sm_90 (the H200) without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


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
        return triton.compile(
            src, target=GPUTarget("cuda", 90, 32), **({"options": options} if options else {})
        )
    except RuntimeError as e:  # no ptxas in this Triton install
        pytest.skip(f"cannot compile for sm_90 here: {e}")


def rope_case(t=20, tc=4, heads=4, kv_heads=2, d=16, cap=64, seed=0, norms=True):
    """Random qkv rows, norms (or None), tables, positions (context rows 8.., block rows 40..)
    and caches."""
    import torch

    from dflash.models.draft_torch import RMSNorm, rope_cos_sin

    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    qn, kn = RMSNorm(d, 1e-6), RMSNorm(d, 1e-5)
    with torch.no_grad():
        qn.weight.copy_(torch.rand(d, generator=g) + 0.5)
        kn.weight.copy_(torch.rand(d, generator=g) + 0.5)
    pos = torch.cat((torch.arange(8, 8 + tc), torch.arange(40, 40 + t - tc)))
    cos, sin = rope_cos_sin(
        pos[None], 1.0 / 10000 ** (torch.arange(0, d, 2) / d), 1.0, torch.float32
    )
    kc, vc = (
        torch.randn(1, kv_heads, cap, d, generator=g),
        torch.randn(1, kv_heads, cap, d, generator=g),
    )
    if not norms:
        qn = kn = None
    return qkv, qn, kn, cos, sin, pos, kc, vc, tc, heads, kv_heads
