"""The DFlash2 selector walk kernel (dflash.kernels.selector_walk): the torch walk's picks and q
in Triton's interpreter, its CPU fall-back, and a compile for sm_90."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from dflash.kernels import selector_walk as sw
from dflash.models.draft2_torch import select_walk
from tests.helpers.kernels import run_interpreted


def test_cpu_falls_back_to_the_torch_walk():
    g = torch.Generator().manual_seed(0)
    un, fi, tr = (
        torch.randn(2, 5, 4, generator=g),
        torch.randn(2, 4, generator=g),
        torch.randn(2, 4, 4, 4, generator=g),
    )
    u, temp = torch.rand(2, 8, generator=g), torch.tensor([0.8])
    assert torch.equal(sw.walk_kernel(un, fi, tr)[0], select_walk(un, fi, tr)[0])
    got, want = sw.walk_kernel(un, fi, tr, u, temp), select_walk(un, fi, tr, u, temp)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from dflash.kernels.selector_walk import walk_kernel
    from dflash.models.draft2_torch import select_walk

    g = torch.Generator().manual_seed(0)
    for b, t, k in ((1, 15, 16), (3, 7, 5), (2, 1, 4), (1, 4, 1)):
        un = torch.randn(b, t, k, generator=g) * 3
        un[0, 0, -1] = un[0, 0, 0]  # a tie: the first maximal slot
        fi, tr = torch.randn(b, k, generator=g), torch.randn(b, max(t - 1, 0), k, k, generator=g) * 2
        picks, q = walk_kernel(un, fi, tr)
        assert q is None and torch.equal(picks, select_walk(un, fi, tr)[0]), (b, t, k)
        u, temp = torch.rand(b, t + 3, generator=g), torch.tensor([0.7])
        picks, q = walk_kernel(un, fi, tr, u, temp)
        want, want_q = select_walk(un, fi, tr, u, temp)
        assert torch.equal(picks, want) and (q - want_q).abs().max() < 1e-6, (b, t, k)
    print("ok")
""")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_kernel_in_interpreter_equals_the_torch_walk():
    """Greedy picks identical (ties to the first slot), sampled picks identical for the same
    uniforms and q within 1e-6, for several shapes (k not a power of two, one position, k = 1)."""
    out = run_interpreted(KERNEL_CHECK)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("sample", [False, True])
def test_kernel_compiles_for_hopper(sample):
    from tests.helpers.kernels import compile_for_hopper

    consts = {"T": 15, "K": 16, "KP": 16, "SAMPLE": sample}
    sig = {"U": "*fp32", "FIRST": "*fp32", "TRANS": "*fp32", "UNI": "*fp32", "s_ub": "i32", "TEMP": "*fp32",
           "PICKS": "*i64", "Q": "*fp32", **dict.fromkeys(consts, "constexpr")}  # fmt: skip
    assert "ptx" in compile_for_hopper(sw._walk_kernel, sig, consts, num_warps=1).asm
