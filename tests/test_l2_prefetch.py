"""L2 weight prefetch on a side stream (dflash.kernels.l2_prefetch): the switch, the byte plan,
where the static forwards ask for it (every layer after its qkv projection, one join per forward;
tokens unchanged) and the capture fall-back. The kernel itself (PTX prefetches) needs a GPU:
``scripts/l2_prefetch_check.py`` and ``scripts/h200_speed_session.sh prefetch``."""

from __future__ import annotations

import pytest
import torch

from dflash.errors import InputError
from dflash.kernels import l2_prefetch as lp
from tests.triton_helpers import compile_for_hopper


def test_budget_switch(monkeypatch, tiny_target):
    """DFLASH_PREFETCH is MiB per layer (default off); a bad value is a one-line error when a
    backend is built, on CPU too; off CUDA (or without Triton) the budget is 0."""
    from dflash.backends.static.backend import StaticBackend
    from tests.conftest import make_draft

    cuda = torch.device("cuda")
    monkeypatch.setattr(lp, "triton", object())  # as with Triton installed
    monkeypatch.delenv("DFLASH_PREFETCH", raising=False)
    assert lp.prefetch_budget(cuda) == lp.DEFAULT_MIB << 20
    monkeypatch.setenv("DFLASH_PREFETCH", "24")
    assert lp.prefetch_budget(cuda) == 24 << 20 and lp.prefetch_budget(torch.device("cpu")) == 0
    monkeypatch.setenv("DFLASH_PREFETCH", "0")
    assert lp.prefetch_budget(cuda) == 0
    monkeypatch.setenv("DFLASH_PREFETCH", "24,early")
    assert lp.prefetch_setting(cuda) == (24 << 20, True) and lp.prefetch_setting(torch.device("cpu")) == (0, False)
    monkeypatch.setenv("DFLASH_PREFETCH", "24,late")
    with pytest.raises(InputError, match="optionally with ',early'"):
        lp.prefetch_setting(cuda)
    monkeypatch.setenv("DFLASH_PREFETCH", "lots")
    with pytest.raises(InputError, match="DFLASH_PREFETCH must be a whole number of MiB"):
        StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False)
    monkeypatch.setenv("DFLASH_PREFETCH", "24")
    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False)
    assert be.prefetch == 0 and be.describe()["l2_prefetch_bytes"] == 0


def test_plan_takes_weights_in_order_up_to_the_budget():
    a, b, c = torch.zeros(100, dtype=torch.bfloat16), torch.zeros(50, dtype=torch.bfloat16), torch.zeros(30)
    assert [(w is x, n) for (w, n), x in zip(lp.plan((a, b, c), 250), (a, b), strict=True)] == [(True, 100), (True, 25)]
    assert [n for _, n in lp.plan((a, b, c), 10_000)] == [100, 50, 30]
    assert lp.plan((a, b), 1) == [] and lp.plan((a,), 0) == []


@pytest.mark.parametrize("early", [False, True])
def test_forwards_prefetch_each_layer_after_qkv_and_join_once(tiny_target, monkeypatch, early):
    """With a budget, every layer of the target's forwards (up to 32 rows) and of the draft's asks
    for its o_proj, gate+up and down_proj weights, in that order, after its qkv projection (the
    target's before it with ``,early``: after its normed input), and each such forward joins once
    at its end; greedy tokens are plain greedy decoding's."""
    from dflash.backends.static import draft as static_draft
    from dflash.backends.static import fused as static_fused
    from dflash.backends.static.backend import StaticBackend
    from dflash.loop import speculative_generate
    from tests.conftest import make_draft
    from tests.test_loop_scripted import PROMPT, greedy_reference

    draft = make_draft(tiny_target)
    be = StaticBackend(tiny_target, draft, torch.device("cpu"), use_graphs=False, device_loop=True)
    be.draft_linear, be.prefetch, be.prefetch_early = True, 3 << 20, early
    events, order = [], []
    qkvs = {id(fu[0]): "target" for fu in be.fused_target} | {id(fu[0]): "draft" for fu in be.fused_draft}
    real_in_proj = static_fused._in_proj

    def in_proj(lin, fused, x):
        if id(fused) in qkvs:
            order.append(("qkv", qkvs[id(fused)]))
        return real_in_proj(lin, fused, x)

    def spy(sink, after, weights, budget):
        assert sink is be.l2_sink and budget == 3 << 20
        targets = any(weights[0] is lay.self_attn.o_proj.weight for lay in tiny_target.model.layers)
        order.append(("prefetch", "target" if targets else "draft"))
        events.append(tuple(weights))

    monkeypatch.setattr(static_fused, "_in_proj", in_proj)
    monkeypatch.setattr(static_draft, "_in_proj", in_proj)  # the draft's forward imports it by name
    monkeypatch.setattr(static_fused.l2_prefetch, "prefetch", spy)
    hidden = {tiny_target.config.hidden_size, draft.config.hidden_size}

    def join(sink, after):  # after: the last layer's output [1, T, H], so Inductor keeps the join last
        assert sink is be.l2_sink and after.dim() == 3 and after.shape[-1] in hidden
        events.append("join")

    monkeypatch.setattr(static_fused.l2_prefetch, "join", join)
    truth = greedy_reference(tiny_target, PROMPT, 16)
    toks = [t for r in speculative_generate(be, PROMPT, block_size=16, max_new_tokens=16) for t in r.tokens]
    assert toks == truth
    t_layers = [(lay.self_attn.o_proj.weight, fu[1].weight, lay.mlp.down_proj.weight)
                for lay, fu in zip(tiny_target.model.layers, be.fused_target, strict=True)]  # fmt: skip
    d_layers = [(lay.self_attn.o_proj.weight, fu[1].weight, lay.mlp.down_proj.weight)
                for lay, fu in zip(draft.layers, be.fused_draft, strict=True)]  # fmt: skip
    forwards, cur = [], []
    for e in events:
        if e == "join":
            forwards.append(cur)
            cur = []
        else:
            cur.append(e)
    assert not cur and len(forwards) >= 4
    kinds = set()
    for fw in forwards:
        want = t_layers if len(fw) == len(t_layers) else d_layers
        assert all(all(x is y for x, y in zip(got, exp, strict=True)) for got, exp in zip(fw, want, strict=True))
        kinds.add(len(fw))
    assert kinds == {len(t_layers), len(d_layers)}  # both the target's and the draft's forwards
    # each prefetch sits next to its layer's qkv projection: before it for the target's layers
    # with ,early, after it otherwise (the draft's always after)
    for part in ("target", "draft"):
        seq = [kind for kind, p in order if p == part]
        pair = ["prefetch", "qkv"] if part == "target" and early else ["qkv", "prefetch"]
        assert seq == pair * (len(seq) // 2) and seq, (part, seq[:6])


def test_capture_failure_with_prefetch_turns_it_off_first(tiny_target, capsys):
    from dflash.backends.static.backend import StaticBackend
    from tests.conftest import make_draft

    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False)
    be.prefetch, be.linear, be.draft_linear = 1 << 20, "triton", True
    seen = []

    def fails_with_prefetch(fn, inputs):
        seen.append(be.prefetch)
        if be.prefetch:
            raise RuntimeError("side stream not joined")
        return "graph", "out", inputs

    be._capture = fails_with_prefetch
    assert be._graph("verify", 1, lambda: ("ids", "pos"))[1] == "out"
    assert seen == [1 << 20, 0] and be.linear == "triton" and be.draft_linear
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dflash: the L2 weight prefetch failed (RuntimeError: side stream not joined); "
                   "continuing with no prefetch (DFLASH_PREFETCH=0 silences this)."]  # fmt: skip


@pytest.mark.skipif(lp.triton is None, reason="Triton is not installed")
def test_kernel_compiles_to_prefetches_for_hopper(tmp_path):
    """The kernel compiles for sm_90 (the H200) without a GPU, and its machine code issues L2
    prefetches (``CCTL.E.PF2``), 8 per thread for 1,024 lines over 128 threads. (The Triton
    interpreter cannot run inline PTX.)"""
    import shutil
    import subprocess
    from pathlib import Path

    import triton

    sig = {"A": "*bf16", "B": "*bf16", "C": "*bf16", "NA": "i32", "NB": "i32", "NC": "i32",
           "STEP": "constexpr", "BLOCK": "constexpr"}  # fmt: skip
    kernel = compile_for_hopper(lp._prefetch_kernel, sig, {"STEP": 64, "BLOCK": lp.BLOCK})
    ptx = kernel.asm["ptx"]
    assert ptx.count("prefetch.global.L2 [") == lp.BLOCK // 128
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists() and shutil.which("cuobjdump") is None:
        return
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([str(tool if tool.exists() else "cuobjdump"), "-sass", str(cubin)],
                          capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    assert sass.count("CCTL.E.PF2") == lp.BLOCK // 128


def test_bulk_switch(monkeypatch):
    """Hopper and newer take bulk prefetches unless ``,lines`` asks for one per line; the flags
    combine in any order and a repeated or unknown one is a one-line error."""
    monkeypatch.setattr(lp.torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    cuda = torch.device("cuda")
    monkeypatch.setenv("DFLASH_PREFETCH", "24")
    assert lp.uses_bulk(cuda) and not lp.uses_bulk(torch.device("cpu"))
    monkeypatch.setenv("DFLASH_PREFETCH", "24,lines,early")
    assert not lp.uses_bulk(cuda)
    monkeypatch.setattr(lp, "triton", object())
    assert lp.prefetch_setting(cuda) == (24 << 20, True)
    monkeypatch.setattr(lp.torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setenv("DFLASH_PREFETCH", "24")
    assert not lp.uses_bulk(cuda)
    for bad in ("24,early,early", "24,bulk"):
        monkeypatch.setenv("DFLASH_PREFETCH", bad)
        with pytest.raises(InputError, match="',early' and/or ',lines'"):
            lp.prefetch_setting(cuda)


@pytest.mark.skipif(lp.triton is None, reason="Triton is not installed")
def test_bulk_kernel_compiles_for_hopper():
    """The bulk kernel compiles for sm_90 (PTX through ptxas) without a GPU: BULK_BLOCK predicated
    bulk L2 prefetches over one warp, two per thread (Triton 3.9 merges the three weights'
    branches into one)."""

    sig = {"A": "*bf16", "B": "*bf16", "C": "*bf16", "NA": "i32", "NB": "i32", "NC": "i32",
           "CHUNK_E": "constexpr", "ELEM": "constexpr", "BLOCK": "constexpr"}  # fmt: skip
    kernel = compile_for_hopper(lp._bulk_kernel, sig, {"CHUNK_E": lp.CHUNK // 2, "ELEM": 2, "BLOCK": lp.BULK_BLOCK}, num_warps=1)
    ptx = kernel.asm["ptx"]
    assert ptx.count("cp.async.bulk.prefetch.L2.global [") in (lp.BULK_BLOCK // 32, 3 * lp.BULK_BLOCK // 32)
    assert kernel.asm["cubin"]
