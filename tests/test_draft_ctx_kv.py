"""The draft's joint context K/V projection (DFLASH_DRAFT_CTX_KV, dflash.backends.static_draft):
rope_cache with the context rows' K/V from another tensor, the draft's logits and tokens through
the joint path (torch references on CPU, the Triton kernels in the interpreter)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dflash.backends import rope_cache as rc
from dflash.backends.static_draft import draft_ctx_kv_setting
from dflash.errors import InputError

REPO = Path(__file__).resolve().parents[1]


def test_setting(monkeypatch):
    """Unset or 1: on; 0: off; anything else fails, also through the backend's env check."""
    monkeypatch.delenv("DFLASH_DRAFT_CTX_KV", raising=False)
    assert draft_ctx_kv_setting()
    monkeypatch.setenv("DFLASH_DRAFT_CTX_KV", "0")
    assert not draft_ctx_kv_setting()
    monkeypatch.setenv("DFLASH_DRAFT_CTX_KV", "on")
    from dflash.backends.static_switches import check_env

    with pytest.raises(InputError, match="DFLASH_DRAFT_CTX_KV"):
        check_env()


def _split_case(seed=0):
    """A rope_cache case and the same rows as (block qkv, context K/V inside a wider tensor)."""
    from tests.test_rope_cache import _case

    qkv, qn, kn, cos, sin, pos, kc, vc, tc, h, hkv = _case(20, 4, 4, 2, 16, seed=seed)
    d = kc.shape[-1]
    other = torch.randn(tc, 3 * 2 * hkv * d)  # three layers' K/V side by side; ours is the second
    other[:, 2 * hkv * d : 4 * hkv * d] = qkv[:tc, h * d :]
    return qkv, qn, kn, cos, sin, pos, kc, vc, tc, h, hkv, other, 2 * hkv * d


def test_reference_with_context_kv_equals_the_joint_rows():
    """Block rows in qkv and the context rows' K/V from a column range of another tensor give the
    same queries and cache writes as the joint [Tc + L] rows (the context rows' queries unused)."""
    qkv, qn, kn, cos, sin, pos, kc, vc, tc, h, hkv, other, col = _split_case()
    kr, vr = kc.clone(), vc.clone()
    want = rc.rope_cache_reference(qkv, qn, kn, cos, sin, pos, kr, vr, tc, h, hkv)
    got = rc.rope_cache(qkv[tc:], qn, kn, cos, sin, pos, kc, vc, tc, h, hkv, other, col)
    assert torch.equal(got, want) and torch.equal(kc, kr) and torch.equal(vc, vr)
    with pytest.raises(ValueError, match="context K/V"):
        rc._launch(qkv[tc:], None, None, 0.0, 0.0, cos, sin, pos, kc, vc, tc, h, hkv, other, 3 * col)


def _backend(target, draft, joint: bool):
    from dflash.backends.static_draft import fold_ctx_kv
    from dflash.backends.static_fused import fold_norms
    from dflash.backends.static_torch import StaticBackend

    be = StaticBackend(target, draft, torch.device("cpu"), use_graphs=False, device_loop=True)
    be.attention, be.draft_linear, be.draft_linear_in, be.draft_rope, be.draft_fuse_norm = "split", True, True, True, True
    be.draft_ctx_kv = fold_ctx_kv(draft, be.fused_draft) if joint else None
    be.folded_draft = fold_norms(draft.layers, be.fused_draft, ("input", "post") if joint else ("post",))
    return be


def test_draft_logits_match_the_per_layer_path(tiny_target, monkeypatch):
    """The draft's logits through the joint path equal the per-layer path's (both with the norms
    inside the projections) at two steps, and the joint path ran (rope_cache got context K/V)."""
    from tests.test_static_backend import PROMPT, _custom_draft, _draft_twice

    draft = _custom_draft(tiny_target)
    with torch.no_grad():  # norms that are not all ones: a folding error would show
        for p in draft.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    seen = []
    real = rc.rope_cache_reference
    monkeypatch.setattr(rc, "rope_cache_reference", lambda *a: seen.append(len(a) > 11 and a[11] is not None)
                        or real(*a))  # fmt: skip
    outs = [_draft_twice(_backend(tiny_target, draft, joint), PROMPT * 3) for joint in (False, True)]
    assert seen.count(True) == 2 * len(draft.layers) and seen.count(False) == 2 * len(draft.layers)
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_greedy_tokens_through_the_joint_path(tiny_target):
    """Plain greedy tokens at block 1 and 16 with the joint path (the draft only proposes)."""
    from dflash.loop import speculative_generate
    from tests.conftest import make_draft
    from tests.test_loop_scripted import PROMPT, greedy_reference

    be = _backend(tiny_target, make_draft(tiny_target), True)
    truth = greedy_reference(tiny_target, PROMPT, 20)
    for block in (1, 16):
        toks = [t for r in speculative_generate(be, PROMPT, block_size=block, max_new_tokens=20) for t in r.tokens]
        assert toks == truth, (block, toks, truth)


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from dflash.backends import rope_cache as rc
    from tests.test_draft_ctx_kv import _split_case
    for seed in (0, 1):
        qkv, qn, kn, cos, sin, pos, kc, vc, tc, h, hkv, other, col = _split_case(seed)
        kr, vr = kc.clone(), vc.clone()
        want = rc.rope_cache_reference(qkv, qn, kn, cos, sin, pos, kr, vr, tc, h, hkv)
        got = rc.rope_cache(qkv[tc:].clone(), qn, kn, cos, sin, pos, kc, vc, tc, h, hkv, other, col)
        for a, b in ((got, want), (kc, kr), (vc, vr)):
            err = (a - b).abs().max().item()
            assert err < 1e-5, err
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_rope_cache_kernel_with_context_kv_in_interpreter():
    """The rope_cache kernel (Triton interpreter) with the context rows' K/V from a column range
    of another tensor equals the reference on the joint rows."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", KERNEL_CHECK], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
