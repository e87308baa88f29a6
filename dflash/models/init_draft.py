"""Create an untrained DFlash draft shaped for a target (``dflash init-draft``).

The draft copies the target's width, heads, rope and vocabulary, has ``layers`` decoder
layers, and reads ``layers`` target layers spread from layer 1 to N-3 (brief §1.3, paper §5).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dflash.errors import ConfigError, InputError
from dflash.models.config import (
    DFlash2Settings,
    DraftConfig,
    default_target_layer_ids,
    holds_other_model,
)

ARCHS = ("dflash", "dflash2")


def choose_mask_token_id(tokenizer: Any, vocab_rows: int, avoid: set[int]) -> int:
    """Pick the mask token id the way users expect (cf. SpecForge order, brief §1.1).

    Order: the tokenizer's mask token; the first embedding row no token uses; the highest-id
    added special token that is not BOS/EOS/PAD/a stop id.

    Raises:
        ConfigError: nothing suitable; pass ``--mask-token-id``.
    """
    mask = getattr(tokenizer, "mask_token_id", None)
    if mask is not None and mask < vocab_rows and mask not in avoid:
        return int(mask)
    if len(tokenizer) < vocab_rows:
        return len(tokenizer)
    specials = getattr(tokenizer, "all_special_ids", []) or []
    added = list(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    for tid in sorted(set(specials) | set(added), reverse=True):
        if tid not in avoid and 0 <= tid < vocab_rows:
            return int(tid)
    raise ConfigError("Cannot find an unused token id to use as the mask token.",
                      hint="pass --mask-token-id ID")  # fmt: skip


def draft_config_for(target_cfg: Any, *, layers: int, block_size: int, mask_token_id: int,
                     vocab_rows: int, arch: str = "dflash") -> DraftConfig:  # fmt: skip
    """A DraftConfig matching a transformers target config (text part for multimodal ones).

    Per-layer settings of heterogeneous targets (Gemma 4's global head dim) are read from the
    first layer; rope from :func:`draft_rope`. ``arch="dflash2"`` adds the published DFlash2
    defaults (conv kernel 2, group 16 or the largest power of two dividing the width, selector
    rank 256, top-k 16; brief §1.1).
    """
    t = target_cfg.get_text_config() if hasattr(target_cfg, "get_text_config") else target_cfg
    v2 = None
    if arch == "dflash2":
        v2 = DFlash2Settings(conv_group_size=math.gcd(t.hidden_size, 16),
                             selector_top_k=min(16, vocab_rows))  # fmt: skip
    heads = layer_attr(t, "num_attention_heads")
    depth = t.num_hidden_layers
    return DraftConfig(
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=layer_attr(t, "num_key_value_heads") or heads,
        head_dim=layer_attr(t, "head_dim") or t.hidden_size // heads,
        vocab_size=vocab_rows,
        mask_token_id=mask_token_id,
        target_layer_ids=default_target_layer_ids(depth, layers),
        block_size=block_size,
        rms_norm_eps=float(getattr(t, "rms_norm_eps", 1e-6)),
        num_target_layers=depth,
        max_position_embeddings=int(getattr(t, "max_position_embeddings", 32768)),
        rope=draft_rope(t),
        dflash2=v2,
        extra={"dtype": "bfloat16", "initializer_range": 0.02},
    )


def layer_attr(t: Any, name: str) -> Any:
    """``t.<name>``, or for a heterogeneous config (transformers refuses to read a per-layer
    attribute globally: Gemma 4's ``head_dim``) the first layer's value; None when absent."""
    try:
        return getattr(t, name, None)
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError
        return getattr(t.per_layer_config[0], name, None)


def draft_rope(t: Any) -> dict[str, Any]:
    """The draft's rope settings for a target text config ``t``.

    The target's ``rope_parameters``; per layer kind (Gemma 3/4) those of its full-attention
    layers; a partial rotary (Gemma 4's ``proportional``) becomes default rope with the same
    theta, since the draft rotates its whole head; flat legacy ``rope_theta`` otherwise.
    """
    rope = dict(getattr(t, "rope_parameters", None) or {})
    if isinstance(rope.get("full_attention"), dict):
        rope = dict(rope["full_attention"])
    if rope.get("rope_type") == "proportional" or "partial_rotary_factor" in rope:
        rope = {"rope_theta": rope.get("rope_theta", 10000.0)}
    if not rope:
        rope = {"rope_theta": getattr(t, "rope_theta", 10000.0)}
    rope.setdefault("rope_type", "default")
    rope["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    return rope


def _import_torch():
    """torch, or None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def target_config(path: str) -> Any:
    """The target's config: transformers' ``AutoConfig``, or for model types transformers does
    not know (mlx-lm folders) the plain ``config.json`` with ``text_config`` merged on top.

    Raises:
        ConfigError: no config can be read.
    """
    import json
    from types import SimpleNamespace

    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError, ImportError) as e:
        file = Path(path) / "config.json"
        from dflash import hub
        from dflash.models.target_torch import is_hub_id

        if not file.is_file() and is_hub_id(path) and hub.is_cache_miss(e):
            raise hub.cache_miss("Target", path, "--target DIR (a local folder) or a .gguf file") from e
        if not file.is_file():
            raise ConfigError(
                f"Cannot read the config of target {path}: {str(e).splitlines()[0]}"
            ) from e
        data = json.loads(file.read_text())
        text = {**data, **(data.get("text_config") or {})}
        if not all(k in text for k in ("hidden_size", "num_hidden_layers", "vocab_size")):
            raise ConfigError(
                f"Target config {file} lacks hidden_size/num_hidden_layers/vocab_size."
            ) from e
        return SimpleNamespace(**text)


def init_draft(target: str | None, out: str | Path, *, layers: int = 5, block_size: int = 16,
               mask_token_id: int | None = None, seed: int = 0, dtype: str = "bfloat16",
               force: bool = False, arch: str = "dflash") -> Path:  # fmt: skip
    """Write an untrained draft (config.json + model.safetensors) for ``target`` into ``out``.

    Args:
        target: target hub id, folder or .gguf file (None = the demo target).
        out: output folder (created).
        layers: number of draft decoder layers (= number of target feature layers).
        block_size: trained/default block size L.
        mask_token_id: explicit mask id, else chosen by :func:`choose_mask_token_id`.
        seed: weight-initialisation seed (weights ~ N(0, 0.02), norms 1).
        dtype: storage dtype, bfloat16 or float32.
        force: overwrite a folder that already holds a draft.
        arch: "dflash" (v1) or "dflash2" (dynamic convolutions + candidate selector, brief §4;
            untrained: the convolutions start as identities and the selector's edge scores at 0,
            :meth:`~dflash.models.draft2_torch.DFlash2Draft.start_dflash2_parts`).

    Raises:
        InputError: bad numbers, ``out`` is a file, or ``out`` holds a draft and not force;
            ConfigError: mask id invalid for the target; BackendError: a chunked-attention
            target (no backend can roll it back yet).
    """
    # the arguments first: transformers' and torch's imports take seconds on a small CPU
    if layers < 1:
        raise InputError(f"--layers must be >= 1, got {layers}.")
    if block_size < 2:
        raise InputError(f"--block-size of a draft must be >= 2, got {block_size}.")
    if arch not in ARCHS:
        raise InputError(f"--arch must be dflash or dflash2, got {arch!r}.")
    if dtype not in ("bfloat16", "float32"):
        raise InputError(f"--dtype must be bfloat16 or float32, got {dtype!r}.")
    out_path = Path(out)
    if out_path.exists() and not out_path.is_dir():
        raise InputError(f"--out {out} is a file; pass a folder.")
    other = holds_other_model(out_path)
    if other is not None:
        raise InputError(f"--out {out} holds a model ({other}), not a DFlash draft; it is never overwritten.",
                         hint="choose a new or empty folder for the draft")  # fmt: skip
    if (out_path / "config.json").exists() and not force:
        raise InputError(f"--out {out} already holds a draft.",
                         hint="pass --force to overwrite it, or choose another folder")  # fmt: skip
    from transformers import AutoTokenizer, GenerationConfig

    from dflash.models.config import stop_token_ids

    torch = _import_torch()  # None on mlx-only installs: the draft is written with MLX
    from dflash.models.target_torch import check_target_layers

    if torch is not None:
        from dflash.models.target_torch import resolve_target
    else:
        from dflash.models.target_mlx import resolve_target

    path = resolve_target(target, "--target")
    cfg_t = target_config(path)
    # Chunked-attention targets cannot be rolled back on any backend; recurrent (GatedDeltaNet)
    # hybrids speculate on the mlx backend, so a draft may be made for them.
    check_target_layers(cfg_t, target or "the demo target", allow=("linear_attention",))
    tok = AutoTokenizer.from_pretrained(path)
    try:
        gen = GenerationConfig.from_pretrained(path)
    except OSError:
        gen = None
    stops = set(stop_token_ids(gen, tok))
    text = cfg_t.get_text_config() if hasattr(cfg_t, "get_text_config") else cfg_t
    eos = getattr(text, "eos_token_id", None)  # mlx-lm stops at the config's EOS ids too
    stops |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    rows = int(text.vocab_size)
    ids = default_target_layer_ids(text.num_hidden_layers, layers)
    if len(set(ids)) < len(ids):
        most = max((n for n in range(1, layers) if len(set(default_target_layer_ids(text.num_hidden_layers, n))) == n),
                   default=0)  # fmt: skip
        raise InputError(f"--layers {layers} is too many for a {text.num_hidden_layers}-layer target "
                         "(feature layers would repeat).", hint=f"use --layers {most} or fewer" if most else
                         "use a target with more layers")  # fmt: skip
    context = int(getattr(text, "max_position_embeddings", 1 << 30))
    if block_size > context:
        raise InputError(f"--block-size {block_size} exceeds the target's context ({context}).")
    avoid = stops | {i for i in (tok.bos_token_id, tok.pad_token_id) if i is not None}
    if mask_token_id is None:
        mask_token_id = choose_mask_token_id(tok, rows, avoid)
    elif not 0 <= mask_token_id < rows:
        raise ConfigError(
            f"--mask-token-id {mask_token_id} is outside the vocabulary (size {rows})."
        )
    elif mask_token_id in stops:
        raise ConfigError(f"--mask-token-id {mask_token_id} is a stop token of the target.")
    cfg = draft_config_for(cfg_t, layers=layers, block_size=block_size,
                           mask_token_id=mask_token_id, vocab_rows=rows, arch=arch)  # fmt: skip
    cfg.extra["dtype"] = dtype
    if torch is None:
        if arch != "dflash":
            raise InputError("--arch dflash2 needs torch installed.", hint="pip install 'dflash[torch]'")
        from dflash.models.draft_mlx import random_draft_mlx, save_draft_mlx

        save_draft_mlx(random_draft_mlx(cfg, seed=seed), out, dtype=dtype)
        return Path(out)
    from dflash.models.draft2_torch import DFlash2Draft
    from dflash.models.draft_torch import DFlashDraft

    torch.manual_seed(seed)
    model = (DFlash2Draft if arch == "dflash2" else DFlashDraft)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
        if arch == "dflash2":  # identity convolutions, zero selector edges (trainable from there)
            model.start_dflash2_parts()
    model.to(getattr(torch, dtype)).save(out)
    return Path(out)
