"""The split-KV attention over a position-indexed cache (dflash.kernels.split_attention) equals
SDPA with the position mask; the Triton kernel itself runs in Triton's CPU interpreter when
Triton is installed (float32: the interpreter has no bfloat16)."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch
import torch.nn.functional as F

from dflash.errors import InputError
from dflash.kernels import split_attention as sa
from tests.helpers.kernels import compile_for_hopper, run_interpreted
from tests.helpers.static import assert_static_greedy

SHAPES = [  # heads, kv heads, query rows T, head dim, capacity S, first query position
    (9, 3, 16, 64, 256, 100),  # demo target, a 16-wide verify crossing a slice boundary
    (9, 3, 1, 64, 256, 0),  # block-1 decoding at position 0
    (4, 2, 16, 16, 256, 200),  # last slice partly filled
    (8, 8, 5, 32, 128, 3),  # no GQA, rows straddle nothing
    (32, 8, 16, 128, 384, 250),  # Qwen3-8B head layout
]


def masked_sdpa(q, k, v, pos, scale, window=0):
    keys = torch.arange(k.shape[2])[None, :]
    mask = keys <= pos[:, None]
    if window:  # a sliding layer: keys > pos - window, as transformers' sliding masks
        mask = mask & (keys > pos[:, None] - window)
    mask = mask[None, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _inputs(h, hkv, t, d, cap, start, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, t, h, d, generator=g).transpose(1, 2)  # the forward's strided layout
    k, v = (torch.randn(1, hkv, cap, d, generator=g) for _ in range(2))
    return q, k, v, torch.arange(start, start + t)


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_algorithm_equals_masked_sdpa(shape):
    q, k, v, pos = _inputs(*shape)
    want = masked_sdpa(q, k, v, pos, 0.1)
    got = sa.split_attention_reference(q, k, v, pos, 0.1)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)
    # the rows past the filled length do not matter: garbage there changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[:, :, int(pos[-1]) + 1 :] = 1e4
    v2[:, :, int(pos[-1]) + 1 :] = float("nan")
    assert torch.equal(sa.split_attention_reference(q, k2, v2, pos, 0.1), got)


@pytest.mark.parametrize("window", [1, 8, 100, 300])
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_window_equals_masked_sdpa(shape, window):
    """A sliding window W: row t sees keys in (pos[t] - W, pos[t]]; slices (and whole slices
    older than the window) merge to masked SDPA, at any split; W past the filled length is no
    window at all."""
    q, k, v, pos = _inputs(*shape)
    want = masked_sdpa(q, k, v, pos, 0.1, window)
    for split, one in ((256, 0), (64, 0), (64, 640)):
        got = sa.split_attention_reference(q, k, v, pos, 0.1, split, one, window)
        assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (split, one)
    if window > int(pos[-1]):
        assert torch.allclose(want, masked_sdpa(q, k, v, pos, 0.1), atol=2e-6, rtol=1e-5)
    elif window < int(pos[0]):  # the window hides keys: the check can fail
        assert not torch.allclose(want, masked_sdpa(q, k, v, pos, 0.1), atol=1e-3)
    # split_attention on CPU (no Triton) runs the reference with the window
    assert torch.allclose(sa.split_attention(q, k, v, pos, 0.1, window=window), want, atol=2e-6, rtol=1e-5)


def test_one_position_for_every_row():
    """pos [1] gives every query row that position (a draft block that sees all of itself): the
    same result as the expanded [T] positions; any other length is a ValueError at launch."""
    q, k, v, pos = _inputs(9, 3, 16, 64, 256, 100)
    last = pos[-1:]
    assert torch.equal(sa.split_attention_reference(q, k, v, last, 0.1),
                       sa.split_attention_reference(q, k, v, last.expand(16).clone(), 0.1))  # fmt: skip
    assert torch.allclose(sa.split_attention_reference(q, k, v, last, 0.1),
                          masked_sdpa(q, k, v, last.expand(16), 0.1), atol=2e-6, rtol=1e-5)  # fmt: skip
    if sa.triton is not None:
        with pytest.raises(ValueError, match="positions"):
            sa.split_attention_kernel(q, k, v, pos[:3], 0.1, 64)


def test_attention_switches(monkeypatch):
    from dflash.kernels.settings import KernelSettings, one_slice

    def resolve(**env):
        return KernelSettings.resolve(environ={f"DFLASH_{k.upper()}": v for k, v in env.items()})

    assert resolve(attn="sdpa").attention == "sdpa"
    assert sa.attention_mode("sdpa", torch.device("cuda")) == "sdpa"
    with pytest.raises(InputError, match="DFLASH_ATTN must be auto, split or sdpa"):
        resolve(attn="flash")
    assert sa.attention_mode("auto", torch.device("cpu")) == "sdpa"  # CPU: SDPA
    monkeypatch.setattr(sa, "available", lambda: True)  # as on a CUDA machine with Triton
    assert sa.attention_mode("auto", torch.device("cuda"), torch.bfloat16) == "auto"
    assert sa.attention_mode("auto", torch.device("cuda"), torch.float32) == "sdpa"  # exact reference
    assert sa.attention_mode("split", torch.device("cuda"), torch.float32) == "split"  # asked for: the kernel
    default = KernelSettings()
    assert sa.split_size(1024, default.attn_split) == 256
    # 256 keys per program for every head dim; one program up to 640 filled keys for head dims
    # <= 64 and 448 above, unless a split or the threshold is given
    assert (one_slice(default, 64), one_slice(default, 128), one_slice(default, None)) == (640, 448, 448)
    assert one_slice(resolve(attn_one_slice="0"), 64) == 0
    assert one_slice(resolve(attn_one_slice="256"), 64) == 0  # not above the 256 keys per program: off
    assert one_slice(resolve(attn_one_slice="1000"), 128) == 1000
    with pytest.raises(InputError, match="DFLASH_ATTN_ONE_SLICE must be a whole number"):
        resolve(attn_one_slice="lots")
    big = resolve(attn_split="4096")
    assert sa.split_size(1024, big.attn_split) == 1024 and one_slice(big, 64) == 0  # one slice; a split given is run
    assert sa.split_size(1024, resolve(attn_split="99968").attn_split) == 1024  # one slice, whatever multiple
    with pytest.raises(InputError, match="multiple of 64"):
        resolve(attn_split="100")
    assert sa.split_size(1024, resolve(attn_split="128").attn_split) == 128
    assert one_slice(resolve(attn_split="128", attn_one_slice="512"), 64) == 512  # both given


def test_early_setting():
    """DFLASH_ATTN_EARLY: on by default, 0 turns it off; a bad value names the variable."""
    from dflash.kernels.settings import KernelSettings

    assert KernelSettings().attn_early
    assert not KernelSettings.resolve(environ={"DFLASH_ATTN_EARLY": "0"}).attn_early
    with pytest.raises(InputError, match="DFLASH_ATTN_EARLY must be 1 or 0"):
        KernelSettings.resolve(environ={"DFLASH_ATTN_EARLY": "2"})


def test_launch_settings():
    """Keys per iteration (DFLASH_ATTN_BLOCK, checked) and query heads per program: one 16-row
    tile per program, the whole group for a 1-row step."""
    from dflash.kernels.settings import KernelSettings

    assert KernelSettings().attn_block == 128
    assert KernelSettings.resolve(environ={"DFLASH_ATTN_BLOCK": "64"}).attn_block == 64
    with pytest.raises(InputError, match="DFLASH_ATTN_BLOCK must be 32, 64 or 128"):
        KernelSettings.resolve(environ={"DFLASH_ATTN_BLOCK": "100"})
    q, k, v, pos = _inputs(9, 3, 16, 64, 256, 100)
    with pytest.raises(ValueError, match="do not tile a capacity of 256"):  # before any launch
        sa.split_attention_kernel(q, k, v, pos, 0.1, 96)
    with pytest.raises(ValueError, match="do not tile"):
        sa.split_attention_kernel(q, k, v, pos, 0.1, 0)
    cases = {(3, 1): 3, (3, 16): 1, (4, 1): 4, (4, 4): 4, (4, 8): 2, (3, 8): 1, (6, 2): 6, (6, 4): 3,
             (1, 16): 1, (8, 32): 1, (16, 1): 16}  # fmt: skip
    assert {c: sa.heads_per_program(*c) for c in cases} == cases


def test_split_setting_reaches_the_draft_and_the_target(monkeypatch):
    """The attn_split setting: the draft's and the target's split-KV calls take it (one slice
    off, as a split given is run), and decoding stays plain greedy (reference maths on CPU)."""
    seen = {}
    real = sa.split_attention_reference

    def spy(q, k, v, pos, scale, split=256, one_slice=0, window=0):
        seen.setdefault(q.shape[2] > 1 and pos.shape[0] == 1, set()).add((split, one_slice))  # draft: block, one position
        return real(q, k, v, pos, scale, split, one_slice, window)

    monkeypatch.setattr(sa, "split_attention_reference", spy)
    assert_static_greedy(attention="split", settings={"DFLASH_ATTN_SPLIT": "128"})
    assert seen[True] == {(128, 0)} and seen[False] == {(128, 0)}


@pytest.mark.parametrize("split", [64, 128, 256])
def test_reference_any_split_size(split):
    q, k, v, pos = _inputs(9, 3, 16, 64, 256, 100)
    got = sa.split_attention_reference(q, k, v, pos, 0.1, split=split)
    assert torch.allclose(got, masked_sdpa(q, k, v, pos, 0.1), atol=2e-6, rtol=1e-5)


def test_reference_one_slice_up_to_its_length():
    """one_slice: up to that many filled keys one program's sum (bitwise the one-slice result),
    past it the split's slices (bitwise the plain split result); both equal masked SDPA."""
    q, k, v, pos = _inputs(9, 3, 16, 64, 512, 100)  # 116 filled keys
    one = sa.split_attention_reference(q, k, v, pos, 0.1, split=512)
    sliced = sa.split_attention_reference(q, k, v, pos, 0.1, split=64)
    assert not torch.equal(one, sliced)  # another summation order
    assert torch.equal(sa.split_attention_reference(q, k, v, pos, 0.1, split=64, one_slice=128), one)
    assert torch.equal(sa.split_attention_reference(q, k, v, pos, 0.1, split=64, one_slice=115), sliced)
    assert torch.equal(sa.split_attention_reference(q, k, v, pos, 0.1, split=64, one_slice=64), sliced)
    assert torch.allclose(one, masked_sdpa(q, k, v, pos, 0.1), atol=2e-6, rtol=1e-5)


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from dflash.kernels import split_attention as sa
    from dflash.kernels.settings import KernelSettings, Launch
    from tests.kernels.test_split_attention import SHAPES, _inputs, masked_sdpa

    def split_launch(split):  # a split given: one slice off, as the override does
        return Launch(KernelSettings(attn_split=split, attn_one_slice=0))

    for split in (128, 64, 4096):  # several slices, one slice (no merge)
        for shape in SHAPES:
            q, k, v, pos = _inputs(*shape)
            got = sa.split_attention(q, k, v, pos, 0.1, launch=split_launch(split))
            err = (got - masked_sdpa(q, k, v, pos, 0.1)).abs().max().item()
            assert err < 1e-5, (split, shape, err)
            # laid out [1, T, H, D]: the forward's reshape to [1, T, H*D] is a view
            assert got.transpose(1, 2).is_contiguous(), got.stride()
            # the last slice to finish reset the merge counters for the next launch
            assert int(sa._COUNTERS[("cpu", None)].abs().sum()) == 0
    # a position past the cache (the backends never pass one) must not break later calls, and
    # rows past the filled length are never read (inf/NaN there change nothing)
    q, k, v, _ = _inputs(4, 2, 1, 16, 256, 0)
    sa.split_attention(q, k, v, torch.tensor([256]), 0.1, launch=split_launch(64))
    assert int(sa._COUNTERS[("cpu", None)].abs().sum()) == 0
    q, k, v, pos = _inputs(4, 2, 16, 16, 256, 100)
    want = masked_sdpa(q, k, v, pos, 0.1)
    k[:, :, 116:], v[:, :, 116:] = float("inf"), float("nan")
    err = (sa.split_attention(q, k, v, pos, 0.1, launch=split_launch(64)) - want).abs().max().item()
    assert err < 1e-5, err
    # one position for every row, as a [1] view into a longer tensor (the draft's block rows)
    q, k, v, _ = _inputs(9, 3, 16, 64, 256, 100)
    full = torch.arange(80, 140)
    want = masked_sdpa(q, k, v, full[35:36].expand(16), 0.1)
    err = (sa.split_attention(q, k, v, full[35:36], 0.1, launch=split_launch(64)) - want).abs().max().item()
    assert err < 1e-5, err
    # every launch setting: query heads per program, keys per iteration (tiling each slice)
    for shape in ((9, 3, 16, 64, 512, 300), (8, 2, 1, 32, 256, 200), (8, 2, 4, 32, 256, 130)):
        q, k, v, pos = _inputs(*shape)
        want = masked_sdpa(q, k, v, pos, 0.1)
        for split, heads, block in ((512, 1, 128), (128, 2, 128), (64, 0, 128), (256, 1, 32)):
            got = sa.split_attention_kernel(q, k, v, pos, 0.1, min(split, k.shape[2]), heads, block)
            err = (got - want).abs().max().item()
            assert err < 1e-5, (shape, split, heads, block, err)
            assert int(sa._COUNTERS[("cpu", None)].abs().sum()) == 0
    # one program up to one_slice filled keys (bitwise the one-slice launch), slices past it
    # (bitwise the plain split launch): 116 and 300 filled keys in a 512-row cache
    for shape in ((9, 3, 16, 64, 512, 100), (8, 2, 1, 32, 512, 299)):
        q, k, v, pos = _inputs(*shape)
        one = sa.split_attention_kernel(q, k, v, pos, 0.1, 512, 1, 64)  # 64 keys per iteration, as split 64
        sliced = sa.split_attention_kernel(q, k, v, pos, 0.1, 64, 1)
        for limit, want in ((int(pos[-1]) + 1, one), (448, one), (int(pos[-1]), sliced), (0, sliced)):
            got = sa.split_attention_kernel(q, k, v, pos, 0.1, 64, 1, one_slice=limit)
            assert torch.equal(got, want), (shape, limit)
            assert int(sa._COUNTERS[("cpu", None)].abs().sum()) == 0
        assert (one - masked_sdpa(q, k, v, pos, 0.1)).abs().max().item() < 1e-5
    q, k, v, pos = _inputs(8, 2, 4, 32, 384, 300)  # 192 keys per program: 64 per iteration
    err = (sa.split_attention_kernel(q, k, v, pos, 0.1, 192, 1, 128) - masked_sdpa(q, k, v, pos, 0.1)).abs().max()
    assert err.item() < 1e-5, err
    # the positions loaded before the PDL wait (the attn_early setting): bitwise the plain launch
    for shape in ((8, 2, 1, 32, 512, 299), (9, 3, 16, 64, 512, 128)):
        q, k, v, pos = _inputs(*shape)
        for split, heads, block, one in ((64, 0, 64, 0), (64, 1, 64, 448)):
            plain = sa.split_attention_kernel(q, k, v, pos, 0.1, split, heads, block, one_slice=one)
            got = sa.split_attention_kernel(q, k, v, pos, 0.1, split, heads, block, one_slice=one, early=True)
            assert torch.equal(got, plain), (shape, split, heads, block, one)
    # a sliding window: keys in (pos - W, pos]; the blocks older than the first row's window are
    # skipped, whole slices included (an empty partial merges to nothing)
    for shape in SHAPES + [(8, 2, 16, 32, 512, 400), (8, 2, 1, 32, 512, 450)]:
        q, k, v, pos = _inputs(*shape)
        for window in (1, 8, 100, 300):
            want = masked_sdpa(q, k, v, pos, 0.1, window)
            for split, heads, block, one in ((64, 0, 64, 0), (64, 1, 128, 0), (128, 1, 128, 448),
                                             (k.shape[2], 0, 128, 0)):  # fmt: skip
                got = sa.split_attention_kernel(q, k, v, pos, 0.1, split, heads, block, one_slice=one, window=window)
                err = (got - want).abs().max().item()
                assert err < 1e-5, (shape, window, split, heads, block, one, err)
                assert int(sa._COUNTERS[("cpu", None)].abs().sum()) == 0
            older = k.clone()  # keys older than every row's window are never read
            lo = max(int(pos[0]) - window + 1, 0)
            older[:, :, : lo - lo % 64] = float("nan")
            got = sa.split_attention_kernel(q, older, v, pos, 0.1, 64, 1, 64, window=window)
            assert (got - want).abs().max().item() < 1e-5, (shape, window)
    # the fused static forward with the kernel: plain greedy tokens
    from tests.helpers.static import assert_static_greedy
    assert_static_greedy(6, attention="split")
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernel_in_interpreter():
    """The kernel (Triton interpreter, float32) equals masked SDPA, and the static backend with
    it decodes exactly plain greedy at block 1 and 16."""
    out = run_interpreted(KERNEL_CHECK)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def _static(target, draft, split: bool, device_loop: bool = False):
    from dflash.backends.static.backend import StaticBackend

    be = StaticBackend(target, draft, torch.device("cpu"), use_graphs=False, device_loop=device_loop)
    be.attention = "split" if split else "sdpa"  # CPU defaults to SDPA; force the split path
    return be


@pytest.mark.parametrize("device_loop", [False, True])
def test_static_split_path_same_tokens_and_acceptance(tiny_target, device_loop):
    """Target verify and draft (block K/V written at the block's positions, all rows see the
    block) through the split attention (the torch reference here without Triton): plain greedy
    tokens, and the same per-step acceptance as SDPA with masks (same proposals)."""
    from dflash.loop import speculative_generate
    from tests.helpers.tiny import PROMPT, greedy_reference, make_draft

    draft = make_draft(tiny_target)
    truth = greedy_reference(tiny_target, PROMPT, 40)
    for block in (1, 16):
        runs = []
        for split in (False, True):
            be = _static(tiny_target, draft, split, device_loop)
            rounds = list(speculative_generate(be, PROMPT, block_size=block, max_new_tokens=40))
            runs.append(([t for r in rounds for t in r.tokens], [r.accepted for r in rounds[1:]]))
        assert runs[1][0] == truth
        assert runs[1] == runs[0]


def test_static_split_draft_logits_match_sdpa(tiny_target):
    """The draft's logits at a second step (context rows overwrite the previous block's rows)
    equal the SDPA path's; a draft with a sliding layer keeps its window there (SDPA) while its
    full layer runs split."""
    from tests.helpers.static import draft_twice
    from tests.helpers.tiny import PROMPT, custom_draft

    prompt = PROMPT * 3
    for kw in ({}, dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5)):
        draft = custom_draft(tiny_target, **kw)
        want = draft_twice(_static(tiny_target, draft, False), prompt)
        got = draft_twice(_static(tiny_target, draft, True), prompt)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_describe_records_split_settings(tiny_target):
    """Benchmark records carry the split-KV settings where the kernel runs (a resumed run under
    other settings is refused), and nothing with SDPA; the whole settings always."""
    from dflash.backends.static.backend import StaticBackend
    from dflash.kernels.settings import KernelSettings
    from tests.helpers.tiny import make_draft

    be = StaticBackend(tiny_target, make_draft(tiny_target), torch.device("cpu"), use_graphs=False)
    assert be.attention == "sdpa" and "attn_split" not in be.describe()
    assert be.describe()["kernel_settings"] == KernelSettings().record()
    be.attention = "split"
    assert be.head_dim <= 64 and be.draft_model.config.head_dim <= 64
    assert be.describe()["attn_split"] == 256
    assert be.describe()["attn_one_slice"] == {"target": 640, "draft": 640}  # the default for such heads
    assert be.describe()["attn_block"] == 128
    be.settings = KernelSettings.resolve(environ={"DFLASH_ATTN_SPLIT": "512"})
    assert be.describe()["attn_split"] == 512 and be.describe()["attn_one_slice"] == {"target": 0, "draft": 0}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("one,early,window", [(0, False, False), (640, False, False), (0, True, False),
                                              (448, True, False), (0, True, True), (448, False, True)])  # fmt: skip
def test_kernel_compiles_for_hopper(one, early, window):
    """The kernel compiles for sm_90 (the H200) without a GPU, with PDL, with and without the
    one-program span for short filled lengths, the loads before the wait and a sliding window
    (the interpreter checks the maths)."""

    ints = ("scale_log2", "cap", "s_pos", "window", "s_qh", "s_qt", "s_kh", "s_ks", "s_vh", "s_vs", "s_oh", "s_ot",
            "s_ph", "s_ps", "s_pr", "s_lh", "s_ls")  # fmt: skip
    consts = {"T": 16, "G": 3, "GP": 1, "D": 64, "ROWS": 16, "SPLIT_N": 256, "BLOCK": 128, "IEEE": False,
              "MERGE": True, "PDL": True, "ONE": one, "EARLY": early, "WINDOW": window}  # fmt: skip
    sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "POS": "*i64", "OUT": "*bf16", "PO": "*fp32", "PL": "*fp32",
           "CNT": "*i32", **{n: "i32" for n in ints}, **dict.fromkeys(consts, "constexpr")}  # fmt: skip
    sig["scale_log2"] = "fp32"
    kernel = compile_for_hopper(sa._split_kernel, sig, consts, num_warps=4, num_stages=2)
    ptx = kernel.asm["ptx"]
    assert "griddepcontrol.wait" in ptx
    # EARLY: global loads (the positions) are issued before the wait, else none
    before = ptx[: ptx.index("griddepcontrol.wait")]
    assert ("ld.global" in before) == early, before[-2000:]


@pytest.mark.parametrize("setting", ["1", "0"])
def test_early_flags_at_every_call_site(tiny_target, monkeypatch, setting):
    """Which kernels may load before their PDL wait (DFLASH_ATTN_EARLY): in the target every
    layer's RoPE kernel and attention but the first layer's; in the draft every RoPE-kernel
    layer's but the first such layer's, also when the draft's first layer is a sliding-window
    one (not through the RoPE kernel); never with the switch off. Checked by recording the calls
    of one block-16 generate (the flags are what the GPU kernels get)."""
    from dflash.backends.static import draft as static_draft
    from dflash.backends.static import fused as static_fused
    from dflash.backends.static.backend import StaticBackend
    from dflash.kernels.settings import KernelSettings
    from dflash.loop import speculative_generate
    from tests.helpers.tiny import make_draft

    calls = []

    def spy(where, kind, fn, flag):
        def call(*args, **kwargs):
            calls.append((where, kind, bool(flag(args, kwargs))))
            return fn(*args, **kwargs)
        return call

    def rope_flag(a, k):  # as rope_cache: early and the setting
        return (a[11] if len(a) > 11 else k.get("early", False)) and (a[12] if len(a) > 12 else k["launch"]).settings.attn_early

    def attn_flag(a, k):  # as split_attention
        return (a[5] if len(a) > 5 else k.get("early", False)) and (a[6] if len(a) > 6 else k["launch"]).settings.attn_early

    for mod, where in ((static_fused, "target"), (static_draft, "draft")):
        monkeypatch.setattr(mod, "rope_cache", spy(where, "rope", mod.rope_cache, rope_flag))
        monkeypatch.setattr(mod, "split_attention", spy(where, "attn", mod.split_attention, attn_flag))
    draft = make_draft(tiny_target, layers=3)
    draft.config.layer_types = ["sliding_attention", "full_attention", "full_attention"]
    draft.config.sliding_window = 8
    be = StaticBackend(tiny_target, draft, torch.device("cpu"), use_graphs=False,
                       settings=KernelSettings.resolve(environ={"DFLASH_ATTN_EARLY": setting}))  # fmt: skip
    be.attention, be.draft_linear, be.draft_rope, be.target_rope = "split", True, True, True
    list(speculative_generate(be, [1, 2, 3, 4, 5], block_size=16, max_new_tokens=6))
    on = setting == "1"
    target = [c for c in calls if c[0] == "target"]
    layers = tiny_target.config.num_hidden_layers
    assert target and len(target) % (2 * layers) == 0  # every forward: a RoPE call, then attention
    for start in range(0, len(target), 2 * layers):
        flags = [c[2] for c in target[start:start + 2 * layers]]
        assert flags == [False, False] + [on] * (2 * layers - 2), flags
    drafted = [c for c in calls if c[0] == "draft"]
    assert drafted and len(drafted) % 4 == 0  # layers 1 and 2 through the RoPE kernel, layer 0 not
    for start in range(0, len(drafted), 4):
        assert [c[2] for c in drafted[start:start + 4]] == [False, False, on, on]
