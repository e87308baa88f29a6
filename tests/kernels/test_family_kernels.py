"""The kernels the gpt-oss / Gemma / Qwen3-MoE static forwards take on CUDA, run by Triton's
interpreter on the CPU (float32) against torch: the split-KV attention at Gemma 4's head dims
(256 with a window, 512 for the global layers, k = v), small_linear's GELU-tanh epilogue.

The interpreter needs numpy < 2.3 (numpy 2.3+ refuses Triton 3.6's scalar conversions); with a
newer numpy these tests fail inside the interpreter, not in the kernels."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from tests.helpers.kernels import compile_for_hopper, run_interpreted

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)

ATTENTION = textwrap.dedent("""
    import math
    import torch
    from dflash.backends.static.families import attend_sinks
    from dflash.kernels import split_attention as sa
    from tests.kernels.test_split_attention import _inputs, masked_sdpa

    # Gemma 4 (31B): sliding layers D 256 with a window, global layers D 512 with k = v
    for h, hkv, t, d, cap, start, window in ((8, 2, 1, 256, 512, 300, 64), (8, 2, 16, 256, 512, 200, 64),
                                             (8, 1, 1, 512, 512, 299, 0), (8, 1, 16, 512, 512, 130, 0)):
        q, k, v, pos = _inputs(h, hkv, t, d, cap, start)
        if d == 512:
            v = k  # attention_k_eq_v: one buffer read as keys and values
        want = masked_sdpa(q, k, v, pos, 1.0, window)
        for split, one in ((128, 0), (512, 0), (128, 448)):
            got = sa.split_attention_kernel(q, k, v, pos, 1.0, split, 1, 0, one_slice=one, window=window)
            err = (got - want).abs().max().item()
            assert err < 1e-4, (h, hkv, t, d, split, one, window, err)
            assert int(sa._COUNTERS[("cpu", None)].abs().sum()) == 0
    # gpt-oss: D 64, sinks, window 128 over several slices
    q, k, v, pos = _inputs(16, 2, 1, 64, 512, 400)
    sinks = torch.randn(16, generator=torch.Generator().manual_seed(3)) * 2
    keys = torch.arange(512)
    mask = ((keys[None] <= pos[:, None]) & (keys[None] > pos[:, None] - 128))[None, None]
    want = attend_sinks(q, k, v, mask, 0.125, sinks)
    got = sa.split_attention_kernel(q, k, v, pos, 0.125, 128, 0, 0, window=128,
                                    sinks=sinks * math.log2(math.e))
    assert (got - want).abs().max().item() < 1e-4
    print("ok")
""")

GEGLU = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from dflash.kernels import small_linear as sl

    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 96, 200), (16, 64, 128), (5, 40, 72)):
        x, w, b = torch.randn(m, k, generator=g), torch.randn(2 * n, k, generator=g) / 8, torch.randn(2 * n, generator=g)
        gate, up = F.linear(x, w, b).chunk(2, -1)
        want = F.gelu(gate, approximate="tanh") * up
        got = sl.small_linear_glu(x, w, b, act="gelu_tanh")
        assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item() + 1e-5, (m, n, k)
        want = F.silu(gate) * up  # the SiLU epilogue unchanged
        got = sl.small_linear_glu(x, w, b)
        assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item() + 1e-5, (m, n, k)
    print("ok")
""")


@needs_triton
@pytest.mark.slow
def test_split_attention_at_gemma_and_gpt_oss_head_dims():
    out = run_interpreted(ATTENTION, timeout=900)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@needs_triton
def test_small_linear_gelu_tanh_epilogue():
    out = run_interpreted(GEGLU)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@needs_triton
@pytest.mark.parametrize("d,t,gp", [(512, 1, 8), (512, 16, 1), (256, 16, 1)])
def test_split_attention_compiles_for_hopper_at_wide_heads(d, t, gp):
    """The kernel compiles for sm_90 at head dims 256 and 512 (the keys per iteration lowered to
    16,384 / D) within the H100's shared memory."""
    from dflash.kernels import split_attention as sa

    ints = ("scale_log2", "cap", "s_pos", "window", "s_qh", "s_qt", "s_kh", "s_ks", "s_vh", "s_vs", "s_oh", "s_ot",
            "s_ph", "s_ps", "s_pr", "s_lh", "s_ls")  # fmt: skip
    consts = {"T": t, "G": 8, "GP": gp, "D": d, "ROWS": 16, "SPLIT_N": 256, "BLOCK": 16384 // d, "IEEE": False,
              "MERGE": True, "PDL": True, "ONE": 448, "EARLY": True, "WINDOW": d == 256}  # fmt: skip
    sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "POS": "*i64", "OUT": "*bf16", "PO": "*fp32", "PL": "*fp32",
           "CNT": "*i32", **{n: "i32" for n in ints}, **dict.fromkeys(consts, "constexpr")}  # fmt: skip
    sig["scale_log2"] = "fp32"
    kernel = compile_for_hopper(sa._split_kernel, sig, consts, num_warps=4, num_stages=2)
    assert kernel.metadata.shared <= 227 * 1024


ROPE = textwrap.dedent("""
    import torch
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from dflash.kernels.rms_norm import ONE_PLUS, ROUND_ONCE
    from dflash.kernels.rope_cache import rope_cache_family, rope_cache_family_reference
    from dflash.models.draft_torch import rope_cos_sin

    g = torch.Generator().manual_seed(0)
    # (mode, head dim, heads, kv heads, k = v, v norm): Gemma 3, Gemma 4 sliding, Gemma 4 global
    for mode, d, h, hkv, k_eq_v, vn in ((ONE_PLUS, 16, 4, 2, False, False), (ROUND_ONCE, 256, 4, 2, False, True),
                                        (ROUND_ONCE, 512, 4, 1, True, True)):
        t, cap = 3, 64
        if mode == ONE_PLUS:
            qn, kn, vnorm = Gemma3RMSNorm(d, 1e-6), Gemma3RMSNorm(d, 1e-6), None
        else:
            qn, kn = Gemma4RMSNorm(d, 1e-6), Gemma4RMSNorm(d, 1e-6)
            vnorm = Gemma4RMSNorm(d, 1e-6, with_scale=False) if vn else None
        with torch.no_grad():
            for n in (qn, kn):
                n.weight.copy_(torch.randn(d, generator=g) * 0.5)
        qkv = torch.randn(t, (h + (1 if k_eq_v else 2) * hkv) * d, generator=g) * 3
        pos = torch.tensor([40, 41, 42])
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        inv[d // 8:] = 0.0  # a partial rotary (Gemma 4's global layers): cos 1, sin 0 past it
        cos, sin = rope_cos_sin(pos[None], inv, 1.0, torch.float32)
        caches = [torch.zeros(1, hkv, cap, d) for _ in range(4)]
        with torch.no_grad():
            want = rope_cache_family_reference(qkv, qn, kn, vnorm, cos, sin, pos, caches[0], caches[1], h, hkv, k_eq_v)
            got = rope_cache_family(qkv, qn, kn, vnorm, cos, sin, pos, caches[2], caches[3], h, hkv, mode, k_eq_v)
        for a, b in ((got, want), (caches[2], caches[0]), (caches[3], caches[1])):
            err = (a - b).abs().max().item()
            assert err < 1e-5, (mode, d, err)
        assert caches[3][:, :, 40:43].abs().sum() > 0
        assert got.transpose(1, 2).is_contiguous()
    print("ok")
""")


@needs_triton
def test_rope_cache_family_equals_the_gemma_modules():
    """Gemma 3's (1 + w) and Gemma 4's round-once q/k norms, Gemma 4's weightless v norm and its
    k = v global layers (head dim 512, a partial rotary), RoPE and the cache writes in one
    kernel equal the modules and torch's rotation (float32)."""
    out = run_interpreted(ROPE)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


MOE = textwrap.dedent("""
    import torch
    from dflash.backends.static.moe import gpt_oss_forward, moe_forward
    from dflash.kernels.moe_gemv import moe_combine, moe_topk, moe_topk_reference
    from tests.helpers.target_families import build

    g = torch.Generator().manual_seed(0)
    for t, e, k in ((1, 32, 4), (3, 128, 8), (16, 40, 2)):
        logits = torch.randn(t, e, generator=g) * 3
        for first, norm in ((True, True), (True, False), (False, True)):
            w, i = moe_topk(logits, k, first, norm)
            w_ref, i_ref = moe_topk_reference(logits, k, first, norm)
            assert torch.equal(i, i_ref), (t, e, k, first)
            assert (w - w_ref).abs().max().item() < 1e-6, (t, e, k, first)
        y, r = torch.randn(t * k, 72, generator=g), torch.randn(t, 72, generator=g)
        assert (moe_combine(y, k, r) - (r + y.view(t, k, 72).sum(1))).abs().max().item() < 1e-5
    # whole blocks: the fused route (router kernel, expert GEMVs, slot-sum + residual kernel)
    # against the gather route plus the residual (float32)
    for family in ("qwen3_moe", "gpt_oss"):
        model = build(family).eval()
        layer = model.model.layers[0]
        forward = gpt_oss_forward if family == "gpt_oss" else moe_forward
        for t in (1, 3):  # 1 row: the expert GEMVs (2 pairs of 4 experts); 3: grouped_mm
            h, r = torch.randn(1, t, 64, generator=g), torch.randn(1, t, 64, generator=g)
            with torch.no_grad():
                want = r + forward(layer.mlp, h, "gather")
                got = forward(layer.mlp, h, "fused", residual=r)
            err = (got - want).abs().max().item()
            assert err < 1e-5 * max(1.0, want.abs().max().item()), (family, t, err)
    print("ok")
""")


@needs_triton
def test_moe_router_and_combine_kernels():
    """The fused route's router kernel (Qwen3-MoE's softmax-then-top-k with and without the
    renormalisation, gpt-oss's top-k-then-softmax) picks torch.topk's experts with its weights,
    the slot-sum kernel adds the residual as torch does, and whole expert blocks on the fused
    route with the residual equal the gather route's (float32, interpreter)."""
    out = run_interpreted(MOE)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


ADD_NORM = textwrap.dedent("""
    import torch
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from dflash.kernels.add_norm import add_norm
    from dflash.kernels.rms_norm import ONE_PLUS, ROUND_ONCE

    g = torch.Generator().manual_seed(0)
    for mode, cls in ((ROUND_ONCE, Gemma4RMSNorm), (ONE_PLUS, Gemma3RMSNorm)):
        n1, n2 = cls(96, 1e-6), cls(96, 1e-5)
        with torch.no_grad():
            for n in (n1, n2):
                n.weight.copy_(torch.randn(96, generator=g) * 0.5)
        a, r = torch.randn(3, 96, generator=g) * 4, torch.randn(3, 96, generator=g)
        s = torch.tensor([0.7])
        with torch.no_grad():
            x, h = add_norm(a, r, n1.weight, 1e-6, mode, None, n2.weight, 1e-5)
            want = r + n1(a)
            assert (x - want).abs().max().item() < 1e-5 and (h - n2(want)).abs().max().item() < 1e-5, mode
            x, h = add_norm(a, r, n1.weight, 1e-6, mode, s)
            assert h is None and (x - want * s).abs().max().item() < 1e-5, mode
    print("ok")
""")


@needs_triton
def test_add_norm_equals_the_gemma_modules():
    """Gemma's post-norm, residual add, layer scalar and next norm in one kernel equal the
    modules and torch's ops (Gemma 4's round-once norms, Gemma 3's (1 + w); float32)."""
    out = run_interpreted(ADD_NORM)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
