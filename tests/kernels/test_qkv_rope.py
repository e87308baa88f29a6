"""The fused qkv projection + q/k norm + RoPE + cache-write kernel (dflash.kernels.qkv_rope):
its switch, its torch reference on the static path (tokens and draft logits), the Triton kernel
in the interpreter against the two-kernel references, and an sm_90 compile."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from dflash.errors import InputError
from dflash.kernels import qkv_rope as qr
from tests.helpers.kernels import compile_for_hopper, run_interpreted


def test_setting():
    """None (auto): without q/k norms and by the weight's size (8 MiB); True and False force it;
    the override DFLASH_QKV_ROPE takes auto, 1 or 0, anything else is an error."""
    from dflash.kernels.settings import KernelSettings

    small, big = torch.empty(960, 576, dtype=torch.bfloat16), torch.empty(6144, 4096, dtype=torch.bfloat16)
    assert KernelSettings().qkv_rope is None
    assert qr.qkv_rope_wanted([small, small], False) and not qr.qkv_rope_wanted([small, big], False)
    assert not qr.qkv_rope_wanted([small], True)  # a whole head per program: measured slower
    assert qr.qkv_rope_wanted([big], True, True)
    assert not qr.qkv_rope_wanted([small], False, False)
    env = {"DFLASH_QKV_ROPE": "auto"}
    assert KernelSettings.resolve(environ=env).qkv_rope is None
    assert KernelSettings.resolve(environ={"DFLASH_QKV_ROPE": "1"}).qkv_rope is True
    with pytest.raises(InputError, match="DFLASH_QKV_ROPE"):
        KernelSettings.resolve(environ={"DFLASH_QKV_ROPE": "maybe"})


def test_launch_checks_shapes():
    """A weight that is not (H + 2 Hkv) D rows, or more than 32 rows, fails with the shapes named."""
    from tests.helpers.kernels import rope_case

    _, qn, kn, cos, sin, pos, kc, vc, tc, h, hkv = rope_case(20, 4, 4, 2, 16)
    x = torch.randn(20, 32)
    with pytest.raises(ValueError, match="qkv_rope: x"):
        qr._launch(x, torch.randn(7 * 16, 32), None, 0.0, False, None, None, 0.0, 0.0, cos, sin, pos, kc, vc,
                   tc, h, hkv)  # fmt: skip


def test_fits_and_backend_off_on_cpu(tiny_target):
    """The kernel needs a head size <= 128 and a dense weight; on CPU the backend leaves it off
    (no Triton projections); records say so when it is on."""
    from dflash.backends.static.backend import StaticBackend
    from tests.helpers.tiny import make_draft

    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False)
    assert not be.qkv_rope_target and not be.qkv_rope_draft
    attn = be.draft_model.layers[0].self_attn
    w = be.fused_draft[0][0].weight
    assert qr.qkv_rope_fits(attn, w, True)
    assert not qr.qkv_rope_fits(attn, w.t(), True)  # column-major
    assert "qkv_rope" not in be.describe()  # recorded when on
    be.qkv_rope_draft = True
    assert be.describe()["qkv_rope"] == {"target": False, "draft": True}


def _count(monkeypatch):
    calls = []
    real = qr.qkv_rope_reference
    monkeypatch.setattr(qr, "qkv_rope_reference", lambda *a: calls.append(a[3] is not None) or real(*a))
    return calls


@pytest.mark.parametrize("fuse_norm", [False, True])
def test_static_greedy_through_the_fused_path(fuse_norm, monkeypatch):
    """The static backend with the fused kernel's path in the target (with its input norm inside
    the kernel or not) and the draft decodes exactly plain greedy at block 1 and 16, and every
    layer went through it."""
    from tests.helpers.static import assert_static_greedy

    calls = _count(monkeypatch)
    assert_static_greedy(attention="split", linear="triton", linear_in=32, draft_linear=True, draft_linear_in=True,
                         draft_rope=True, target_rope=True, qkv_rope_target=True, qkv_rope_draft=True,
                         fuse_norm=fuse_norm)  # fmt: skip
    # the draft's qkv takes its context rows un-normed: never the norm inside
    assert set(calls) == ({True, False} if fuse_norm else {False})


def test_draft_logits_match_the_two_kernel_path(tiny_target, monkeypatch):
    """The draft's logits through the fused path equal the rope_cache path's at two steps (the
    tokens alone cannot show a draft error)."""
    from dflash.backends.static.backend import StaticBackend
    from tests.helpers.static import draft_twice
    from tests.helpers.tiny import PROMPT, custom_draft

    draft = custom_draft(tiny_target)
    calls = _count(monkeypatch)
    outs = []
    for fused in (False, True):
        be = StaticBackend(tiny_target, draft, torch.device("cpu"), use_graphs=False)
        be.attention, be.draft_linear, be.draft_linear_in, be.draft_rope = "split", True, True, True
        be.qkv_rope_draft = fused
        outs.append(draft_twice(be, PROMPT * 3))
    assert len(calls) == 2 * len(draft.layers)  # every layer, both steps, only when switched on
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fall_back_order_and_live_flags(tiny_target, gpu_like):
    """After a failed capture the fused kernel goes first, before the RMSNorm kernel and the
    norms inside the projections; the backend reports it live only where its forwards run it."""
    from dflash.backends.static.backend import StaticBackend
    from dflash.kernels.settings import KernelSettings, fall_back
    from tests.helpers.tiny import make_draft

    new, what, fix = fall_back(KernelSettings(), {"qkv_rope", "norm_kernel", "fuse_norm"})
    assert new.qkv_rope is False and new.norm_kernel and "DFLASH_QKV_ROPE=0" in fix
    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False)
    assert be.qkv_rope_target and not be.qkv_rope_draft  # the draft's q/k norms: auto leaves it off
    assert "qkv_rope" in be.live_kernels() and be.describe()["qkv_rope"] == {"target": True, "draft": False}
    be.configure(new)
    assert not be.qkv_rope_target and "qkv_rope" not in be.live_kernels() and "qkv_rope" not in be.describe()


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from dflash.kernels import qkv_rope as qr
    from dflash.kernels.small_linear import fold_norm_weight
    from tests.helpers.kernels import rope_case

    launched = []
    real = qr._launch
    qr._launch = lambda *a: launched.append(1) or real(*a)
    torch.manual_seed(0)
    cases = [(20, 4, 4, 2, 16, True, False, False), (17, 16, 9, 3, 64, True, True, True),
             (1, 0, 4, 2, 32, False, False, False), (16, 0, 4, 2, 16, False, True, True),
             (32, 16, 2, 1, 128, True, False, True), (16, 0, 9, 3, 64, False, False, True)]
    # context rows or none, GQA 3, with norms (one head per program) and without (column pairs)
    for n, (t, tc, h, hkv, d, norms, bias, rn) in enumerate(cases):
        _, qn, kn, cos, sin, pos, kc, vc, _, _, _ = rope_case(t, tc, h, hkv, d, cap=128, norms=norms)
        k = 48
        x = torch.randn(t, k)
        w = torch.randn((h + 2 * hkv) * d, k) / k ** 0.5
        b = torch.randn((h + 2 * hkv) * d) if bias else None
        eps = 1e-5 if rn else None
        if rn:
            w = fold_norm_weight(w, torch.rand(k) + 0.5)
        kr, vr = kc.clone(), vc.clone()
        want = qr.qkv_rope_reference(x, w, b, eps, qn, kn, cos, sin, pos, kr, vr, tc, h, hkv)
        got = qr.qkv_rope(x, w, b, eps, qn, kn, cos, sin, pos, kc, vc, tc, h, hkv, early=n % 2 == 1)
        assert got.shape == want.shape and got.transpose(1, 2).is_contiguous()
        for a, bb in ((got, want), (kc, kr), (vc, vr)):  # caches: written rows and the rest
            err = (a - bb).abs().max().item()
            assert err < 1e-4, (t, tc, d, err)
    assert len(launched) == len(cases)
    from tests.helpers.static import assert_static_greedy
    assert_static_greedy(layers=2, attention="split", linear="triton", linear_in=32, draft_linear=True,
                         draft_linear_in=True, draft_rope=True, target_rope=True, qkv_rope_target=True,
                         qkv_rope_draft=True, fuse_norm=True)
    assert len(launched) > len(cases)
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernel_in_interpreter():
    """The kernel (Triton interpreter, float32) equals the two-kernel references: queries of the
    block rows, keys and values at their cache rows, the other rows untouched, with and without
    context rows, norms, bias and the input norm inside; the static backend with it in the
    target and the draft decodes plain greedy."""
    out = run_interpreted(KERNEL_CHECK)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.skipif(qr.triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("pdl", [False, True])
def test_kernel_compiles_for_hopper(pdl):
    """The kernel compiles for sm_90 (the H200) without a GPU with tensor-core dots, Qwen3-8B's
    and the demo's head layouts; with PDL its grid-dependency wait and launch instructions."""

    ptrs = ("X", "W", "B", "QW", "KW", "COS", "SIN", "POS", "QO", "KC", "VC")
    sig = {p: "*i64" if p == "POS" else "*fp32" if p in ("COS", "SIN") else "*bf16" for p in ptrs}
    sig.update(dict.fromkeys(("M", "K", "TC", "s_xm", "s_wn", "s_cos", "s_qh", "s_qt", "s_kh", "s_ks", "s_vh",
                              "s_vs"), "i32"))  # fmt: skip
    sig.update(dict.fromkeys(("eps_q", "eps_k", "rn_eps"), "fp32"))
    big = dict(H=32, KV=8, HALF=64, P=64, HAS_BIAS=False, NORM=True, RN=False, IEEE=False, BM=16, BK=256, PDL=pdl,
               EARLY=True)  # fmt: skip
    sig.update(dict.fromkeys(big, "constexpr"))
    for cons in (big, dict(big, H=9, KV=3, HALF=32, P=8, NORM=False, RN=True, BK=128, BM=32, EARLY=False)):
        kernel = compile_for_hopper(qr._qkv_rope_kernel, sig, cons, num_warps=4, num_stages=2)
        ptx = kernel.asm["ptx"]
        assert "mma" in ptx and ptx.count("griddepcontrol") == (2 if pdl else 0)
