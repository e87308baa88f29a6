"""A random DFlash2 draft for the tiny targets (models, static-path and training tests)."""

from __future__ import annotations

import torch

from dflash.models.draft2_torch import DFlash2Draft


def make_draft2(target, layers=2, block_size=16, seed=0, **settings) -> DFlash2Draft:
    """A random DFlash2 draft for ``target`` with non-trivial convolutions and selector."""
    from dflash.models.init_draft import draft_config_for

    cfg = draft_config_for(target.config, layers=layers, block_size=block_size, mask_token_id=255,
                           vocab_rows=target.config.vocab_size, arch="dflash2")  # fmt: skip
    for k, v in {"selector_rank": 8, "selector_top_k": 4, **settings}.items():
        setattr(cfg.dflash2, k, v)
    cfg.validate()
    torch.manual_seed(seed)
    draft = DFlash2Draft(cfg).eval()
    with torch.no_grad():
        for layer in draft.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.normal_(0.0, 0.7)
    return draft
