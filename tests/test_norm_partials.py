"""RMSNorms inside the in-projections with their sums of squares written by the kernel before
(dflash.kernels.norm_partials): the references' maths, the switch, the static path's tokens
and values, and the Triton kernels (interpreter; sm_90 compile)."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch
import torch.nn.functional as F

from dflash.errors import InputError
from dflash.kernels import norm_partials as npart
from dflash.kernels import small_linear as sl
from tests.triton_helpers import compile_for_hopper, run_interpreted


def test_references_give_the_norm_then_the_projection():
    """The producer's partial sums add up to each row's sum of squares of its rounded output
    ([P, M], P = ceil(N / columns per program)), and the consumer with them equals RMSNorm (the
    module) then the projection, and the squares form, in float32."""
    g = torch.Generator().manual_seed(0)
    m, n, k = 3, 100, 48  # 100 columns: 7 programs of 16, the last one short
    x, w, res = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5, torch.randn(m, n, generator=g)
    y, sq = npart.small_linear_sq(x, w, None, res)
    assert torch.equal(y, res + F.linear(x, w))
    cols = npart.partial_columns(m, n, k)
    assert sq.shape == (-(-n // cols), m) and sq.dtype == torch.float32 and cols == 16
    torch.testing.assert_close(sq.sum(0), y.pow(2).sum(-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(sq[1], y[:, cols:2 * cols].pow(2).sum(-1), rtol=1e-6, atol=0)  # one program's share
    wn, nw, b = torch.randn(30, n, generator=g), torch.rand(n, generator=g) + 0.5, torch.randn(30, generator=g)
    norm = torch.nn.RMSNorm(n, eps=1e-5)
    norm.weight.data = nw
    folded = sl.fold_norm_weight(wn, nw)
    got = npart.small_linear_rnp(y, folded, b, sq, 1e-5)
    torch.testing.assert_close(got, F.linear(norm(y), wn, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, sl.small_linear_rn(y, folded, b, 1e-5), rtol=1e-6, atol=1e-6)
    wg = torch.cat((folded, folded.flip(0)))  # gate and up halves: SiLU(gate) * up
    torch.testing.assert_close(npart.small_linear_rnp(y, wg, None, sq, 1e-5, glu=True),
                               sl.small_linear_rn(y, wg, None, 1e-5, glu=True), rtol=1e-6, atol=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="partial sums"):
        npart.small_linear_rnp(y, folded, b, sq[:, :2], 1e-5)  # sums of 2 rows for 3
    with pytest.raises(ValueError, match="partial sums"):
        npart.small_linear_rnp(y, folded, b, sq.double(), 1e-5)
    with pytest.raises(ValueError, match="partial sums"):  # the kernel reads rows of P with unit stride
        npart.small_linear_rnp(y, folded, b, sq.t().contiguous().t(), 1e-5)


def test_form_switch(monkeypatch):
    """DFLASH_FUSE_NORM_FORM: squares unless told partials; another value is refused, also by the
    static path's check of every switch (on any device)."""
    from dflash.backends.static.switches import check_env

    monkeypatch.delenv(npart.FORM_ENV, raising=False)
    assert npart.norm_form() == "squares"
    monkeypatch.setenv(npart.FORM_ENV, "Partials")
    assert npart.norm_form() == "partials"
    check_env()
    monkeypatch.setenv(npart.FORM_ENV, "sums")
    with pytest.raises(InputError, match="DFLASH_FUSE_NORM_FORM must be squares or partials"):
        check_env()


def test_static_path_with_partials_decodes_greedy(tiny_target, monkeypatch):
    """The static path with the partial-sums form (references on CPU) reaches target and draft
    where the norms fold, is recorded, and decodes exactly plain greedy at block 1 and 16, with
    and without the SwiGLU epilogue and the RoPE kernel's path."""
    from dflash.backends.static import backend as static_torch
    from dflash.backends.static.backend import StaticBackend
    from tests.conftest import make_draft
    from tests.test_split_attention import assert_static_greedy

    monkeypatch.setenv("DFLASH_FUSE_NORM", "1")
    monkeypatch.setenv(npart.FORM_ENV, "partials")
    monkeypatch.setattr(static_torch, "linear_mode", lambda device: "all")
    desc = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False).describe()
    assert desc["fuse_norm"] == {"target": True, "draft": True} and desc["fuse_norm_form"] == "partials"
    monkeypatch.setenv("DFLASH_FUSE_NORM", "0")
    assert "fuse_norm_form" not in StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"),
                                                 use_graphs=False).describe()  # fmt: skip
    for glu, rope in ((False, True), (True, True), (True, False)):
        assert_static_greedy(attention="split", linear="all", linear_in=sl.MAX_ROWS, draft_linear=True,
                             draft_linear_in=True, target_rope=rope, draft_rope=rope, glu=glu, draft_glu=glu,
                             fuse_norm=True, draft_fuse_norm=True, norm_partials=True)  # fmt: skip


@pytest.mark.parametrize("glu", [False, True])
def test_partials_equal_the_norm_modules(tiny_target, monkeypatch, glu):
    """With the partial-sums form (reference maths, float32) the verify logits, the features and
    the draft's logits equal the unfused path's to 1e-3, and the kernels run where they should:
    per target forward every o_proj and every down_proj but the last write partial sums, every
    input norm but the first (after the embedding) and every post-attention norm read them; per
    draft layer o_proj writes them and gate+up reads them."""
    from dflash.backends.static import fused as static_fused
    from dflash.backends.static.backend import StaticBackend
    from tests.conftest import make_draft
    from tests.test_small_linear import prefill_verify_draft

    draft = make_draft(tiny_target)
    with torch.no_grad():  # norms that are not all ones, so that a missing fold shows
        for layer in [*tiny_target.model.layers, *draft.layers]:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5)
    be = StaticBackend(tiny_target, draft, torch.device("cpu"), use_graphs=False, device_loop=False)
    for name, value in dict(attention="split", linear="all", linear_in=sl.MAX_ROWS, draft_linear=True,
                            draft_linear_in=True, target_rope=True, draft_rope=True, glu=glu, draft_glu=glu,
                            norm_partials=True).items():  # fmt: skip
        setattr(be, name, value)
    be.folded_target = static_fused.fold_norms(tiny_target.model.layers, be.fused_target)
    be.folded_draft = static_fused.fold_norms(draft.layers, be.fused_draft, ("post",))
    calls = []
    real_sq, real_rnp, real_rn = npart.small_linear_sq, npart.small_linear_rnp, sl.small_linear_rn
    monkeypatch.setattr(static_fused, "small_linear_sq", lambda *a: calls.append(("sq", a[1].shape)) or real_sq(*a))
    monkeypatch.setattr(static_fused, "small_linear_rnp", lambda *a: calls.append(("rnp", a[1].shape)) or real_rnp(*a))
    monkeypatch.setattr(static_fused, "small_linear_rn", lambda *a: calls.append(("rn", a[1].shape)) or real_rn(*a))
    plain = prefill_verify_draft(be, False)
    assert calls == []
    fused = prefill_verify_draft(be, True)
    layers = be.n_layers
    qkv, gate_up = (tuple(w.weight.shape) for w in be.fused_target[0])
    o, down = (tuple(m.weight.shape) for m in (tiny_target.model.layers[0].self_attn.o_proj,
                                              tiny_target.model.layers[0].mlp.down_proj))  # fmt: skip
    one = []
    for i in range(layers):
        one += [("rnp", qkv)] if i else []  # the first input norm (after the embedding) keeps its kernel
        one += [("sq", o), ("rnp", gate_up)]
        one += [("sq", down)] if i < layers - 1 else []  # the final norm keeps its kernel
    dlayer = draft.layers[0]
    done = [("sq", tuple(dlayer.self_attn.o_proj.weight.shape)), ("rnp", tuple(be.fused_draft[0][1].weight.shape))]
    want = one * 2 + done * len(draft.layers)  # prefill, verify, draft
    assert [(c, tuple(s)) for c, s in calls] == want
    for a, b in zip(plain, fused, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3)


def test_capture_failure_drops_the_partial_sums_first(tiny_target, capsys):
    """A failed capture with the partial-sums form turns it off first (the squares form keeps the
    folded weights), then the norms inside the projections, one line each naming the switch."""
    from dflash.backends.static.backend import StaticBackend
    from tests.conftest import make_draft

    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False)
    be.linear, be.linear_in, be.draft_linear, be.draft_linear_in = "all", sl.MAX_ROWS, True, True
    be.fuse_norm = be.draft_fuse_norm = be.norm_partials = True
    be.folded_target = be.folded_draft = ["kept"]
    seen = []

    def capture(fn, inputs):
        seen.append((be.norm_partials, be.fuse_norm, be.folded_target))
        if be.fuse_norm:
            raise RuntimeError("triton: out of resources")
        return "graph", "out", inputs

    be._capture = capture
    assert be._graph("verify", 1, lambda: ("ids", "pos"))[1] == "out"
    assert seen == [(True, True, ["kept"]), (False, True, ["kept"]), (False, False, None)]
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(" failed")[0] for line in err] == [
        "dflash: the norms' partial sums", "dflash: the norms inside the projections"]
    assert "DFLASH_FUSE_NORM_FORM=squares silences this" in err[0]
    assert "fuse_norm_form" not in be.describe()


KERNEL_CHECK = textwrap.dedent("""
    import os, sys
    import torch, triton, triton.language as tl
    from dflash.kernels import norm_partials as npart, small_linear as sl

    if sys.argv[1] == "pdl":  # the interpreter has no grid-dependency control: nothing to wait for
        @triton.jit
        def _no_wait():
            pass

        tl.extra.cuda.gdc_wait = tl.extra.cuda.gdc_launch_dependents = _no_wait
        sl.pdl_enabled = lambda device, inductor=False: True
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 48, 64), (3, 100, 96), (16, 200, 40), (20, 33, 64), (2, 16, 64)):  # the last: one program
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
        res, b = torch.randn(m, n, generator=g), torch.randn(n, generator=g)
        y, sq = npart.small_linear_sq(x, w, b, res)
        wy, wsq = npart.small_linear_sq_reference(x, w, b, res)
        assert (y - wy).abs().max().item() < 1e-4 and sq.shape == wsq.shape, (m, n, k)
        assert ((sq - wsq).abs() / wsq.abs().clamp_min(1e-3)).max().item() < 1e-4, (m, n, k)
        wn = torch.randn(2 * 24, n, generator=g) / n**0.5  # a gate+up weight (norm folded in)
        for glu in (False, True):
            got = npart.small_linear_rnp(y, wn, None, sq, 1e-5, glu)
            want = npart.small_linear_rnp_reference(y, wn, None, sq, 1e-5, glu)
            err = (got - want).abs().max().item()
            assert got.shape == want.shape and err < 1e-4, (m, n, k, glu, err)
        if sys.argv[1] == "plain":  # the fake (meta) shapes match the real outputs, schema checked
            torch.library.opcheck(npart._sq_op, (x, w, b, res), test_utils=("test_schema", "test_faketensor"))
            torch.library.opcheck(npart._rnp_op, (y, wn, None, sq, 1e-5, True),
                                  test_utils=("test_schema", "test_faketensor"))
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("path", ["plain", "pdl"])
def test_kernels_in_interpreter(path):
    """Producer and consumer kernels (Triton interpreter, float32) equal the references: y, the
    partial sums of its squares (a short last program and a single program included), the norm
    from them, plain and SwiGLU, with and without the PDL path (grid-dependency calls stubbed);
    the custom ops' fake shapes match their outputs."""
    out = run_interpreted(KERNEL_CHECK, path)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_consumer_compiles_for_hopper_and_reads_partials_after_the_wait():
    """With PDL the consumer compiles for sm_90 and loads no more before the grid-dependency wait
    than the plain projection (the partial sums are read after it); the producer compiles too."""

    from tests.test_small_linear import OFF_EXTRAS, _kernel_signature

    def ptx(**extra) -> str:
        consts = {"HAS_BIAS": False, "HAS_RES": False, "IEEE": False, "BM": 16, "BN": 32, "BK": 256, "PDL": True,
                  "LINE": 64, "PRE_K": 0, **OFF_EXTRAS, **extra}  # fmt: skip
        return compile_for_hopper(sl._small_linear_kernel, _kernel_signature(consts), consts, num_warps=4, num_stages=4).asm["ptx"]

    plain, rnp = ptx(), ptx(RNP=True, PP=128)
    before = [p[: p.index("griddepcontrol.wait")].count("ld.global") for p in (plain, rnp)]
    assert before[0] == before[1] >= 1 and rnp.count("ld.global") > plain.count("ld.global") and "rsqrt" in rnp
    producer = ptx(HAS_RES=True, HAS_SQO=True)
    assert producer.count("st.global") > ptx(HAS_RES=True).count("st.global")
