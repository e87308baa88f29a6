"""The MLX draft reads the torch draft's checkpoint and gives the same logits (float32, 1e-4)."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
torch = pytest.importorskip("torch")

from dflash.models.config import DraftConfig  # noqa: E402
from dflash.models.draft_mlx import load_draft_mlx  # noqa: E402
from dflash.models.draft_torch import DFlashDraft  # noqa: E402

H, V, F_LAYERS = 64, 300, [1, 3]


def make_cfg(layer_types, is_causal=None, window=None, rope=None):
    return DraftConfig(hidden_size=H, intermediate_size=128, num_hidden_layers=len(layer_types),
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=V,
                       mask_token_id=V - 1, target_layer_ids=F_LAYERS, block_size=8,
                       layer_types=layer_types, sliding_window=window, is_causal=is_causal,
                       rope=rope or {"rope_theta": 10000.0})  # fmt: skip


def saved_draft(tmp_path, cfg, seed=0):
    torch.manual_seed(seed)
    model = DFlashDraft(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # non-trivial norm scales are part of the check
    model.save(tmp_path, max_shard_bytes=40_000)  # several shards + index
    return model


def torch_round(model, cache, emb, ctx, start):
    q_pos = torch.arange(start, start + emb.shape[1])[None]
    c_pos = torch.arange(start - ctx.shape[1], start)[None]
    with torch.no_grad():
        return model(torch.tensor(emb), torch.tensor(ctx), q_pos, c_pos, cache=cache).numpy()


@pytest.mark.parametrize(
    "layer_types,is_causal,window",
    [(["full_attention", "full_attention"], None, None),
     (["sliding_attention", "full_attention", "sliding_attention"], None, 5),
     (["full_attention", "sliding_attention"], True, 3)],
)  # fmt: skip
def test_same_logits_as_torch_over_rounds(tmp_path, layer_types, is_causal, window):
    cfg = make_cfg(layer_types, is_causal, window)
    tmodel = saved_draft(tmp_path, cfg)
    mmodel = load_draft_mlx(tmp_path)
    rng = np.random.default_rng(0)
    head = rng.normal(0, 0.3, size=(H, V)).astype(np.float32)  # a shared "target LM head"
    tcache, mcache = tmodel.new_cache(), mmodel.new_cache()
    start = 0
    for tc in (9, 3, 1, 6):  # a prompt, then committed rows of later steps
        start += tc
        emb = rng.normal(0, 1, size=(1, 8, H)).astype(np.float32)
        ctx = rng.normal(0, 1, size=(1, tc, H * len(F_LAYERS))).astype(np.float32)
        want = torch_round(tmodel, tcache, emb, ctx, start)[0, 1:] @ head
        got = np.array(mmodel(mx.array(emb), mx.array(ctx), start, mcache))[0, 1:] @ head
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_draft_bits_and_window_load_and_run(tmp_path):
    cfg = make_cfg(["full_attention", "full_attention"])
    saved_draft(tmp_path, cfg)
    full = load_draft_mlx(tmp_path)
    for bits in (4, 8):
        q = load_draft_mlx(tmp_path, bits=bits)
        assert "scales" in q.layers[0].self_attn.q_proj, "linear layers are quantized"
        emb = mx.ones((1, 8, H)) * 0.1
        ctx = mx.ones((1, 5, H * 2)) * 0.1
        out = q(emb, ctx, 5, q.new_cache())
        ref = full(emb, ctx, 5, full.new_cache())
        assert out.shape == (1, 8, H)
        a, b = np.array(out).ravel(), np.array(ref).ravel()
        cos = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
        assert cos > (0.95 if bits == 4 else 0.999), (bits, cos)
    win = load_draft_mlx(tmp_path, window=4)
    cache = win.new_cache()
    rng = np.random.default_rng(1)
    win(mx.array(rng.normal(size=(1, 8, H)).astype(np.float32)),
        mx.array(rng.normal(size=(1, 10, 2 * H)).astype(np.float32)), 10, cache)  # fmt: skip
    assert all(cache.length(i) == 4 for i in range(2)) and cache.first == [6, 6]


def test_window_equals_draft_on_truncated_context(tmp_path):
    """--draft-window N: the draft sees exactly the last N context rows (positions absolute)."""
    cfg = make_cfg(["full_attention", "full_attention"])
    saved_draft(tmp_path, cfg)
    win, full = load_draft_mlx(tmp_path, window=4), load_draft_mlx(tmp_path)
    rng = np.random.default_rng(2)
    emb = mx.array(rng.normal(size=(1, 8, H)).astype(np.float32))
    ctx = mx.array(rng.normal(size=(1, 10, 2 * H)).astype(np.float32))
    a = win(emb, ctx, 10, win.new_cache())
    # the same projection of only the last 4 rows, placed at positions 6..9
    b = full(emb, ctx[:, 6:], 10, full.new_cache())
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)


def test_bad_bits_and_window_are_refused(tmp_path):
    from dflash.errors import InputError

    saved_draft(tmp_path, make_cfg(["full_attention"]))
    with pytest.raises(InputError):
        load_draft_mlx(tmp_path, bits=3)
    with pytest.raises(InputError):
        load_draft_mlx(tmp_path, window=0)
