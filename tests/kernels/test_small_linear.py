"""The few-row output projection with its residual add (dflash.kernels.small_linear): the torch
reference rounds exactly like the unfused modules, the Triton kernel (Triton's CPU interpreter,
float32) equals it, and the static backend decodes plain greedy tokens with it."""

from __future__ import annotations

import copy
import importlib.util
import textwrap

import pytest
import torch
import torch.nn.functional as F

from dflash.errors import InputError
from dflash.kernels import pdl
from dflash.kernels import small_linear as sl
from dflash.kernels.settings import KernelSettings
from tests.helpers.kernels import compile_for_hopper, run_interpreted


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_rounds_like_the_modules(dtype):
    """Bit for bit: x + linear(h), with and without bias; off CUDA the public function is it."""
    g = torch.Generator().manual_seed(0)
    h, res = torch.randn(3, 64, generator=g).to(dtype), torch.randn(3, 40, generator=g).to(dtype)
    lin = torch.nn.Linear(64, 40, bias=True).to(dtype)
    assert torch.equal(sl.small_linear_reference(h, lin.weight, lin.bias, res), res + lin(h))
    assert torch.equal(sl.small_linear(h, lin.weight, None, res), res + F.linear(h, lin.weight))


def test_switches_and_configs(monkeypatch):
    assert sl.linear_mode("auto", torch.device("cpu")) == "torch"
    with pytest.raises(InputError, match="DFLASH_LINEAR must be auto, all, triton or torch"):
        KernelSettings.resolve(environ={"DFLASH_LINEAR": "cublas"})
    assert KernelSettings.resolve(environ={"DFLASH_LINEAR": "Triton"}).linear == "triton"
    monkeypatch.setattr(sl, "triton", object())  # as on a CUDA machine with Triton
    assert sl.linear_mode(KernelSettings().linear, torch.device("cuda")) == "auto"  # the default there
    for mode in ("triton", "torch", "all"):
        assert sl.linear_mode(mode, torch.device("cuda")) == mode
        assert sl.linear_mode(mode, torch.device("cpu")) == "torch"
    assert sl.kernel_config(1, 576, 576) == (16, 16, 128, 4, 4)
    assert sl.kernel_config(16, 4096, 11008) == (16, 32, 512, 4, 4)  # (16 + 32) x 512 x 2 B x 4 = 192 KiB
    assert sl.kernel_config(16, 576, 1536) == (16, 16, 512, 4, 4)  # the demo's down_proj, as before
    assert sl.kernel_config(1, 3072, 576) == (16, 32, 128, 4, 4)  # the demo's gate+up
    assert sl.kernel_config(1, 4096, 4096) == (16, 32, 256, 4, 6)  # Qwen3-8B's o_proj: tuned (TUNED)
    assert sl.kernel_config(16, 6144, 4096) == (16, 32, 256, 2, 4)  # its qkv, tuned
    assert sl.kernel_config(1, 24576, 4096) == (16, 64, 128, 2, 4)  # its gate+up
    assert sl.kernel_config(20, 4096, 4096) == (32, 32, 256, 4, 4)  # above 16 rows: the rule
    assert sl.kernel_config(1, 4096, 2048) == (16, 32, 256, 4, 4)  # an untuned shape: the rule
    assert sl.kernel_config(1, 4096, 4096, elem=4) == (16, 32, 256, 4, 4)  # float32: the rule, not TUNED
    assert sl.kernel_config(20, 4096, 12288) == (32, 32, 512, 4, 3)  # 4 stages would need 256 KiB
    smem = {cfg: (16 + cfg[0]) * cfg[1] * 2 * cfg[3] for cfg in sl.TUNED.values()}
    assert max(smem.values()) <= sl.SMEM_BUDGET  # every tuned config fits the pipelined tiles' budget

    def config(raw):  # the override, checked at resolve, then used per shape
        return KernelSettings.resolve(environ={"DFLASH_LINEAR_CONFIG": raw}).linear_config

    assert sl.kernel_config(1, 960, 576, override=config("32,128,8,4")) == (16, 32, 128, 8, 4)
    with pytest.raises(InputError, match="BN,BK,warps,stages"):
        config("32,128")
    # per shape (weight rows x K), optionally for one row count; other shapes keep the built-in
    named = config("4096x4096@1=16,512,8,3; 6144x4096=64,128,2,6")
    assert sl.kernel_config(1, 4096, 4096, override=named) == (16, 16, 512, 8, 3)
    assert sl.kernel_config(16, 4096, 4096, override=named) == (16, 32, 256, 4, 6)  # not named: TUNED's
    assert sl.kernel_config(20, 6144, 4096, override=named) == (32, 64, 128, 2, 6)
    assert sl.kernel_config(1, 576, 576, override=named) == (16, 16, 128, 4, 4)
    for bad in ("4096x4096=16,512,8", "4096by4096=16,512,8,3", "4096x4096@one=16,512,8,3", "1x1=1,1,1,1;2x2=0,1,1,1"):
        with pytest.raises(InputError, match="NxK=BN,BK,warps,stages"):
            config(bad)


def test_static_backend_with_fused_linears_decodes_greedy(tiny_target):
    """The fused target and draft forwards with small_linear (reference maths off CUDA) keep plain
    greedy tokens at block 1 and 16, host and device loop, with the same per-step acceptance."""
    from dflash.backends.static.backend import StaticBackend
    from dflash.loop import speculative_generate
    from tests.helpers.tiny import PROMPT, greedy_reference, make_draft

    draft = make_draft(tiny_target)
    truth = greedy_reference(tiny_target, PROMPT, 40)
    for device_loop in (False, True):
        for block in (1, 16):
            runs = []
            for linear in ("torch", "triton", "all"):
                be = StaticBackend(tiny_target, draft, torch.device("cpu"), use_graphs=False,
                                   device_loop=device_loop)  # fmt: skip
                assert be.linear == "torch" and not be.draft_linear and not be.draft_rope  # CPU default
                be.linear, be.draft_linear = linear, linear != "torch"
                be.linear_in, be.draft_linear_in = sl.MAX_ROWS if linear == "all" else 0, linear == "all"
                be.glu = be.draft_glu = linear == "all"  # SiLU * up as the gate+up kernel's epilogue
                rounds = list(speculative_generate(be, PROMPT, block_size=block, max_new_tokens=40))
                runs.append(([t for r in rounds for t in r.tokens], [r.accepted for r in rounds[1:]]))
            assert runs[1][0] == truth
            assert runs[1] == runs[0] and runs[2] == runs[0]


def test_auto_takes_in_projections_at_every_width(tiny_target, monkeypatch):
    """The linear setting auto (and all): a model's fused qkv and gate+up projections run small_linear
    in every forward of up to MAX_ROWS rows, target and draft, whatever their size (the H200's
    Qwen3-8B shape too); triton and torch never; recorded with benchmark results."""
    from dflash.backends.static import kernel_choice
    from dflash.backends.static.backend import StaticBackend
    from tests.helpers.tiny import make_draft

    draft = make_draft(tiny_target)

    def made(mode: str) -> dict:
        monkeypatch.setattr(kernel_choice, "linear_mode", lambda setting, device: mode)
        return StaticBackend(tiny_target, draft, torch.device("cpu"), use_graphs=False).describe()["linear_in"]

    assert made("auto") == {"target": sl.MAX_ROWS, "draft": sl.MAX_ROWS}
    assert made("all") == {"target": sl.MAX_ROWS, "draft": sl.MAX_ROWS}
    assert made("triton") == {"target": 0, "draft": 0}
    assert made("torch") == {"target": 0, "draft": 0}


def test_pdl_switch(monkeypatch):
    """PDL: on by default on a Hopper GPU with Triton, never without CUDA or before Hopper; the
    pdl setting 0 turns it off, kernels keeps Inductor's off, draft puts both in the draft's
    forward only; a typo is an error, not a silent "on"."""
    from dflash.kernels.settings import pdl_wanted

    assert not pdl.pdl_supported(torch.device("cpu"))
    monkeypatch.setattr(pdl, "_HAS_GDC", True)
    monkeypatch.setattr(pdl, "_CAPABILITY", {0: 9})
    assert pdl.pdl_supported(torch.device("cuda", 0)) and not pdl.pdl_supported(torch.device("cpu"))
    assert pdl.default_launch(torch.device("cuda", 0)).pdl
    pdl._CAPABILITY[0] = 8  # Ampere: no programmatic dependent launch
    assert not pdl.pdl_supported(torch.device("cuda", 0))
    assert KernelSettings().pdl == "1"
    for part in ("target", "draft"):
        assert pdl_wanted("1", part) and pdl_wanted("1", part, inductor=True)
        assert pdl_wanted("kernels", part) and not pdl_wanted("kernels", part, inductor=True)
        assert not pdl_wanted("0", part) and not pdl_wanted("0", part, inductor=True)
        assert pdl_wanted("draft", part) == pdl_wanted("draft", part, inductor=True) == (part == "draft")
    assert KernelSettings.resolve(environ={"DFLASH_PDL": "Kernels"}).pdl == "kernels"
    assert KernelSettings.resolve(environ={"DFLASH_PDL": "off"}).pdl == "0"
    with pytest.raises(InputError, match="DFLASH_PDL must be 1, 0, kernels or draft"):
        KernelSettings.resolve(environ={"DFLASH_PDL": "kernel"})


def test_glu_switch_and_where_it_runs(tiny_target, monkeypatch):
    """The glu setting (default on; DFLASH_GLU=0 off; another value refused) reaches the
    target's SiLU MLPs and the draft's where their gate+up projections run small_linear;
    recorded; a target with another activation keeps its own; the unfused maths equal the
    fused reference."""
    from dflash.backends.static import kernel_choice
    from dflash.backends.static.backend import StaticBackend
    from tests.helpers.tiny import make_draft

    assert KernelSettings().glu and not KernelSettings.resolve(environ={"DFLASH_GLU": "0"}).glu
    with pytest.raises(InputError, match="DFLASH_GLU must be 1 or 0"):
        KernelSettings.resolve(environ={"DFLASH_GLU": "maybe"})
    draft = make_draft(tiny_target)

    def made(mode: str, glu: str = "1") -> dict:
        monkeypatch.setattr(kernel_choice, "linear_mode", lambda setting, device: mode)
        settings = KernelSettings.resolve(environ={"DFLASH_GLU": glu})
        return StaticBackend(tiny_target, draft, torch.device("cpu"), use_graphs=False,
                             settings=settings).describe()["glu"]  # fmt: skip

    assert made("auto") == {"target": True, "draft": True}
    assert made("triton") == {"target": False, "draft": False}  # gate+up on cuBLAS: nothing to fuse into
    assert made("all", "0") == {"target": False, "draft": False}
    monkeypatch.setattr(kernel_choice, "_in_proj_rows", lambda linear: 1)  # in-projections: 1-row steps only
    assert made("auto") == {"target": True, "draft": False}
    monkeypatch.undo()
    monkeypatch.setattr(kernel_choice, "linear_mode", lambda setting, device: "all")
    monkeypatch.setattr(tiny_target.config, "hidden_act", "gelu")
    assert StaticBackend(tiny_target, draft, torch.device("cpu"), use_graphs=False).describe()["glu"] == {
        "target": False, "draft": True}  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 8, generator=g), torch.randn(10, 8, generator=g)
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    torch.testing.assert_close(sl.small_linear_glu(x, w), F.silu(gate) * up)  # CPU: the reference
    with pytest.raises(ValueError, match="gate and up halves"):
        sl.small_linear_glu(x, w[:9])


def test_fuse_norm_switch_and_greedy_parity(tiny_target, monkeypatch):
    """The fuse_norm setting (None: on for hidden sizes <= 1024 in bf16/fp16; DFLASH_FUSE_NORM=1
    on, 0 off, another value refused) reaches the target and the draft where their
    in-projections run small_linear and their norms are plain RMSNorms (recorded when on); the
    static path with it (reference maths on CPU) decodes exactly plain greedy, with and without
    the SwiGLU epilogue and the RoPE kernel's path."""
    from dflash.backends.static import fused as static_fused
    from dflash.backends.static import kernel_choice
    from dflash.backends.static.backend import StaticBackend
    from tests.helpers.static import assert_static_greedy
    from tests.helpers.tiny import make_draft

    assert KernelSettings().fuse_norm is None  # the default: by hidden size and dtype
    assert sl.fuse_norm_auto(576, torch.bfloat16) and sl.fuse_norm_auto(1024, torch.float16)
    assert not sl.fuse_norm_auto(4096, torch.bfloat16)  # measured slower at Qwen3-8B's size
    assert not sl.fuse_norm_auto(576, torch.float32)  # the reference dtype keeps the modules' maths
    assert KernelSettings.resolve(environ={"DFLASH_FUSE_NORM": "0"}).fuse_norm is False
    with pytest.raises(InputError, match="DFLASH_FUSE_NORM must be 1 or 0"):
        KernelSettings.resolve(environ={"DFLASH_FUSE_NORM": "2"})
    draft = make_draft(tiny_target)
    forced = KernelSettings.resolve(environ={"DFLASH_FUSE_NORM": "1"})

    def made(settings=None) -> dict | None:
        return StaticBackend(tiny_target, draft, torch.device("cpu"), use_graphs=False,
                             settings=settings).describe().get("fuse_norm")  # fmt: skip

    monkeypatch.setattr(kernel_choice, "linear_mode", lambda setting, device: "all")
    assert made(forced) == {"target": True, "draft": True}  # CPU: SDPA, no RoPE kernel: the norms still fold
    assert made() is None  # unset: off in float32
    monkeypatch.setattr(kernel_choice, "fuse_norm_auto", lambda hidden, dtype: True)  # a bf16 model's size
    assert made() == {"target": True, "draft": True}
    monkeypatch.setattr(kernel_choice, "_in_proj_rows", lambda linear: 1)  # in-projections: 1-row steps only
    assert made() is None  # the default wants every width (block 1 = verify maths); the draft has none
    assert made(forced) == {"target": True, "draft": False}  # 1 forces it where it can run
    monkeypatch.undo()
    monkeypatch.setattr(kernel_choice, "linear_mode", lambda setting, device: "all")
    monkeypatch.setattr(kernel_choice, "attention_mode", lambda mode, device, dtype=None: "split")
    assert made(forced) == {"target": True, "draft": True}
    monkeypatch.setattr(kernel_choice, "linear_mode", lambda setting, device: "triton")  # in-projections on cuBLAS
    assert made(forced) is None
    assert static_fused.norms_fit(tiny_target.model.layers, torch.float32)
    assert not static_fused.norms_fit(tiny_target.model.layers, torch.bfloat16)  # another dtype
    layer = tiny_target.model.layers[0]
    kept, layer.post_attention_layernorm = layer.post_attention_layernorm, torch.nn.LayerNorm(64)
    assert not static_fused.norms_fit(tiny_target.model.layers, torch.float32)
    layer.post_attention_layernorm = kept
    for glu, rope in ((False, True), (True, True), (True, False)):
        assert_static_greedy(attention="split", linear="all", linear_in=sl.MAX_ROWS, draft_linear=True,
                             draft_linear_in=True, target_rope=rope, draft_rope=rope, glu=glu, draft_glu=glu,
                             fuse_norm=True, draft_fuse_norm=True)  # fmt: skip


def prefill_verify_draft(be, fuse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """With the norms inside the projections (``fuse``) or not: the verify logits of 7 proposals
    after a 20-token prefill, the features written meanwhile and the draft's logits."""
    prompt, props = list(range(5, 25)), torch.arange(3, 10)
    be.fuse_norm = be.draft_fuse_norm = fuse
    be.reset(256)
    last, _ = be.prefill(prompt, True)
    logits, _ = be.verify(int(last.argmax()), props, len(prompt), True)
    n = len(prompt) + 1 + props.shape[0]
    return logits.clone(), be.feats[:n].clone(), be.draft(int(last.argmax()), None, n, 16)[1].clone()


@pytest.mark.parametrize("glu", [False, True])
def test_fuse_norm_equals_the_norm_modules(tiny_target, monkeypatch, glu):
    """With the norms inside the projections (reference maths, float32), the target's verify
    logits, the features it writes and the draft's logits equal the unfused path's to 1e-3
    (float32 roundings of the folded weights, through every layer), and the folded projections
    run where they should: 2 x layers per target forward (every layer's input and
    post-attention norm), one per draft layer (the post-attention norm)."""
    from dflash.backends.static import fused as static_fused
    from dflash.backends.static.backend import StaticBackend
    from tests.helpers.tiny import make_draft

    tiny_target = copy.deepcopy(tiny_target)  # the norms below change: never the shared fixture
    draft = make_draft(tiny_target)
    with torch.no_grad():  # norms that are not all ones, so that a missing fold shows
        for layer in [*tiny_target.model.layers, *draft.layers]:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5)
    be = StaticBackend(tiny_target, draft, torch.device("cpu"), use_graphs=False, device_loop=False)
    for name, value in dict(attention="split", linear="all", linear_in=sl.MAX_ROWS, draft_linear=True,
                            draft_linear_in=True, target_rope=True, draft_rope=True, glu=glu, draft_glu=glu).items():
        setattr(be, name, value)
    be.folded_target = static_fused.fold_norms(tiny_target.model.layers, be.fused_target)
    be.folded_draft = static_fused.fold_norms(draft.layers, be.fused_draft, ("post",))
    calls = []
    real = sl.small_linear_rn
    monkeypatch.setattr(static_fused, "small_linear_rn", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))

    plain = prefill_verify_draft(be, False)
    assert calls == []
    fused = prefill_verify_draft(be, True)
    layers, draft_layers = be.n_layers, len(draft.layers)
    qkv, gate_up = (tuple(w.weight.shape) for w in be.fused_target[0])
    dgate_up = tuple(be.fused_draft[0][1].weight.shape)
    one_target = [qkv, gate_up] * layers
    assert [tuple(c) for c in calls] == one_target * 2 + [dgate_up] * draft_layers  # prefill, verify, draft
    for a, b in zip(plain, fused, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3)
    # a fold that forgot a norm's weight is visible at this tolerance
    be.folded_target[0] = (be.fused_target[0][0], be.folded_target[0][1])
    assert not torch.allclose(prefill_verify_draft(be, True)[0], plain[0], rtol=1e-3, atol=1e-3)


def test_capture_failure_turns_off_fused_norm_then_glu(tiny_target, capsys, gpu_like):
    """A failed capture turns off the norms inside the projections first, then the SiLU * up
    epilogue, one warning line each naming the override, before the Triton projections."""
    import dataclasses

    from dflash.backends.static.backend import StaticBackend
    from tests.helpers.tiny import make_draft

    settings = dataclasses.replace(KernelSettings(), linear="all", fuse_norm=True, qkv_rope=False)
    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False, settings=settings)
    seen = []

    def capture(fn, inputs):
        seen.append((be.fuse_norm, be.draft_fuse_norm, be.glu, be.draft_glu, be.linear))
        if be.glu:
            raise RuntimeError("triton: out of resources")
        return "graph", "out", inputs

    be._capture = capture
    assert be._graph("verify", 1, lambda: ("ids", "pos"))[1] == "out"
    assert seen == [(True, True, True, True, "all"), (False, False, True, True, "all"),
                    (False, False, False, False, "all")]  # fmt: skip
    assert be.folded_target is None and be.folded_draft is None  # the folded copies: memory back
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(" failed")[0] for line in err] == [
        "dflash: the norms inside the projections", "dflash: the SiLU * up epilogue"]
    assert "DFLASH_GLU=0 or --kernels off silences this" in err[1]


def test_fits_only_plain_row_major_linears(tiny_target):
    from dflash.backends.static.draft import draft_small_linear_fits
    from dflash.backends.static.fused import small_linear_fits
    from tests.helpers.tiny import make_draft

    assert small_linear_fits(tiny_target)
    draft = make_draft(tiny_target)
    assert draft_small_linear_fits(draft)
    draft.layers[0].mlp.down_proj.weight.data = draft.layers[0].mlp.down_proj.weight.data.t().contiguous().t()
    assert not draft_small_linear_fits(draft)  # column-major weight


KERNEL_CHECK = textwrap.dedent("""
    import os
    import torch
    import torch.nn.functional as F
    from dflash.kernels import small_linear as sl

    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 48, 64), (3, 100, 96), (16, 40, 300), (20, 33, 64), (32, 64, 16)):
        x = torch.randn(m, k, generator=g)
        w, b = torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)
        res = torch.randn(m, n, generator=g)
        for args in ((x, w, None, None), (x, w, b, None), (x, w, None, res), (x, w, b, res)):
            got, want = sl.small_linear(*args), sl.small_linear_reference(*args)
            err = (got - want).abs().max().item()
            assert got.shape == want.shape and err < 1e-4, (m, n, k, err)
        # SiLU(gate) * up as the epilogue: w's rows are the gate then the up halves
        wg = torch.cat((w, w[:1] * 0.5)) if n % 2 else w  # gate and up halves: an odd N = rows / 2 too
        bg = torch.cat((b, b[:1])) if n % 2 else b
        for bias in (None, bg):
            got, want = sl.small_linear_glu(x, wg, bias), sl.small_linear_glu_reference(x, wg, bias)
            err = (got - want).abs().max().item()
            assert got.shape == (m, wg.shape[0] // 2) and err < 1e-4, (m, n, k, err)
            # the RMSNorm inside the projection (row factors on the accumulator), plain and SwiGLU,
            # (with the bias only: time)
            for glu in (False, True) if bias is not None else ():
                got = sl.small_linear_rn(x, wg, bias, 1e-5, glu)
                want = sl.small_linear_rn_reference(x, wg, bias, 1e-5, glu)
                err = (got - want).abs().max().item()
                assert got.shape == want.shape and err < 1e-4, (m, n, k, glu, err)
    # the RMSNorm module then the projection: the same values as the folded form (float32)
    x, w, nw = torch.randn(5, 96, generator=g), torch.randn(30, 96, generator=g), torch.rand(96, generator=g) + 0.5
    norm = torch.nn.RMSNorm(96, eps=1e-5)
    norm.weight.data = nw
    want = F.linear(norm(x), w)
    assert (sl.small_linear_rn(x, sl.fold_norm_weight(w, nw), None, 1e-5) - want).abs().max().item() < 1e-4
    # the fused static forward with the kernel: plain greedy tokens
    from tests.helpers.static import assert_static_greedy
    assert_static_greedy(linear="triton", draft_linear=True)
    assert_static_greedy(linear="all", linear_in=sl.MAX_ROWS, draft_linear=True, draft_linear_in=True)  # qkv, gate+up too
    assert_static_greedy(linear="auto", linear_in=1, draft_linear=True)  # qkv, gate+up in 1-row steps only
    assert_static_greedy(linear="all", linear_in=sl.MAX_ROWS, draft_linear=True, draft_linear_in=True, glu=True,
                         draft_glu=True)  # SiLU * up as the gate+up kernel's epilogue
    # the RMSNorms inside the in-projections (the fuse_norm setting), with the RoPE kernel's path
    assert_static_greedy(attention="split", linear="all", linear_in=sl.MAX_ROWS, draft_linear=True,
                         draft_linear_in=True, target_rope=True, draft_rope=True, glu=True, draft_glu=True,
                         fuse_norm=True, draft_fuse_norm=True)  # fmt: skip
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernel_in_interpreter():
    """The kernel (Triton interpreter, float32) equals the reference with and without bias and
    residual, odd sizes included, and the static backend with it decodes exactly plain greedy."""
    out = run_interpreted(KERNEL_CHECK, timeout=1200)  # about 450 s on 2 CPU cores
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


PDL_CHECK = textwrap.dedent("""
    import os
    import torch, triton, triton.language as tl
    from dflash.kernels import small_linear as sl

    @triton.jit
    def _no_wait():  # the interpreter has no grid-dependency control: nothing to wait for
        pass

    tl.extra.cuda.gdc_wait = tl.extra.cuda.gdc_launch_dependents = _no_wait
    from dflash.kernels.settings import KernelSettings, Launch
    torch.manual_seed(0)
    for m, n, k in ((3, 40, 300), (16, 24, 1100), (1, 17, 64)):
        x, w, r = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
        for bk in (32, 64, 128):
            kl = Launch(KernelSettings(linear_config=f"16,{bk},4,2"), pdl=True)  # every launch takes the PDL path
            y = sl.small_linear(x, w, None, r, launch=kl)
            assert (y - (r + x @ w.T)).abs().max().item() < 1e-4, (m, n, k, bk)
            wg = torch.cat((w, w.flip(0)))  # gate and up halves
            want = sl.small_linear_glu_reference(x, wg)
            err = (sl.small_linear_glu(x, wg, launch=kl) - want).abs().max().item()
            assert err < 1e-5 * want.abs().max().item() + 1e-4, (m, n, k, bk, err)  # float32 sums
            for glu in (False, True):  # the row factors from the tiles on both sides of the wait
                got = sl.small_linear_rn(x, wg, None, 1e-5, glu, launch=kl)
                want = sl.small_linear_rn_reference(x, wg, None, 1e-5, glu)
                err = (got - want).abs().max().item()
                assert err < 1e-5 * want.abs().max().item() + 1e-4, (m, n, k, bk, glu)
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_pdl_path_in_interpreter():
    """The PDL path (the first weight tile loaded before the wait, the K loop after it) gives the
    exact product, and with the RMSNorm's row factors (plain and SwiGLU), K of one tile up to several (Triton interpreter, float32, grid-dependency
    calls stubbed: the interpreter has none)."""
    out = run_interpreted(PDL_CHECK)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_draft_logits_with_fused_linears_match(tiny_target):
    """The draft's logits through small_linear (final norm in the LM head) equal the module path's
    at a first and a second step."""
    from dflash.backends.static.backend import StaticBackend
    from tests.helpers.static import draft_twice
    from tests.helpers.tiny import PROMPT, custom_draft

    draft = custom_draft(tiny_target)
    outs = []
    for lin in (False, True):
        be = StaticBackend(tiny_target, draft, torch.device("cpu"), use_graphs=False)
        be.draft_linear = lin
        outs.append(draft_twice(be, PROMPT * 3))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


OFF_EXTRAS = {"GLU": False, "RN": False}  # the plain projection's switches


def _kernel_signature(consts: dict) -> dict:
    """Triton signature of _small_linear_kernel for an sm_90 compile: ``consts`` as constexprs,
    bf16 tensors, int32 sizes and strides, a float32 epsilon."""
    ptrs = {"X": "*bf16", "W": "*bf16", "B": "*bf16", "RES": "*bf16", "Y": "*bf16"}
    names = sl._small_linear_kernel.arg_names
    return {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n == "EPS" else "i32") for n in names}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_kernel_compiles_for_hopper_with_pdl():
    """With PDL the kernel compiles for sm_90 (the H200) without a GPU: the first weight tile
    loads before the grid-dependency wait, the rest after it. (The interpreter has no wait.)"""
    consts = {"HAS_BIAS": False, "HAS_RES": True, "IEEE": False, "BM": 16, "BN": 32, "BK": 512, "PDL": True,
              **OFF_EXTRAS}  # fmt: skip
    kernel = compile_for_hopper(sl._small_linear_kernel, _kernel_signature(consts), consts, num_warps=4, num_stages=3)
    ptx = kernel.asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("ld.global") < wait and ptx.rfind("ld.global") > wait
    assert "prefetch.global.L2" not in ptx


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("rows", [16, 32])
@pytest.mark.parametrize("rn", [False, True])
def test_glu_kernel_compiles_for_hopper(rows, rn):
    """The SiLU(gate) * up epilogue (gate and up rows in one tile, split after the dot) compiles
    for sm_90 with PDL, for the demo's 1-16 and the draft's 32-row forwards, with and without
    the RMSNorm's row factors (x x^T on the tensor cores from the x tiles already loaded: no
    extra global load, none before the wait)."""

    counts = {}
    for with_rn in {False, rn}:
        consts = {"HAS_BIAS": False, "HAS_RES": False, "IEEE": False, "BM": rows, "BN": 16, "BK": 128, "PDL": True,
                  **OFF_EXTRAS, "GLU": True, "RN": with_rn}  # fmt: skip
        kernel = compile_for_hopper(sl._small_linear_kernel, _kernel_signature(consts), consts, num_warps=4, num_stages=4)
        ptx = kernel.asm["ptx"]
        counts[with_rn] = (ptx[: ptx.index("griddepcontrol.wait")].count("ld.global"), ptx.count("ld.global"),
                           "rsqrt" in ptx)  # fmt: skip
    # only the first weight tile loads before the wait, with or without the norm; no extra loads
    assert counts[rn][:2] == counts[False][:2] and counts[False][0] >= 1
    assert counts[rn][2] == bool(rn)  # the row factors are computed only with the norm


def test_sweep_shapes_parse_named_sets_and_custom_roles():
    """scripts/small_linear_sweep.py --shapes: named sets and ROLE=NxK entries for a model of
    one's own; anything else exits with a message naming the form."""
    from scripts.small_linear_sweep import SHAPES, parse_shapes

    got = parse_shapes("qwen3-8b, o=4096x4096,gate_up=28672X4096")
    assert got == {"qwen3-8b": SHAPES["qwen3-8b"], "custom": {"o": (4096, 4096), "gate_up": (28672, 4096)}}
    for bad in ("proj=4096x4096", "o=4096", "llama"):
        with pytest.raises(SystemExit, match="ROLE=NxK"):
            parse_shapes(bad)
