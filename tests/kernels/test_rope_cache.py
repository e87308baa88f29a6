"""The draft layer's q/k norm + RoPE + cache-write kernel (dflash.kernels.rope_cache): the torch
reference is the module path's maths, the draft's logits are the same with it on and off, and
the Triton kernel (Triton's CPU interpreter, float32) equals the reference."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from dflash.errors import InputError
from dflash.kernels import rope_cache as rc
from tests.helpers.kernels import rope_case, run_interpreted


def test_switch(tiny_target, gpu_like):
    """The rope settings: draft and target by default, DFLASH_ROPE=draft the draft only, 0 none,
    anything else a one-line error; on CPU's torch path it is off."""
    from dflash.backends.static.backend import StaticBackend
    from dflash.kernels.settings import KernelSettings
    from tests.helpers.tiny import make_draft

    def parts(value):
        s = KernelSettings.resolve(environ={"DFLASH_ROPE": value})
        return s.rope_target, s.rope_draft

    assert parts("1") == parts("") == (True, True) and parts("draft") == (False, True) and parts("0") == (False, False)
    with pytest.raises(InputError, match="DFLASH_ROPE must be 1, draft or 0"):
        parts("maybe")
    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False,
                       settings=KernelSettings.resolve(environ={"DFLASH_ROPE": "draft"}))  # fmt: skip
    assert be.draft_rope and not be.target_rope  # as on a GPU (gpu_like)


def test_cpu_keeps_the_torch_ops(tiny_target):
    from dflash.backends.static.backend import StaticBackend
    from tests.helpers.tiny import make_draft

    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False)
    assert not be.draft_rope and not be.target_rope  # CPU: no Triton projections


def test_launch_checks_shapes():
    """A qkv, table, position vector or cache that does not fit is a ValueError before launch."""
    qkv, qn, kn, cos, sin, pos, kc, vc, tc, h, hkv = rope_case()
    args = (qkv, qn.weight, kn.weight, 1e-6, 1e-6, cos, sin, pos, kc, vc, tc, h, hkv)
    for i, bad in ((0, qkv[:, :-1]), (7, pos[:-1]), (5, cos[:, :, :-1]), (9, vc[:, :1])):
        with pytest.raises(ValueError, match="rope_cache"):
            rc._launch(*args[:i], bad, *args[i + 1:])


def test_fits(tiny_target):
    from tests.helpers.tiny import custom_draft

    attn = custom_draft(tiny_target).layers[0].self_attn
    assert rc.rope_cache_fits(attn, torch.bfloat16) and rc.rope_cache_fits(attn, torch.float32)
    assert not rc.rope_cache_fits(attn, torch.float64)
    attn.head_dim = 24  # not a power of two
    assert not rc.rope_cache_fits(attn, torch.float32)
    target_attn = tiny_target.model.layers[0].self_attn  # Llama: no q/k norms
    assert rc.rope_cache_fits(target_attn, torch.float32, norms=False)
    assert not rc.rope_cache_fits(target_attn, torch.float32)





def test_reference_is_the_module_maths():
    """The reference applies the draft's own q_norm/k_norm and apply_rope: queries of the block
    rows, keys and values at their positions, every other cache row untouched."""
    from dflash.models.draft_torch import apply_rope

    qkv, qn, kn, cos, sin, pos, kc, vc, tc, h, hkv = rope_case()
    k0, v0 = kc.clone(), vc.clone()
    q = rc.rope_cache(qkv, qn, kn, cos, sin, pos, kc, vc, tc, h, hkv)
    d = kc.shape[-1]
    heads = qkv.view(qkv.shape[0], h + 2 * hkv, d).transpose(0, 1)[None]  # [1, H + 2Hkv, T, D]
    assert torch.equal(q, apply_rope(qn(heads[:, :h, tc:]), cos[:, :, tc:], sin[:, :, tc:]))
    assert torch.equal(kc[:, :, pos], apply_rope(kn(heads[:, h:h + hkv]), cos, sin))
    assert torch.equal(vc[:, :, pos], heads[:, h + hkv:])
    other = torch.ones(kc.shape[2], dtype=torch.bool)
    other[pos] = False
    assert torch.equal(kc[:, :, other], k0[:, :, other]) and torch.equal(vc[:, :, other], v0[:, :, other])


def test_draft_logits_with_rope_kernel_path_match(tiny_target):
    """The static draft's logits with the kernel's path (its torch reference off CUDA: the write
    positions and caches as the kernel gets them) equal the module path's at two steps."""
    from dflash.backends.static.backend import StaticBackend
    from tests.helpers.static import draft_twice
    from tests.helpers.tiny import PROMPT, custom_draft

    draft = custom_draft(tiny_target)
    outs, calls = [], []
    real = rc.rope_cache_reference
    for rope in (False, True):
        be = StaticBackend(tiny_target, draft, torch.device("cpu"), use_graphs=False)
        be.attention, be.draft_linear, be.draft_rope = "split", True, rope
        rc.rope_cache_reference = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            outs.append(draft_twice(be, PROMPT * 3))
        finally:
            rc.rope_cache_reference = real
    assert len(calls) == 2 * len(draft.layers)  # every layer, both steps, only with the switch on
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qwen3", [False, True])
def test_target_with_rope_kernel_path_decodes_greedy(qwen3, monkeypatch):
    """The target's forwards through the kernel's path (its torch reference off CUDA) in every
    layer, with q/k norms (Qwen3) and without (Llama): plain greedy tokens at block 1 and 16."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from dflash.backends.static.backend import StaticBackend
    from dflash.loop import speculative_generate
    from tests.helpers.tiny import PROMPT, greedy_reference, make_draft

    torch.manual_seed(0)
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.3)
    target = (Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kw)) if qwen3 else LlamaForCausalLM(LlamaConfig(**kw))).eval()
    calls = []
    real = rc.rope_cache_reference
    monkeypatch.setattr(rc, "rope_cache_reference", lambda *a: calls.append(a[1] is not None) or real(*a))
    be = StaticBackend(target, make_draft(target), torch.device("cpu"), use_graphs=False, device_loop=True)
    be.attention, be.target_rope = "split", True
    truth = greedy_reference(target, PROMPT, 20)
    for block in (1, 16):
        toks = [t for r in speculative_generate(be, PROMPT, block_size=block, max_new_tokens=20) for t in r.tokens]
        assert toks == truth, (block, toks, truth)
    assert calls and set(calls) == {qwen3}  # the norms went in exactly when the target has them


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from dflash.kernels import rope_cache as rc
    from tests.helpers.kernels import rope_case

    for args in ((20, 4, 4, 2, 16), (17, 16, 9, 3, 64), (3, 1, 2, 2, 32), (5, 0, 4, 2, 16, 64, 1, False)):
        case = rope_case(*args) if len(args) > 5 else rope_case(*args, cap=128)  # odd counts, GQA 3, no norms
        qkv, qn, kn, cos, sin, pos, kc, vc, tc, h, hkv = case
        kr, vr = kc.clone(), vc.clone()
        want = rc.rope_cache_reference(qkv, qn, kn, cos, sin, pos, kr, vr, tc, h, hkv)
        got = rc.rope_cache(qkv, qn, kn, cos, sin, pos, kc, vc, tc, h, hkv)
        assert got.shape == want.shape and got.transpose(1, 2).is_contiguous()
        for a, b in ((got, want), (kc, kr), (vc, vr)):
            err = (a - b).abs().max().item()
            assert err < 1e-5, (args, err)
        # the tables, positions and norm weights loaded before the PDL wait: bitwise the same
        ke, ve = kc.clone().fill_(7.0), vc.clone().fill_(7.0)
        kc.fill_(7.0), vc.fill_(7.0)
        rc.rope_cache(qkv, qn, kn, cos, sin, pos, kc, vc, tc, h, hkv)
        early = rc.rope_cache(qkv, qn, kn, cos, sin, pos, ke, ve, tc, h, hkv, early=True)
        assert torch.equal(early, got) and torch.equal(ke, kc) and torch.equal(ve, vc), args
        # [S, D] tables read at the rows' positions == [1, 1, T, D] tables of those rows
        ct, st = torch.randn(kc.shape[2], cos.shape[-1]), torch.randn(kc.shape[2], cos.shape[-1])
        kt, vt, kr, vr = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        want = rc.rope_cache_reference(qkv, qn, kn, ct[pos][None, None], st[pos][None, None], pos, kr, vr, tc, h, hkv)
        got = rc.rope_cache(qkv, qn, kn, ct, st, pos, kt, vt, tc, h, hkv)
        for a, b in ((got, want), (kt, kr), (vt, vr)):
            assert (a - b).abs().max().item() < 1e-5, args
    from tests.helpers.static import assert_static_greedy
    assert_static_greedy(attention="split", draft_linear=True, draft_rope=True, target_rope=True)
    # the draft's logits with the kernel equal the torch ops' (tokens alone cannot show a draft error)
    from transformers import LlamaConfig, LlamaForCausalLM
    from dflash.backends.static.backend import StaticBackend
    from tests.helpers.static import draft_twice
    from tests.helpers.tiny import PROMPT, custom_draft
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        initializer_range=0.3)).eval()
    outs = []
    for rope in (False, True):
        be = StaticBackend(target, custom_draft(target), torch.device("cpu"), use_graphs=False)
        be.attention, be.draft_linear, be.draft_rope = "split", True, rope
        outs.append(draft_twice(be, PROMPT * 3))
    for a, b in zip(*outs):
        err = (a - b).abs().max().item()
        assert err < 1e-4, err
    with torch.no_grad():  # a Qwen3-style norm (variance_epsilon) through the kernel
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
        qkv, qn, kn, cos, sin, pos, kc, vc, tc, h, hkv = rope_case(12, 4, 4, 2, 16, cap=64)
        qn3, kn3 = Qwen3RMSNorm(16, eps=1e-6), Qwen3RMSNorm(16, eps=1e-5)
        qn3.weight.copy_(qn.weight)
        kn3.weight.copy_(kn.weight)
        kr, vr = kc.clone(), vc.clone()
        want = rc.rope_cache_reference(qkv, qn, kn, cos, sin, pos, kr, vr, tc, h, hkv)
        got = rc.rope_cache(qkv, qn3, kn3, cos, sin, pos, kc, vc, tc, h, hkv)
        assert (got - want).abs().max().item() < 1e-5 and (kc - kr).abs().max().item() < 1e-5
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernel_in_interpreter():
    """The kernel (Triton interpreter, float32) equals the reference: queries, keys and values
    at their cache rows, the rest of the caches untouched, with norms and without; the static
    backend with it in the draft and the target (and the split attention kernel) decodes plain
    greedy."""
    out = run_interpreted(KERNEL_CHECK)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("early,table", [(False, False), (True, False), (True, True)])
def test_kernel_compiles_for_hopper(early, table):
    """The kernel compiles for sm_90 (the H200) with PDL; ``early`` puts the tables', positions'
    and norm weights' loads before the wait for the previous kernel, and only then (``table``:
    tables read by position)."""
    from tests.helpers.kernels import compile_for_hopper

    ptrs = ("QKV", "QW", "KW", "COS", "SIN", "POS", "QO", "KC", "VC")
    ints = ("TC", "s_row", "s_cos", "s_qh", "s_qt", "s_kh", "s_ks", "s_vh", "s_vs")
    consts = {"H": 32, "KV": 8, "HALF": 64, "NORM": True, "PDL": True, "EARLY": early, "TABLE": table}
    sig = {**{n: "*bf16" for n in ptrs}, **{n: "i32" for n in ints}, "eps_q": "fp32", "eps_k": "fp32",
           **dict.fromkeys(consts, "constexpr")}  # fmt: skip
    sig["POS"] = "*i64"
    ptx = compile_for_hopper(rc._rope_cache_kernel, sig, consts, num_warps=1).asm["ptx"]
    before = ptx[: ptx.index("griddepcontrol.wait")]
    assert ("ld.global" in before) == early, before[-2000:]
