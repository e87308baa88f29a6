"""A random DFlash2 draft for the tiny targets (models, static-path, MLX and training tests)."""

from __future__ import annotations

import torch

from dflash.models.draft2_torch import DFlash2Draft


def draft2_for_config(config, layers: int = 2, block_size: int = 16, seed: int = 0, mask_token_id: int = 255,
                      **settings) -> DFlash2Draft:  # fmt: skip
    """A random DFlash2 draft (eval mode) for a target of transformers config ``config`` (or any
    object with its attributes), with non-trivial convolutions (base taps ~ N(0, 0.7)) and
    selector; ``settings`` override DFlash2 settings (selector rank 8 and top-k 4 unless given)."""
    from dflash.models.init_draft import draft_config_for

    cfg = draft_config_for(config, layers=layers, block_size=block_size, mask_token_id=mask_token_id,
                           vocab_rows=config.vocab_size, arch="dflash2")  # fmt: skip
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


def make_draft2(target, **kwargs) -> DFlash2Draft:
    """A random DFlash2 draft for the transformers model ``target`` (keyword arguments as
    :func:`draft2_for_config`)."""
    return draft2_for_config(target.config, **kwargs)
