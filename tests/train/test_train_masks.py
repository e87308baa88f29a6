"""Training block layout: anchors, labels, loss weights, and masks against a brute force."""

from __future__ import annotations

import math

import pytest
import torch

from dflash.train.masks import (
    build_blocks,
    default_gamma,
    dense_mask,
    flex_block_mask,
    sample_anchors,
    slot_weights,
)


def brute_mask(anchors, seq_len, lsz, window=None, causal=False):
    """The rule written out one query/key pair at a time (brief §8.2)."""
    b, n = len(anchors), len(anchors[0])
    out = torch.zeros(b, 1, n * lsz, seq_len + n * lsz, dtype=torch.bool)
    for bi in range(b):
        for j, a in enumerate(anchors[bi]):
            for k in range(lsz):
                q = j * lsz + k
                qpos = a + k
                for c in range(seq_len):  # context key at position c
                    ok = c < a
                    if window is not None:
                        ok = ok and qpos - c < window
                    out[bi, 0, q, c] = ok
                for j2 in range(n):
                    for k2 in range(lsz):
                        ok = j2 == j
                        if causal:
                            ok = ok and k2 <= k
                        if window is not None:
                            ok = ok and abs(k - k2) < window
                        out[bi, 0, q, seq_len + j2 * lsz + k2] = ok
    return out


CASES = [
    # anchors near the start and the end, overlapping windows (anchors closer than L)
    ([[0, 1, 5]], 9, 4),
    ([[6, 7, 8], [0, 2, 3]], 10, 4),
    ([[1, 2]], 6, 8),  # blocks run past the sequence end
]


@pytest.mark.parametrize("anchors,seq_len,lsz", CASES)
@pytest.mark.parametrize("window,causal", [(None, False), (None, True), (3, True), (2, False)])
def test_dense_mask_equals_brute_force(anchors, seq_len, lsz, window, causal):
    got = dense_mask(torch.tensor(anchors), seq_len, lsz, window, causal)
    want = brute_mask(anchors, seq_len, lsz, window, causal)
    assert got.shape == want.shape
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"first mismatch at {bad[0].tolist()}"


@pytest.mark.parametrize("window,causal", [(None, False), (3, True)])
def test_flex_block_mask_equals_dense(window, causal):
    from torch.nn.attention.flex_attention import create_mask

    anchors = torch.tensor([[0, 3, 4, 20], [5, 6, 30, 31]])
    seq_len, lsz = 40, 8
    bm = flex_block_mask(anchors, seq_len, lsz, window, causal)
    dense = dense_mask(anchors, seq_len, lsz, window, causal)
    as_dense = create_mask(bm.mask_mod, 2, 1, anchors.shape[1] * lsz, seq_len + anchors.shape[1] * lsz,
                           device="cpu")  # fmt: skip
    assert torch.equal(as_dense, dense)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_matches_sdpa_on_cpu():
    """The draft's attention gives the same output with a BlockMask as with the dense mask."""
    from dflash.models.config import DraftConfig
    from dflash.models.draft_torch import DFlashDraft
    from dflash.train.masks import layer_masks

    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=64, mask_token_id=63,
                      target_layer_ids=[0, 1], block_size=4,
                      layer_types=["full_attention", "sliding_attention"], sliding_window=6)  # fmt: skip
    torch.manual_seed(0)
    draft = DFlashDraft(cfg).eval()
    anchors = torch.tensor([[1, 2, 7]])
    s, lq = 10, 12
    emb, feats = torch.randn(1, lq, 32), torch.randn(1, s, 64)
    q_pos = (anchors[:, :, None] + torch.arange(4)).view(1, lq)
    ctx_pos = torch.arange(s)[None]
    with torch.no_grad():
        a = draft(emb, feats, q_pos, ctx_pos, masks=layer_masks(cfg, anchors, s, flex=False))
        b = draft(emb, feats, q_pos, ctx_pos, masks=layer_masks(cfg, anchors, s, flex=True))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_slot_weights_follow_the_formula():
    for lsz, gamma in ((16, 7.0), (10, 5.0), (8, 4.0)):
        assert default_gamma(lsz) == gamma
        w = slot_weights(lsz)
        assert w[0] == 0
        for k in range(1, lsz):
            assert math.isclose(float(w[k]), math.exp(-(k - 1) / gamma), rel_tol=1e-6)
    assert math.isclose(float(slot_weights(6, gamma=2.0)[3]), math.exp(-1.0), rel_tol=1e-6)


def test_sample_anchors_are_valid_distinct_and_seeded():
    loss_mask = torch.zeros(3, 20, dtype=torch.bool)
    loss_mask[0, 5:20] = True  # 14 candidates (5..18)
    loss_mask[1, 10:13] = True  # 2 candidates (10, 11)
    loss_mask[2, 0:20] = True
    a1, k1 = sample_anchors(loss_mask, 8, torch.Generator().manual_seed(1))
    a2, k2 = sample_anchors(loss_mask, 8, torch.Generator().manual_seed(1))
    assert torch.equal(a1, a2) and torch.equal(k1, k2)
    assert a1.shape == (3, 8)
    assert k1.sum(1).tolist() == [8, 2, 8]
    for r in range(3):
        kept = a1[r][k1[r]].tolist()
        assert kept == sorted(set(kept)), "distinct and ascending"
        for a in kept:
            assert loss_mask[r, a] and loss_mask[r, a + 1]
    assert a1[1][k1[1]].tolist() == [10, 11]
    a3, _ = sample_anchors(loss_mask, 8, torch.Generator().manual_seed(2))
    assert not torch.equal(a1, a3)


def test_build_blocks_tokens_positions_labels():
    ids = torch.arange(100, 112)[None]  # tokens 100..111 at positions 0..11
    loss_mask = torch.zeros(1, 12, dtype=torch.bool)
    loss_mask[0, 4:] = True
    anchors, keep = torch.tensor([[4, 9, 0]]), torch.tensor([[True, True, False]])
    out = build_blocks(ids, loss_mask, anchors, keep, block_size=4, mask_token_id=7)
    assert out["block_ids"].tolist() == [[104, 7, 7, 7, 109, 7, 7, 7, 7, 7, 7, 7]]
    assert out["q_pos"].tolist() == [[4, 5, 6, 7, 9, 10, 11, 12, 0, 1, 2, 3]]
    # slot 0 never a label; past the end (position 12) and padding blocks excluded
    assert out["labels"].tolist() == [[-100, 105, 106, 107, -100, 110, 111, -100] + [-100] * 4]
    w = slot_weights(4)
    assert torch.allclose(out["weights"][0, :4], w)
    assert out["weights"][0, 7] == 0 and out["weights"][0, 8:].sum() == 0


def effective_mask(bm, mask_mod_dense, tile):
    """What FlexAttention attends with a BlockMask: full tiles, and the rule on partial tiles."""
    b, _, lq, tk = mask_mod_dense.shape
    nq, nk = bm.kv_num_blocks.shape[-1], -(-tk // tile)
    maps = []
    for num, idx in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices)):
        m = torch.zeros(b, nq, nk, dtype=torch.bool)
        for bi in range(b):
            for qi in range(nq):
                m[bi, qi, idx[bi, 0, qi, : num[bi, 0, qi]].long()] = True
        maps.append(m.repeat_interleave(tile, 1).repeat_interleave(tile, 2)[:, None, :lq, :tk])
    partial, full = maps
    assert not (partial & full).any()
    return full | (partial & mask_mod_dense)


@pytest.mark.parametrize("window,causal", [(None, False), (None, True), (5, True), (3, False)])
@pytest.mark.parametrize("seq_len,lsz,tile", [(40, 4, 8), (37, 8, 16), (64, 4, 16), (21, 3, 8)])
def test_anchor_block_mask_equals_dense_on_random_anchors(window, causal, seq_len, lsz, tile):
    """The BlockMask built from the anchors attends exactly where the dense mask does."""
    gen = torch.Generator().manual_seed(seq_len * 31 + lsz)
    loss_mask = torch.zeros(3, seq_len, dtype=torch.bool)
    for r, start in enumerate((3, seq_len // 2, seq_len - 4)):  # the last row has few anchors
        loss_mask[r, start:] = True
    for cap in (5, 12):
        anchors, _ = sample_anchors(loss_mask, cap, gen)
        bm = flex_block_mask(anchors, seq_len, lsz, window, causal, tile=tile)
        dense = dense_mask(anchors, seq_len, lsz, window, causal)
        assert bm.shape == (3, 1, dense.shape[2], dense.shape[3])
        assert torch.equal(effective_mask(bm, dense, tile), dense)
        # and the tiles skip work: some tile is full or empty when the context spans tiles
        if window is None and seq_len >= 2 * tile:
            assert int(bm.full_kv_num_blocks.sum()) > 0


@pytest.mark.parametrize("causal", [False, True])
def test_anchor_block_mask_tiles_match_create_block_mask(causal):
    """Without a window the anchor tiles are as tight as create_block_mask's (L < tile), built
    here from the dense mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    loss_mask = torch.zeros(2, 70, dtype=torch.bool)
    loss_mask[0, 9:], loss_mask[1, 40:66] = True, True
    anchors, _ = sample_anchors(loss_mask, 16, torch.Generator().manual_seed(3))
    fast = flex_block_mask(anchors, 70, 4, None, causal, tile=16)
    lq = anchors.shape[1] * 4

    dense = dense_mask(anchors, 70, 4, None, causal)  # [B, 1, Lq, S + Lq]

    def mask_mod(bi, hi, qi, kvi):
        return dense[bi, 0, qi, kvi]

    ref = create_block_mask(mask_mod, anchors.shape[0], None, lq, 70 + lq, device=anchors.device, BLOCK_SIZE=16)
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    assert torch.equal(fast.to_dense(), ref.to_dense())


def test_cuda_flex_compile_settings(monkeypatch):
    """CUDA training compiles flex_attention once with symbolic sizes and duck sizing off during
    the call. No GPU needed: the compile is replaced by a recorder."""
    import torch.fx.experimental._config as fx_config

    import dflash.models.draft_torch as dt

    seen = []

    def fake_compile(fn, **kw):
        seen.append(kw)
        return lambda *a, **k: fx_config.use_duck_shape  # what the kernel call would see

    monkeypatch.setattr(dt, "_FLEX_COMPILED", None)
    monkeypatch.setattr(torch, "compile", fake_compile)
    fn = dt.flex_attention_fn(torch.device("cuda"))
    assert dt.flex_attention_fn(torch.device("cuda")) is fn and len(seen) == 1  # compiled once
    assert seen[0] == {"dynamic": True}
    assert fn() is False  # duck sizing off inside the call
    assert fx_config.use_duck_shape is True
    assert dt.flex_attention_fn(torch.device("cpu")) is dt.flex_attention  # CPU: eager
