"""Which targets the static (CUDA-graph) path runs: the checks :class:`~dflash.backends.static.
backend.StaticBackend` makes at build, which ``--cuda-graphs`` and the plain path's one-line note
read, and the per-layer sliding windows."""

from __future__ import annotations

from typing import Any

from dflash.backends.static.families import family_refusal, family_type
from dflash.backends.static.fused import target_fusable
from dflash.backends.static.hybrid import hybrid_refusal, is_hybrid
from dflash.models.target_torch import SLIDING, layer_kinds

DENSE_TYPES = ("llama", "qwen2", "qwen3")  # the batched engine's (dense full attention)
SUPPORTED_TYPES = (*DENSE_TYPES, "mistral", "qwen3_moe")


def layer_windows(config: Any) -> list[int | None]:
    """Per target layer, its sliding window W in tokens (the key at the query's position
    counts: keys at positions > pos - W are seen) or None for full attention, from
    ``layer_types`` / ``sliding_window`` / ``use_sliding_window`` as transformers reads them."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    return [window if kind == SLIDING else None for kind in layer_kinds(config)]


def static_refusal(target: Any) -> str | None:
    """Why the static path cannot run this target (one phrase), or None when it can: a
    Llama/Qwen2/Qwen3/Mistral/Qwen3-MoE target with full-attention or sliding-window layers,
    a supported RoPE, and plain linears and dense MLPs or top-k expert blocks, which its
    forwards fuse (:func:`~dflash.backends.static.fused.target_fusable`)."""
    cfg = target.config
    family = getattr(cfg, "model_type", None)
    if is_hybrid(cfg):  # GatedDeltaNet hybrids: their own forward (dflash.backends.static.hybrid)
        return hybrid_refusal(target)
    if family_type(target) is not None:  # gpt-oss, Gemma 3/4 text (dflash.backends.static.families)
        return family_refusal(target)
    if family not in SUPPORTED_TYPES:
        return f"{family} targets run on the plain path"
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ("default", "linear", "llama3", "yarn"):
        return f"RoPE type {rope.get('rope_type')!r} runs on the plain path"
    kinds = layer_kinds(cfg)
    if any(k not in ("full_attention", SLIDING) for k in kinds):
        return f"layer kinds {sorted(set(kinds))} run on the plain path"
    if any(
        not (isinstance(w, int) and w > 0)
        for w, k in zip(layer_windows(cfg), kinds, strict=True)
        if k == SLIDING
    ):
        return "sliding layers need a positive sliding_window"
    inner = getattr(target, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "the target's module layout is not Llama-like"
    if len(inner.layers) != len(kinds) or not target_fusable(target):
        return (
            "its layers are not plain linears with dense MLPs or top-k expert blocks (quantized?)"
        )
    return None


def supports_static(target: Any) -> bool:
    """Whether the static path can run this target (:func:`static_refusal` gives no reason)."""
    return static_refusal(target) is None


def supports_dense_static(target: Any) -> bool:
    """Whether the target is a dense full-attention Llama/Qwen2/Qwen3 (what the batched engine
    of :mod:`dflash.backends.static.batched` runs): no sliding layer, no expert block."""
    return (getattr(target.config, "model_type", None) in DENSE_TYPES and supports_static(target)
            and all(w is None for w in layer_windows(target.config)))  # fmt: skip
