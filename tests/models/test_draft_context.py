"""Prefill-time draft context: :meth:`DFlashDraft.write_context` writes the same K/V as a
forward that reads the rows itself, so the static path's first draft call reads its window only."""

from __future__ import annotations

import pytest
import torch

from dflash.models.config import DraftConfig
from dflash.models.draft_torch import DFlashDraft


def _draft() -> DFlashDraft:
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64,
                      mask_token_id=63, target_layer_ids=[0, 1], block_size=8,
                      rope={"rope_theta": 10000.0})  # fmt: skip
    return DFlashDraft(cfg).eval()


@pytest.mark.parametrize("split", [0, 13, 29])
def test_write_context_then_forward_equals_one_forward(split):
    draft, g = _draft(), torch.Generator().manual_seed(1)
    ctx = torch.randn(1, 29, 128, generator=g)  # [1, Tc, F] two target layers of 64
    block = torch.randn(1, 8, 64, generator=g)
    pos, q_pos = torch.arange(29)[None], torch.arange(29, 37)[None]
    with torch.inference_mode():
        whole = draft(block, ctx, q_pos, pos, cache=draft.new_cache())
        cache = draft.new_cache()
        draft.write_context(ctx[:, :split], pos[:, :split], cache)
        assert cache.length == split
        parts = draft(block, ctx[:, split:], q_pos, pos[:, split:], cache=cache)
        assert cache.length == 29
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)
    # the rows must really be there: without them the output differs
    with torch.inference_mode():
        missing = draft(block, ctx[:, 13:], q_pos, pos[:, 13:], cache=draft.new_cache())
    assert (missing - whole).abs().max() > 1e-3
