"""The LM head + greedy argmax kernel (dflash.kernels.head_argmax): the device loop decodes plain
greedy tokens with it (its torch reference off CUDA), and the Triton kernel (Triton's CPU
interpreter, float32) gives argmax(x @ W^T) exactly, ties to the first column included."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from dflash.errors import InputError
from dflash.kernels import head_argmax as ha
from tests.triton_helpers import compile_for_hopper, run_interpreted


def test_switch_and_fits(monkeypatch, tiny_target):
    from dflash.backends.static.backend import StaticBackend
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
    from dflash.backends.static.backend import StaticBackend
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
    from dflash.kernels import head_argmax as ha

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
    out = run_interpreted(KERNEL_CHECK)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.skipif(ha.triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("pdl", [False, True])
def test_kernel_compiles_for_hopper(pdl):
    """The kernel compiles for sm_90 (the H200) without a GPU, with tensor-core dots, and with PDL
    its grid-dependency wait and launch instructions (the interpreter skips both)."""

    sig = {"X": "*bf16", "W": "*bf16", "PV": "*fp32", "PI": "*i32", **dict.fromkeys(("M", "N", "K", "s_xm", "s_wn", "s_pm"), "i32"),
           **dict.fromkeys(("IEEE", "BM", "BN", "BK", "PDL"), "constexpr")}  # fmt: skip
    kernel = compile_for_hopper(ha._head_argmax_kernel, sig, {"IEEE": False, "BM": 16, "BN": 32, "BK": 128, "PDL": pdl}, num_warps=4, num_stages=4)
    ptx = kernel.asm["ptx"]
    assert "mma" in ptx and ptx.count("griddepcontrol") == (2 if pdl else 0)


def test_fall_back_order_and_the_failed_graphs_kind(tiny_target, capsys):
    """After a failed capture: the L2 prefetch goes first, then (device-loop graphs only) the
    whole-step compile, then the fused head; a host-loop graph's failure skips those two."""
    from dflash.backends.static.backend import StaticBackend
    from tests.conftest import make_draft

    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False, device_loop=True)
    be.compile, be.step_compile, be.head_argmax, be.prefetch = True, True, True, 1 << 20
    err = RuntimeError("capture failed")
    assert be._fall_back(err, "target", "verify") and be.prefetch == 0
    assert be._fall_back(err, "target", "verify") and not be.compile  # skipped the two device-loop pieces
    assert be.step_compile and be.head_argmax
    be.compile = True
    assert be._fall_back(err, "draft", "ddraft") and not be.step_compile and be.head_argmax
    assert be._fall_back(err, "target", "dverify") and not be.head_argmax
    lines = [ln.split(" failed")[0] for ln in capsys.readouterr().err.strip().splitlines()]
    assert lines == ["dflash: the L2 weight prefetch", "dflash: torch.compile", "dflash: the whole-step compile",
                     "dflash: the LM head + argmax kernel"]  # fmt: skip


@pytest.mark.parametrize("head", [False, True])
def test_step_compile_wraps_glue_and_forward_once_per_graph(tiny_target, monkeypatch, head):
    """DFLASH_STEP_COMPILE: ``_fn`` compiles the device loop's step (glue as is, ``whole``) around
    the forward, with the fused head when it is on, the forwards' compile mode, once per graph;
    the compiled step (run here as is) commits greedy tokens."""
    from functools import partial

    from dflash.backends.static.backend import StaticBackend
    from tests.conftest import make_draft

    monkeypatch.setenv("DFLASH_COMPILE_MODE", "max-autotune-no-cudagraphs")
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append((fn, kw)) or fn)
    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False, device_loop=True)
    be.compile, be.step_compile, be.head_argmax = True, True, head
    lp = be.device_loop
    verify, draft = be._fn("dverify", 16), be._fn("ddraft", 16)
    assert be._fn("dverify", 16) is verify and len(seen) == 2  # cached per (kind, width)
    draft_kw = {"argmax": True} if head else {"logits": False}  # proposals only (device loop)
    for (fn, kw), method, forward, want in ((seen[0], lp.verify_step, be._target_forward,
                                             {"argmax": True} if head else {}),
                                            (seen[1], lp.draft_step, be._draft_forward, draft_kw)):  # fmt: skip
        assert isinstance(fn, partial) and fn.func == method and fn.keywords == {"whole": True}
        inner = fn.args[-1]
        assert inner.func == forward and inner.keywords == want
        assert kw == {"dynamic": False, "mode": "max-autotune-no-cudagraphs"}
    from tests.test_loop_scripted import PROMPT, greedy_reference

    truth = greedy_reference(tiny_target, PROMPT, 6)
    be.reset(64)
    with torch.inference_mode():
        logits, _ = be.prefill(PROMPT, True)
        lp.begin(logits.argmax().reshape(1), len(PROMPT), 16, 6)
        draft()
        verify()
    got = lp.last.tolist()
    assert [logits.argmax().item()] + got[1 : 1 + got[0]] == truth[: 1 + got[0]] and got[0] >= 1
