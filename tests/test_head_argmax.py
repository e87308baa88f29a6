"""The LM head + greedy argmax kernel (dflash.backends.head_argmax): the device loop decodes plain
greedy tokens with it (its torch reference off CUDA), and the Triton kernel (Triton's CPU
interpreter, float32) gives argmax(x @ W^T) exactly, ties to the first column included."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dflash.backends import head_argmax as ha
from dflash.errors import InputError

REPO = Path(__file__).resolve().parents[1]


def test_switch_and_fits(monkeypatch, tiny_target):
    from dflash.backends.static_torch import StaticBackend
    from tests.conftest import make_draft

    monkeypatch.delenv("DFLASH_HEAD_ARGMAX", raising=False)
    assert not ha.head_argmax_default()
    monkeypatch.setenv("DFLASH_HEAD_ARGMAX", "1")
    assert ha.head_argmax_default()
    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False, device_loop=True)
    assert not be.head_argmax  # CPU: no Triton projections
    monkeypatch.setenv("DFLASH_HEAD_ARGMAX", "on")
    with pytest.raises(InputError, match="DFLASH_HEAD_ARGMAX must be 0 or 1"):
        StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False)
    head = tiny_target.get_output_embeddings()
    assert ha.head_fits(head, torch.float32) and not ha.head_fits(head, torch.bfloat16)
    biased = torch.nn.Linear(8, 4)
    assert not ha.head_fits(biased, torch.float32)


def test_device_loop_with_head_argmax_decodes_greedy(tiny_target, monkeypatch):
    """The device loop's verify and draft forwards with the fused head (its reference on CPU):
    plain greedy tokens at block 1 and 16, and every head of theirs went through it."""
    from dflash.backends.static_torch import StaticBackend
    from dflash.loop import speculative_generate
    from tests.conftest import make_draft
    from tests.test_loop_scripted import PROMPT, greedy_reference

    calls = []
    real = ha.head_argmax_reference
    monkeypatch.setattr(ha, "head_argmax_reference", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False, device_loop=True)
    be.head_argmax = True
    truth = greedy_reference(tiny_target, PROMPT, 24)
    for block in (1, 16):
        calls.clear()
        toks = [t for r in speculative_generate(be, PROMPT, block_size=block, max_new_tokens=24) for t in r.tokens]
        assert toks == truth, (block, toks, truth)
        widths = {1: {1}, 16: {15, 16}}[block]  # verify rows (and the draft's L-1 rows)
        assert calls and set(calls) == widths, (block, sorted(set(calls)))


def test_launch_checks_shapes():
    if ha.triton is None:
        pytest.skip("Triton is not installed")
    with pytest.raises(ValueError, match="head_argmax"):
        ha._launch(torch.zeros(33, 8), torch.zeros(100, 8))
    with pytest.raises(ValueError, match="head_argmax"):
        ha._launch(torch.zeros(4, 8), torch.zeros(100, 9))


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from dflash.backends import head_argmax as ha

    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 1000, 64), (15, 1000, 96), (16, 4096, 64), (32, 2100, 160)):
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        got = ha.head_argmax(x, w)
        assert got.dtype == torch.int64 and torch.equal(got, ha.head_argmax_reference(x, w)), (m, n, k)
    # ties: identical weight rows give bitwise-equal logits; the first column wins, within a
    # program's slice (3 and 5) and across slices (5 and 700)
    x, w = torch.randn(4, 64, generator=g), torch.randn(1000, 64, generator=g) * 0.01
    w[5] = x[0] * 4
    w[3] = w[5]
    w[700] = w[5]
    w[900] = x[1] * 4
    w[800] = w[900]
    got = ha.head_argmax(x, w)
    assert got[0].item() == 3 and got[1].item() == 800, got
    assert torch.equal(got, ha.head_argmax_reference(x, w))
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernel_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", KERNEL_CHECK], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.skipif(ha.triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("pdl", [False, True])
def test_kernel_compiles_for_hopper(pdl):
    """The kernel compiles for sm_90 (the H200) without a GPU, with tensor-core dots, and with PDL
    its grid-dependency wait and launch instructions (the interpreter skips both)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"X": "*bf16", "W": "*bf16", "PV": "*fp32", "PI": "*i32", **dict.fromkeys(("M", "N", "K", "s_xm", "s_wn", "s_pm"), "i32"),
           **dict.fromkeys(("IEEE", "BM", "BN", "BK", "PDL"), "constexpr")}  # fmt: skip
    src = ASTSource(fn=ha._head_argmax_kernel, signature=sig,
                    constexprs={"IEEE": False, "BM": 16, "BN": 32, "BK": 128, "PDL": pdl})  # fmt: skip
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
    except RuntimeError as e:  # no ptxas in this Triton install
        pytest.skip(f"cannot compile for sm_90 here: {e}")
    ptx = kernel.asm["ptx"]
    assert "mma" in ptx and ptx.count("griddepcontrol") == (2 if pdl else 0)
