"""RoPE tables of the draft stay float32 when the draft runs in bf16 (review finding).

A toy draft with sharp attention (large q/k norm scales) reads a 4,096-row context: with a
bf16 frequency table the rotation angles at those positions are off by whole radians and the
output no longer tracks the float32 draft.
"""

from __future__ import annotations

import torch

from dflash.models.config import DraftConfig
from dflash.models.draft_torch import DFlashDraft

CTX = 4096


def _toy_config() -> DraftConfig:
    return DraftConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64,
                       mask_token_id=63, target_layer_ids=[0], block_size=8,
                       rope={"rope_theta": 10000.0})  # fmt: skip


def _sharp_draft(seed: int = 0) -> DFlashDraft:
    torch.manual_seed(seed)
    draft = DFlashDraft(_toy_config()).eval()
    with torch.no_grad():
        for layer in draft.layers:
            layer.self_attn.q_norm.weight.fill_(4.0)  # logits ~ 16 * cos(angle): sharp
            layer.self_attn.k_norm.weight.fill_(4.0)
    return draft


def _run(draft: DFlashDraft, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    ctx = torch.randn(1, CTX, 64, generator=g).to(dtype)
    block = torch.randn(1, 8, 64, generator=g).to(dtype)
    q_pos = torch.arange(CTX, CTX + 8)[None]
    ctx_pos = torch.arange(CTX)[None]
    with torch.inference_mode():
        return draft(block, ctx, q_pos, ctx_pos).float()


def test_inv_freq_stays_float32_through_to_and_load(tmp_path):
    draft = _sharp_draft()
    assert draft.to(torch.bfloat16).inv_freq.dtype == torch.float32
    assert draft.half().inv_freq.dtype == torch.float32
    draft.float().save(tmp_path)
    loaded = DFlashDraft.load(tmp_path, dtype=torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert loaded.inv_freq.dtype == torch.float32
    torch.testing.assert_close(loaded.inv_freq, _sharp_draft().inv_freq, rtol=0, atol=0)


def test_bf16_draft_tracks_float32_on_a_long_context(tmp_path):
    ref = _sharp_draft()
    ref.save(tmp_path)
    h32 = _run(ref, torch.float32)
    h16 = _run(DFlashDraft.load(tmp_path, dtype=torch.bfloat16), torch.bfloat16)
    err = (h16 - h32).norm() / h32.norm()
    assert err < 0.05, f"bf16 draft output is off by {err:.3f} of the float32 output"
    # the same check catches a bf16 RoPE table (what the loader used to produce)
    broken = DFlashDraft.load(tmp_path, dtype=torch.bfloat16)
    broken._inv_freq_f32 = broken.inv_freq.to(torch.bfloat16).float()
    broken.inv_freq = broken._inv_freq_f32
    bad = (_run(broken, torch.bfloat16) - h32).norm() / h32.norm()
    assert bad > 2 * err
