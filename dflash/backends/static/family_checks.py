"""Which gpt-oss / Gemma 3 / Gemma 4 targets the static family forwards
(:mod:`dflash.backends.static.families`) run: :func:`family_refusal`."""

from __future__ import annotations

from typing import Any

import torch

from dflash.backends.static.moe import gemma4_block, gpt_oss_block

FAMILY_TYPES = ("gpt_oss", "gemma3_text", "gemma4_text")


def family_type(target: Any) -> str | None:
    """The target's model type when the family forwards run it (:data:`FAMILY_TYPES`), else None."""
    family = getattr(getattr(target, "config", None), "model_type", None)
    return family if family in FAMILY_TYPES else None


def family_refusal(target: Any) -> str | None:
    """Why the static path cannot run this gpt-oss / Gemma 3 / Gemma 4 target (one phrase), or None."""
    cfg, family = target.config, family_type(target)
    inner = getattr(target, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
        return f"the {family} target's module layout is not transformers' causal LM"
    kinds = list(getattr(cfg, "layer_types", None) or [])
    if len(kinds) != len(inner.layers) or any(
        k not in ("full_attention", "sliding_attention") for k in kinds
    ):
        return f"layer kinds {sorted(set(kinds))} run on the plain path"
    if "sliding_attention" in kinds and not (
        isinstance(cfg.sliding_window, int) and cfg.sliding_window > 0
    ):
        return "sliding layers need a positive sliding_window"
    if family == "gemma3_text" and getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention runs on the plain path"
    if family == "gemma4_text":
        if getattr(cfg, "use_bidirectional_attention", None) == "all":
            return "bidirectional attention runs on the plain path"
        if int(getattr(cfg, "num_kv_shared_layers", 0) or 0) >= len(kinds):
            return "a Gemma 4 target whose every layer shares K/V runs on the plain path"
    for layer in inner.layers:
        a = layer.self_attn
        projs = [a.q_proj, a.o_proj] + [
            m for m in (getattr(a, "k_proj", None), getattr(a, "v_proj", None)) if m
        ]
        if any(type(m).forward is not torch.nn.Linear.forward for m in projs):
            return "its attention projections are not plain linears (quantized?)"
        if family == "gpt_oss":
            if not gpt_oss_block(layer.mlp) or not isinstance(
                getattr(a, "sinks", None), torch.Tensor
            ):
                return "its expert blocks or attention sinks are not transformers' gpt-oss layout"
        elif (
            family == "gemma4_text"
            and getattr(layer, "enable_moe_block", False)
            and not gemma4_block(layer)
        ):
            return "its expert blocks are not transformers' Gemma 4 layout"
    return None
