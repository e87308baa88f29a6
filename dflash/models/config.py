"""Draft checkpoint configuration: read, validate and write the published DFlash v1 layout.

A draft folder holds ``config.json`` (a Qwen3-style config plus a ``dflash_config`` object) and
``model.safetensors`` (or ``model-0000x-of-0000n.safetensors`` shards with an index). Brief §1.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.errors import CheckpointError, ConfigError

LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_BLOCK_SIZE = 16
DFLASH2_ARCH = "DFlash2DraftModel"


@dataclass
class DFlash2Settings:
    """The DFlash2-only fields of ``dflash_config`` (brief §1.1, §4; defaults as published).

    Attributes:
        conv_kernel_size: K, taps of the in-block dynamic convolution (2).
        conv_group_size: G, channels sharing one dynamic tap weight (16); divides hidden_size.
        selector_rank: r, rank of the candidate selector's trilinear edge score (256).
        selector_top_k: k, candidates per draft position (16).
        output_multiplier: draft logits are multiplied by this (1.0 = off).
        final_logit_softcapping: then ``cap * tanh(logits / cap)`` when > 0 (0 = off).
        input_embedding_scale: block embeddings (raw target lookup) are multiplied by this.
    """

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0
    input_embedding_scale: float = 1.0

    FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
              "output_multiplier", "final_logit_softcapping", "input_embedding_scale")  # fmt: skip

    def validate(self, hidden_size: int, vocab_size: int) -> None:
        """Raises ConfigError (one sentence) on a value the DFlash2 modules cannot use."""
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"DFlash2 {name} must be an integer >= 1, got {value!r}.")
        if hidden_size % self.conv_group_size:
            raise ConfigError(f"DFlash2 conv_group_size {self.conv_group_size} does not divide "
                              f"hidden_size {hidden_size}.")  # fmt: skip
        if self.selector_top_k > vocab_size:
            raise ConfigError(f"DFlash2 selector_top_k {self.selector_top_k} exceeds the "
                              f"vocabulary (size {vocab_size}).")  # fmt: skip
        for name in ("output_multiplier", "final_logit_softcapping", "input_embedding_scale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"DFlash2 {name} must be a finite number, got {value!r}.")
        if self.final_logit_softcapping < 0:
            raise ConfigError("DFlash2 final_logit_softcapping must be >= 0 (0 disables it).")


def holds_other_model(folder: str | Path) -> str | None:
    """What a folder's ``config.json`` describes when it is not a DFlash draft: its
    ``architectures`` (or ``model_type``) as a short string, so that commands writing a draft
    refuse to overwrite a model even with ``--force``; None when there is no config.json, it is
    a draft's (a ``dflash_config`` object or a DFlash architecture), or it is not a JSON object
    (a broken write of ours; ``--force`` may replace it)."""
    path = Path(folder) / "config.json"
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or isinstance(d.get("dflash_config"), dict):
        return None
    archs = [str(a) for a in d.get("architectures") or [] if a]
    if any("dflash" in a.lower() for a in archs):
        return None
    return ", ".join(archs) or (str(d["model_type"]) if d.get("model_type") else None)


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Target layers to read features from, spread from layer 1 to layer N-3 (brief §1.3).

    Args:
        num_target_layers: depth of the target model (its decoder layer count).
        num_features: how many layers to pick.

    Returns:
        Zero-based decoder-layer indices, ascending; e.g. 36 layers, 5 features ->
        [1, 9, 17, 25, 33].
    """
    if num_features == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    if hi < lo:
        return [min(i, num_target_layers - 1) for i in range(num_features)]
    step = (hi - lo) / (num_features - 1)
    return [int(round(lo + i * step)) for i in range(num_features)]


def normalize_rope(d: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of a config dict in the current ``rope_parameters`` form.

    Accepts ``rope_parameters`` or the legacy flat ``rope_theta`` + ``rope_scaling`` keys, and the
    legacy ``{"type": ...}`` spelling of the scaling type, which becomes ``rope_type`` (a config
    re-saved with both keys would otherwise reload as default rope and lose the scaling).
    """
    rope = dict(d.get("rope_parameters") or {})
    if not rope:
        rope = {"rope_theta": float(d.get("rope_theta", 10000.0))}
        if isinstance(d.get("rope_scaling"), dict):
            rope.update(d["rope_scaling"])
    legacy = rope.pop("type", None)
    if legacy is not None and rope.get("rope_type") in (None, "default"):
        rope["rope_type"] = legacy
    return rope


@dataclass
class DraftConfig:
    """Shape and DFlash settings of a v1 draft (paper §4.2, brief §1.1-§2.5).

    Attributes:
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
        num_key_value_heads, head_dim, rms_norm_eps, vocab_size: Qwen3-style shape fields.
        block_size: trained block size L (anchor + L-1 masked positions).
        mask_token_id: token id fed at every masked block position.
        target_layer_ids: zero-based target decoder layers whose outputs are concatenated.
        layer_types: per draft layer, "full_attention" or "sliding_attention".
        sliding_window: window W for sliding layers (tokens), None when no layer slides.
        is_causal: optional override of the per-layer causality inside the block.
        num_target_layers: depth of the target (informational).
        rope: the rope settings as found in the config (``rope_parameters`` or flat keys).
        dflash2: the DFlash2 settings for a ``DFlash2DraftModel``, None for a v1 draft.
        extra: every other key of config.json, written back unchanged.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    block_size: int = DEFAULT_BLOCK_SIZE
    rms_norm_eps: float = 1e-6
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    is_causal: bool | None = None
    num_target_layers: int | None = None
    max_position_embeddings: int = 32768
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_theta": 1000000.0})
    dflash2: DFlash2Settings | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.validate()

    @property
    def is_dflash2(self) -> bool:
        """True for a DFlash2 draft (dynamic in-block convolutions + candidate selector)."""
        return self.dflash2 is not None

    @property
    def num_features(self) -> int:
        """Number of target layers read (n in F = n x target hidden size)."""
        return len(self.target_layer_ids)

    def layer_is_causal(self, i: int) -> bool:
        """Whether draft layer i is causal within the block (brief §2.5)."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        """Sliding window of draft layer i in tokens, None for full attention."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def validate(self) -> None:
        """Check internal consistency.

        Raises:
            ConfigError: on any inconsistency, with a one-sentence message.
        """
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"Draft config has {len(self.layer_types)} layer_types for "
                f"{self.num_hidden_layers} layers; they must be equal."
            )
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"Draft config has unknown layer_types {bad}; use {list(LAYER_TYPES)}.")
        if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ConfigError("Draft config has sliding layers but no positive sliding_window.")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError(f"Draft block_size must be an integer >= 1, got {self.block_size!r}.")
        if not self.target_layer_ids or any(i < 0 for i in self.target_layer_ids):
            raise ConfigError("Draft target_layer_ids must be a non-empty list of layer indices >= 0.")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"Draft mask_token_id {self.mask_token_id} is outside the vocabulary "
                f"(size {self.vocab_size})."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("Draft num_attention_heads must be a multiple of num_key_value_heads.")
        if self.dflash2 is not None:
            self.dflash2.validate(self.hidden_size, self.vocab_size)

    def check_target(self, hidden: int, depth: int, vocab_rows: int, stop_ids: list[int]) -> None:
        """Check that this draft fits a target, from its shape alone (before any forward).

        Args:
            hidden: the target's hidden size; depth: its decoder layer count;
            vocab_rows: rows of its embedding table; stop_ids: its stop token ids.

        Raises:
            ConfigError: feature width, layer ids, vocabulary or mask id do not fit.
        """
        if self.hidden_size != hidden:
            raise ConfigError(f"Draft hidden_size {self.hidden_size} != target hidden_size {hidden}; "
                              "the draft shares the target's embedding and LM head.")  # fmt: skip
        if max(self.target_layer_ids) >= depth:
            raise ConfigError(f"Draft target_layer_ids {self.target_layer_ids} reach past the "
                              f"target's {depth} layers.", hint="use a draft made for this target")  # fmt: skip
        if self.vocab_size != vocab_rows:
            raise ConfigError(f"Draft vocab_size {self.vocab_size} != target vocabulary {vocab_rows}.",
                              hint="use a draft made for this target")  # fmt: skip
        if self.mask_token_id in stop_ids:
            raise ConfigError(f"Draft mask_token_id {self.mask_token_id} is a stop token of the "
                              "target.", hint="choose another mask id (dflash init-draft "
                              "--mask-token-id)")  # fmt: skip

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DraftConfig:
        """Build from a config.json dict; accepts flat and nested ``block_size`` (brief §1.1).

        ``"DFlash2DraftModel"`` in ``architectures`` makes a DFlash2 config; its extra fields
        are read from ``dflash_config`` first, then the top level, else the defaults of
        :class:`DFlash2Settings`.

        Raises:
            ConfigError: a missing ``mask_token_id``/``target_layer_ids``, or any inconsistency.
        """
        archs = d.get("architectures") or []
        dc = d.get("dflash_config") or {}
        if not isinstance(dc, dict):
            raise ConfigError("Draft config's dflash_config must be a JSON object.")

        def pick(name: str, default: Any = None) -> Any:
            return dc[name] if name in dc else d.get(name, default)

        missing = [k for k in ("mask_token_id", "target_layer_ids") if pick(k) is None]
        if missing:
            raise ConfigError(
                f"Draft config lacks {', '.join(missing)} (expected in dflash_config).",
                hint="add them to config.json or recreate the draft with 'dflash init-draft'",
            )
        v2 = None
        if DFLASH2_ARCH in archs:
            found = {k: pick(k) for k in DFlash2Settings.FIELDS if pick(k) is not None}
            v2 = DFlash2Settings(**found)
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            rope = normalize_rope(d)
            known = {
                "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "layer_types",
                "sliding_window", "is_causal", "num_target_layers", "max_position_embeddings",
                "rope_parameters", "rope_theta", "rope_scaling", "block_size", "dflash_config",
                "architectures", *DFlash2Settings.FIELDS,
            }  # fmt: skip
            return cls(
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads", heads)),
                head_dim=int(d.get("head_dim") or hidden // heads),
                vocab_size=int(d["vocab_size"]),
                mask_token_id=int(pick("mask_token_id")),
                target_layer_ids=[int(i) for i in pick("target_layer_ids")],
                block_size=pick("block_size", DEFAULT_BLOCK_SIZE),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                layer_types=list(d.get("layer_types") or []),
                sliding_window=d.get("sliding_window"),
                is_causal=d.get("is_causal"),
                num_target_layers=d.get("num_target_layers"),
                max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                rope=rope,
                dflash2=v2,
                extra={k: v for k, v in d.items() if k not in known},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"Draft config is malformed: {type(e).__name__} {e}.") from e

    def to_dict(self) -> dict[str, Any]:
        """The config.json dict in the published layout (nested ``dflash_config``)."""
        d = {
            "model_type": "qwen3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            **self.extra,
            "architectures": [DFLASH2_ARCH if self.dflash2 else "DFlashDraftModel"],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "layer_types": self.layer_types,
            "sliding_window": self.sliding_window,
            "num_target_layers": self.num_target_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", **self.rope},
            "block_size": self.block_size,
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": self.target_layer_ids,
            },
        }
        if self.dflash2 is not None:
            d["dflash_config"].update({k: getattr(self.dflash2, k) for k in DFlash2Settings.FIELDS})
        if self.is_causal is not None:
            d["is_causal"] = self.is_causal
        for k in ("rope_theta", "rope_scaling", "auto_map"):
            d.pop(k, None)  # rope lives in rope_parameters; we never ship remote code
        return d

    @classmethod
    def load(cls, folder: str | Path) -> DraftConfig:
        """Read ``folder/config.json``.

        Raises:
            CheckpointError: the file is missing or not valid JSON.
            ConfigError: its content is invalid.
        """
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise CheckpointError(
                f"No config.json in draft folder {folder}.",
                hint="pass a DFlash draft folder or hub id, or create one with 'dflash init-draft'",
            )
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"Draft config {path} is not valid JSON ({e}).",
                                  hint="restore the draft's config.json, or re-download the draft") from e  # fmt: skip
        if not isinstance(data, dict):
            raise CheckpointError(f"Draft config {path} is not a JSON object.",
                                  hint="restore the draft's config.json, or re-download the draft")  # fmt: skip
        refuse_target_as_draft(data, folder)
        return cls.from_dict(data)

    def save(self, folder: str | Path) -> Path:
        """Write ``folder/config.json`` (creating the folder); returns its path."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def is_draft_folder(path: Path) -> bool:
    """Whether ``path`` is a local folder holding a DFlash (or DFlash2) draft: its config.json
    has a ``dflash_config`` section or a ``*DraftModel`` architecture."""
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    return isinstance(cfg, dict) and ("dflash_config" in cfg or any(
        isinstance(a, str) and a.endswith("DraftModel") for a in archs or []))  # fmt: skip


def refuse_draft_as_target(model: str, flag: str = "--model") -> None:
    """Refuse a ``--model`` (``flag``: the option as the command names it) that is a local DFlash
    draft folder (:func:`is_draft_folder`).

    Raises:
        CheckpointError: naming the value, with the fix as the hint.
    """
    if is_draft_folder(Path(model).expanduser()):
        fix = "pass it as --draft, with the target it was trained for as --model" if flag == "--model" \
            else f"pass the target model as {flag}, not a draft"  # fmt: skip
        raise CheckpointError(f"{flag} {model} is a DFlash draft, not a target.", hint=fix)


def stop_token_ids(generation_config: Any, tokenizer: Any) -> list[int]:
    """Stop ids: the generation config's ``eos_token_id`` (int or list), else the tokenizer's."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def refuse_target_as_draft(config: dict[str, Any], folder: str | Path) -> None:
    """Refuse a draft folder whose config.json is a target model's: no DFlash fields
    (``dflash_config``, ``mask_token_id``, ``target_layer_ids``) and a causal-LM architecture
    or a ``model_type``, the usual mistake of passing the target as ``--draft``.

    Raises:
        ConfigError: naming the folder and the architecture, with ``--model`` and the registry
            (the published draft, when the registry knows the target) in the hint.
    """
    dc = config.get("dflash_config")
    if isinstance(dc, dict) or any(k in config for k in ("mask_token_id", "target_layer_ids")):
        return
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    if any(a.endswith("DraftModel") for a in archs) or not (archs or config.get("model_type")):
        return
    from dflash.registry import find

    what = archs[0] if archs else f"model_type {config.get('model_type')}"
    name = str(config.get("_name_or_path") or folder)
    found = find(name) or find(str(folder))
    published = f" (its published draft: {found[0].draft})" if found else ""
    raise ConfigError(f"--draft {folder} looks like a target model ({what}), not a DFlash draft: its "
                      "config.json has no dflash_config.",
                      hint=f"pass it as --model{published}; 'dflash models' lists the published drafts, "
                      f"'dflash init-draft --target {folder}' makes an untrained one")  # fmt: skip
