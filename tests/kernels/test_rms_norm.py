"""The RMSNorm kernel (dflash.kernels.rms_norm): the modules' maths, its switch, the static path with it."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from dflash.kernels import rms_norm as rn
from tests.helpers.kernels import run_interpreted


def test_reference_is_the_modules_maths():
    """rms_norm_reference equals transformers' LlamaRMSNorm and Qwen3RMSNorm bit for bit (bf16)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    x = (torch.randn(5, 96) * 3).bfloat16()
    for cls, eps in ((LlamaRMSNorm, 1e-5), (Qwen3RMSNorm, 1e-6)):
        norm = cls(96, eps=eps).bfloat16()
        with torch.no_grad():
            norm.weight.copy_(torch.randn(96))
            assert torch.equal(rn.rms_norm_reference(x, norm.weight, eps), norm(x))
            assert torch.equal(rn.rms_norm(x, norm.weight, eps), norm(x))  # CPU: the reference


def test_fits():
    """Only plain RMSNorms of a 16-bit dtype fit."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    norm = LlamaRMSNorm(64).bfloat16()
    assert rn.rms_norm_fits(norm, torch.bfloat16)
    assert not rn.rms_norm_fits(norm, torch.float16)  # the weight's dtype must be the activations'
    assert not rn.rms_norm_fits(LlamaRMSNorm(64), torch.float32)  # float32: the modules
    assert not rn.rms_norm_fits(GemmaRMSNorm(64).bfloat16(), torch.bfloat16)  # (1 + weight)
    assert not rn.rms_norm_fits(torch.nn.LayerNorm(64).bfloat16(), torch.bfloat16)
    assert not rn.rms_norm_fits(Olmo2RMSNorm(64).bfloat16(), torch.bfloat16)  # rounds once
    assert not rn.rms_norm_fits(LlamaRMSNorm(rn.MAX_HIDDEN * 2).bfloat16(), torch.bfloat16)


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from dflash.kernels import rms_norm as rn

    torch.manual_seed(0)
    # float32 and float16: the interpreter rounds float32 to bfloat16 by truncation (the GPU to
    # nearest), so bfloat16 rows are checked on the GPU (scripts/bench_big.py's reference tokens)
    for m, n, dtype in ((1, 64, torch.float32), (16, 96, torch.float32), (3, 4096, torch.float16),
                        (32, 576, torch.float16), (7, 100, torch.float16)):
        x = (torch.randn(m, n) * 4).to(dtype)
        w = torch.randn(n).to(dtype)
        got = rn.rms_norm(x, w, 1e-6)
        want = rn.rms_norm_reference(x, w, 1e-6)
        assert got.dtype == dtype and got.shape == (m, n) and got.is_contiguous()
        if dtype == torch.float32:
            assert (got - want).abs().max().item() < 1e-5, (m, n)
        else:  # another order of the float32 sum of squares: a rare unit in the last place
            ulp = want.abs().float() * 2.0 ** -9 + 2.0 ** -24
            assert ((got.float() - want.float()).abs() <= 2 * ulp).all(), (m, n, dtype)
            assert (got == want).float().mean().item() > 0.99, (m, n, dtype)
        # each row alone: the same bits in a 1-row call as in the many-row call
        assert torch.equal(rn.rms_norm(x[m - 1:], w, 1e-6)[0], got[m - 1])
        # strided rows (a view of a wider buffer) read in place
        wide = torch.zeros(m, n + 8, dtype=dtype)
        wide[:, :n] = x
        assert torch.equal(rn.rms_norm(wide[:, :n], w, 1e-6), got)
    # the static backend's target norms through the kernel: plain greedy tokens
    from tests.helpers.static import assert_static_greedy
    assert_static_greedy(4, attention="split", norm_kernel=True)
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernel_in_interpreter():
    """The kernel (Triton interpreter) equals the modules' maths within a unit in the last place,
    row by row independent of the call's rows, and the static backend with it decodes exactly
    plain greedy at block 1 and 16."""
    out = run_interpreted(KERNEL_CHECK)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_kernel_compiles_for_hopper():
    """The kernel compiles for sm_90 (the H200) with PDL, the norm's weight loaded before the
    wait for the previous kernel and the row after it."""
    from tests.helpers.kernels import compile_for_hopper

    consts = {"N": 4096, "BLOCK": 4096, "PDL": True}
    sig = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "s_xm": "i32", "s_ym": "i32", "eps": "fp32",
           **dict.fromkeys(consts, "constexpr")}  # fmt: skip
    ptx = compile_for_hopper(rn._rms_norm_kernel, sig, consts, num_warps=8).asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    assert "ld.global" in ptx[:wait] and "ld.global" in ptx[wait:]


def test_static_backend_norm_kernel_off_on_cpu(tiny_target):
    """On the CPU the static backend keeps the modules (the kernel is CUDA's) and says so."""
    from dflash.backends.static.backend import StaticBackend
    from tests.helpers.tiny import make_draft

    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False)
    assert be.norm_kernel is False and be.describe()["norm_kernel"] is False


def test_fall_back_turns_the_kernel_off():
    """After a failed capture the RMSNorm kernel goes off after the qkv + RoPE kernel and before
    PDL, naming the override."""
    from dflash.kernels.settings import KernelSettings, fall_back

    new, what, fix = fall_back(KernelSettings(), {"norm_kernel", "pdl", "fuse_norm"})
    assert (new.norm_kernel, new.pdl, new.fuse_norm) == (False, "1", None) and what == "the RMSNorm kernel"
    assert "DFLASH_NORM_KERNEL=0" in fix
    assert fall_back(KernelSettings(), {"qkv_rope", "norm_kernel"})[1] == "the qkv + RoPE kernel"
