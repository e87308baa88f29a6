"""The plain path of the transformers backend: any ``AutoModelForCausalLM`` target with a torch DFlash draft.

Target: HF model with a ``DynamicCache`` (rollback = crop). Context features are the outputs
of the target layers in ``target_layer_ids`` (``hidden_states[L + 1]`` in HF numbering,
brief §1.3), concatenated. Draft: :class:`dflash.models.draft_torch.DFlashDraft` (or the
DFlash2 subclass, whose candidate selector picks the proposals) with the target's embedding
table (raw lookup) and LM head.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from dflash.backends.base import SelectorProposal
from dflash.backends.draft_head import DraftHead
from dflash.backends.gdn_torch import GatedDeltaRollback
from dflash.errors import BackendError, CheckpointError, ConfigError, InputError
from dflash.kernels.settings import KernelSettings
from dflash.models.config import DraftConfig
from dflash.models.draft_load import load_draft as load_draft_module
from dflash.models.draft_torch import DFlashDraft

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def pick_device(device: str) -> torch.device:
    """Resolve ``auto|cuda|cuda:N|cpu``.

    Raises:
        BackendError: cuda requested but not available.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BackendError("CUDA was requested but no CUDA device is available.",
                           hint="use --device cpu (or auto)")  # fmt: skip
    if device != "cpu" and not device.startswith("cuda"):
        raise InputError(f"Unknown --device {device!r}; use auto, cuda, cuda:N or cpu.")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Resolve ``auto|bfloat16|float16|float32``; auto = bfloat16 on CUDA, float32 on CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise InputError(f"Unknown --dtype {dtype!r}; use auto, bfloat16, float16 or float32.")
    return DTYPES[dtype]


def check_pair(cfg: DraftConfig, target_cfg: Any, vocab_rows: int, stop_ids: list[int]) -> None:
    """Check that a draft fits a target, from the configs alone (before any forward).

    Raises:
        ConfigError: feature width, layer ids, vocabulary or mask id do not fit.
    """
    text_cfg = target_cfg.get_text_config() if hasattr(target_cfg, "get_text_config") else target_cfg
    cfg.check_target(text_cfg.hidden_size, text_cfg.num_hidden_layers, vocab_rows, stop_ids)


def cache_kwarg(model: Any) -> str:
    """Name of the keyword that passes a KV cache to ``model.forward``.

    Newer transformers (5.24 checked) call it ``cache`` and warn that ``past_key_values`` goes
    away in 5.40; older 5.x releases (5.17 checked) only know ``past_key_values``.
    """
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def new_target_cache(config: Any):
    """An empty ``DynamicCache`` for a target config whose sliding-window layers record the past.

    A sliding layer normally drops the rows that fall out of its window as soon as a forward
    adds rows; with past recording (``activate_past_recording``, transformers >= 5.15) it keeps
    them until the next ``crop``, so a verify's rejected rows can be cut and the window slid back
    exactly (see :func:`rollback_cache`).
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()
    return cache


def rollback_cache(cache: Any, length: int, recurrent: GatedDeltaRollback | None = None) -> None:
    """Cut a target ``DynamicCache`` back to its first ``length`` positions.

    ``recurrent`` restores the GatedDeltaNet layers of a hybrid target (see
    :mod:`dflash.backends.gdn_torch`); the attention layers are cut here.

    Full-attention layers are sliced (``crop``'s meaning changed between transformers releases);
    sliding-window layers drop the last ``seq - length`` rows with ``crop(-n)`` and keep the
    ``window - 1`` rows before them, which is what decoding the same tokens one at a time
    leaves; layers without a cache of their own (Gemma's KV-sharing layers) are skipped.

    Raises:
        BackendError: a recurrent (linear-attention) layer without ``recurrent`` or an unknown
            cache layer, or a sliding layer that did not end at ``length`` positions and
            ``min(length, window - 1)`` rows.
    """
    if recurrent is not None:
        recurrent.restore(cache, length)
    for layer in getattr(cache, "layers", []):
        linear = hasattr(layer, "recurrent_states") and not hasattr(layer, "keys")
        if recurrent is not None and linear:
            continue
        if getattr(layer, "is_linear", False) or not hasattr(layer, "keys"):
            raise BackendError(
                f"The target's {type(layer).__name__} cache cannot be rolled back exactly.",
                hint="use a target with full-attention or sliding-window layers on the transformers backend",
            )
        if layer.keys is None or not layer.keys.numel():
            continue
        if not getattr(layer, "is_sliding", False):
            if layer.keys.shape[-2] > length:
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]
            continue
        drop = layer.get_seq_length() - length
        layer.crop(-drop if drop > 0 else 0)  # crop(0) trims the recorded rows to the window
        rows = min(length, layer.sliding_window - 1)
        if layer.get_seq_length() != length or layer.keys.shape[-2] != rows:
            raise BackendError(
                f"A sliding-window cache layer holds {layer.keys.shape[-2]} rows for "
                f"{layer.get_seq_length()} positions after a rollback to {length} (expected {rows}).",
                hint="this transformers release crops sliding caches differently; install "
                "transformers>=5.17,<5.40",
            )


class TransformersBackend:
    """Target + draft on one torch device; implements ``dflash.backends.base.LocalBackend``.

    Caches: the target ``DynamicCache`` holds K/V of committed positions (plus, between
    verify and rollback, the proposals); the draft cache holds context K/V only.

    Args:
        target: a loaded HF causal LM (eval mode).
        draft: a loaded DFlashDraft or None (autoregressive only).
        device: torch device of both.
        settings: the resolved :class:`~dflash.kernels.settings.KernelSettings` (this path
            reads ``draft_vocab``; recorded by :meth:`describe`); None = the defaults.
    """

    def __init__(self, target: Any, draft: DFlashDraft | None, device: torch.device,
                 settings: KernelSettings | None = None):  # fmt: skip
        self.target, self.draft_model, self.device = target, draft, device
        self.settings = KernelSettings() if settings is None else settings
        self.embed_weight = target.get_input_embeddings().weight  # [V, H]
        self.lm_head = target.get_output_embeddings()
        self.vocab_size = int(self.embed_weight.shape[0])
        cfg = draft.config if draft is not None else None
        self.mask_token_id = cfg.mask_token_id if cfg else -1
        self.draft_block_size = cfg.block_size if cfg else 1
        self.layer_ids = [i + 1 for i in cfg.target_layer_ids] if cfg else []
        text_cfg = target.config.get_text_config()
        self.max_context = int(getattr(text_cfg, "max_position_embeddings", 1 << 30))
        self.cache = None
        self.recurrent = GatedDeltaRollback.for_target(target)  # hybrids: GatedDeltaNet states
        self.cache_kw = cache_kwarg(target)
        self.draft_cache = draft.new_cache() if draft is not None else None
        self.draft_uses_sampling = bool(getattr(draft, "is_dflash2", False))  # DFlash2 selector
        self.draft_head_rows = draft is not None and not self.draft_uses_sampling  # ``rows=``
        self.embed_scale = float(getattr(draft, "embed_scale", 1.0))
        # the draft's LM head, over its draft vocabulary when it has one (draft_vocab.json)
        self.draft_head = DraftHead.for_draft(self.lm_head, draft, self.settings.draft_vocab) if draft is not None else None
        self._draft_rng: torch.Generator | None = None
        # prefix cache (dflash serve): what the target was fed since the last reset
        self.prefix_cache: Any = None  # a dflash.backends.prefix_cache.PrefixCache, or None
        self.fed: list[int] = []  # token ids of the cache's rows
        self.fed_feats: list[torch.Tensor] = []  # feature chunks of rows 0..feat_rows-1
        self.feat_rows = 0
        self.last_cached = 0  # prompt tokens the last prefill took from the prefix cache
        self.prefill_tokens = 0  # prompt tokens run through the target by prefills, in total

    # -- protocol ---------------------------------------------------------------------------
    def reset(self, max_positions: int | None = None) -> None:
        self._save_prefix()
        self.fed, self.fed_feats, self.feat_rows = [], [], 0
        self.cache = new_target_cache(self.target.config)
        if self.recurrent is not None:
            self.recurrent.reset()
        if self.draft_cache is not None:
            self.draft_cache.reset()
        self._draft_rng = None  # re-seeded from the request's sampling seed at its first draft

    def _forward(self, ids: torch.Tensor, start: int, with_features: bool, last_only: bool):
        # The cache must hold exactly the positions before ``start``, sliding layers no more than
        # their window's rows (transformers 5.17 attends to every recorded row while its mask
        # covers the window only).
        rollback_cache(self.cache, start, self.recurrent)
        pos = torch.arange(start, start + ids.shape[-1], device=self.device)[None]
        rec = self.recurrent
        record = rec.recording(self.cache, start, ids.shape[-1]) if rec else nullcontext()
        with torch.inference_mode(), record:
            out = self.target(input_ids=ids, position_ids=pos, use_cache=True,
                              output_hidden_states=with_features,
                              logits_to_keep=1 if last_only else 0,
                              **{self.cache_kw: self.cache})  # fmt: skip
        feats = None
        if with_features:
            feats = torch.cat([out.hidden_states[i][0] for i in self.layer_ids], dim=-1)  # [T, F]
        return out.logits[0], feats

    def prefill(self, prompt_ids: list[int], with_features: bool):
        entry, n = None, 0
        if self.prefix_cache is not None:  # the rows of the longest cached prefix, restored
            entry, n = self.prefix_cache.lookup(prompt_ids, with_features)
            for i, (k, v) in enumerate(entry.layers if n else []):
                self.cache.update(k[..., :n, :], v[..., :n, :], i)
        ids = torch.tensor([prompt_ids[n:]], dtype=torch.long, device=self.device)
        logits, feats = self._forward(ids, n, with_features, last_only=True)
        if feats is not None and n:
            feats = torch.cat((entry.feats[:n], feats))
        self.last_cached, self.prefill_tokens = n, self.prefill_tokens + len(prompt_ids) - n
        self._track(list(prompt_ids), 0, feats)
        return logits[-1], feats

    def _track(self, ids: list[int], start: int, feats: torch.Tensor | None) -> None:
        """Record the rows a forward at ``start`` added (prefix cache on only)."""
        if self.prefix_cache is None:
            return
        del self.fed[start:]
        self.fed.extend(ids)
        if feats is not None and self.feat_rows == start:
            self.fed_feats.append(feats)
            self.feat_rows += feats.shape[0]

    def _save_prefix(self) -> None:
        """Hand the rows fed since the last reset to the prefix cache (before a new request)."""
        if self.prefix_cache is None or self.cache is None or not self.fed:
            return
        if any(getattr(layer, "is_sliding", False) or not hasattr(layer, "keys") for layer in self.cache.layers):
            return  # a sliding window's rows are not indexed by position: such targets cache no prefix
        n = len(self.fed)
        layers = [(layer.keys[..., :n, :], layer.values[..., :n, :]) for layer in self.cache.layers]
        feats = torch.cat(self.fed_feats)[:n] if self.fed_feats else None
        self.prefix_cache.store(self.fed, layers, feats)

    def draft(self, anchor: int, context: torch.Tensor, start: int, length: int, sampling=None,
              rows: int | None = None):
        dev = self.device
        if isinstance(context, (list, tuple)):  # chunks left by plain steps (--block-size auto)
            context = torch.cat(list(context))
        with torch.inference_mode():
            block = torch.full((1, length), self.mask_token_id, dtype=torch.long, device=dev)
            block[0, 0] = anchor
            emb = self.embed_weight[block]  # [1, L, H] raw lookup (brief §1.4)
            if self.embed_scale != 1.0:
                emb = emb * self.embed_scale
            ctx_pos = torch.arange(start - context.shape[0], start, device=dev)[None]
            q_pos = torch.arange(start, start + length, device=dev)[None]
            h = self.draft_model(emb, context[None], q_pos, ctx_pos, cache=self.draft_cache)
            if self.draft_uses_sampling:  # DFlash2: the selector walks the candidates (§4.2)
                temp = 0.0 if sampling is None else float(sampling.temperature)
                rng = self._selector_rng(sampling) if temp > 0 else None
                tokens, cand, q = self.draft_model.propose(
                    h[:, 1:], block[:, 0], self.lm_head, temp, rng
                )
                return tokens[0], SelectorProposal(cand[0], None if q is None else q[0])
            return self.draft_head(h[0, 1 : (rows or length - 1) + 1])  # [rows], [rows, V]

    def _selector_rng(self, sampling) -> torch.Generator:
        """The torch generator of the DFlash2 selector's draws, seeded once per request."""
        if self._draft_rng is None:
            self._draft_rng = torch.Generator(device=self.device)
            if sampling.seed is None:
                self._draft_rng.seed()
            else:
                self._draft_rng.manual_seed(sampling.seed)
        return self._draft_rng

    def verify(self, anchor: int, proposals, start: int, with_features: bool):
        head = torch.tensor([anchor], dtype=torch.long, device=self.device)
        ids = head if proposals is None else torch.cat((head, proposals))
        logits, feats = self._forward(ids[None], start, with_features, last_only=False)
        if self.prefix_cache is not None:
            self._track(ids.tolist(), start, feats)
        return logits, feats

    def rollback(self, length: int) -> None:
        rollback_cache(self.cache, length, self.recurrent)
        if self.prefix_cache is not None:
            del self.fed[length:]
            while self.fed_feats and self.feat_rows - self.fed_feats[-1].shape[0] >= length:
                self.feat_rows -= self.fed_feats.pop().shape[0]
            if self.feat_rows > length:
                last = self.fed_feats[-1]
                self.fed_feats[-1] = last[: last.shape[0] - (self.feat_rows - length)]
                self.feat_rows = length

    def score(self, ids: list[int]) -> torch.Tensor:
        """Logits [T, V] of every position of ``ids`` in one forward on a fresh cache (the
        server's prompt log-probabilities); leaves the backend reset.

        Raises:
            BackendError: on the static-cache path (a subclass with its own caches).
        """
        if hasattr(self, "use_graphs"):
            raise BackendError("Prompt scoring runs on the plain path only.",
                               hint="load with cuda_graphs=False")  # fmt: skip
        self.reset()
        t = torch.tensor([ids], dtype=torch.long, device=self.device)
        logits, _ = self._forward(t, 0, False, last_only=False)
        self.reset()
        return logits

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1)

    def to_list(self, *arrays: torch.Tensor) -> list[list[int]]:
        if len(arrays) == 1:
            return [arrays[0].tolist()]
        sizes = [a.numel() for a in arrays]
        flat = torch.cat([a.reshape(-1) for a in arrays]).tolist()  # one sync
        out, i = [], 0
        for s in sizes:
            out.append(flat[i : i + s])
            i += s
        return out

    def to_numpy(self, logits: torch.Tensor) -> np.ndarray:
        return logits.float().cpu().numpy()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def sampler(self, params):
        """Device sampler for temperature > 0 (see :class:`dflash.sampling_torch.TorchSampler`)."""
        from dflash.sampling_torch import TorchSampler

        return TorchSampler(params, self.device)

    @property
    def draft_vocab_size(self) -> int | None:
        """Vd of the draft vocabulary in use, or None (full vocabulary)."""
        head = self.draft_head
        return None if head is None or head.ids is None else int(head.ids.shape[0])

    def describe(self) -> dict[str, Any]:
        """What runs the forwards: impl, device (with the GPU name), dtype, graphs, compile, and
        the resolved settings (``kernel_settings``)."""
        dev = str(self.device)
        if self.device.type == "cuda":
            dev += f" ({torch.cuda.get_device_name(self.device)})"
        return {"impl": "dynamic", "device": dev, "dtype": str(self.embed_weight.dtype).split(".")[-1],
                "cuda_graphs": False, "compile": False, "kernel_settings": self.settings.record()}  # fmt: skip


# Checkpoint names of a multimodal wrapper's text model -> those of its text-only causal LM:
# the transformers 5 layout (model.language_model.*) and the older one (language_model.model.*).
WRAPPER_KEYS = {r"^model\.language_model\.": "model.", r"^language_model\.model\.": "model.",
                r"^language_model\.lm_head\.": "lm_head."}  # fmt: skip


def text_only_config(config: Any) -> Any:
    """The text config of a multimodal wrapper (Gemma 3/4, Mistral 3, LLaVA ... configs with a
    ``text_config``) when transformers can build that text model alone as a causal LM, else None.
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is config:
        return None
    try:
        MODEL_FOR_CAUSAL_LM_MAPPING[type(text)]
    except KeyError:
        return None
    # the wrapper ties its LM head by its own flag (Mistral 3: tied, its text config: not)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", text.tie_word_embeddings))
    return text


def wrapper_class(config: Any) -> Any:
    """transformers' image-text-to-text class for a multimodal wrapper whose text model has no
    causal LM of its own (Muse-Glimmer), else None: it then decodes text prompts whole."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is config or type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None
    try:
        return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    except KeyError:
        return None


def load_target(path: str, device: torch.device, dtype: torch.dtype):
    """Load an HF causal LM and its tokenizer from a folder or hub id (no remote code).

    The config is read and checked first, so a target this backend cannot speculate on is
    refused before any weights load. A multimodal wrapper loads its text model alone (the
    prompts are text): its causal LM over ``text_config``, the weights renamed by
    :data:`WRAPPER_KEYS`, the vision and audio towers never read into memory; a wrapper whose
    text model has no causal LM class (Muse-Glimmer) loads whole (:func:`wrapper_class`).

    Raises:
        CheckpointError: the model cannot be found or read, or a wrapper's text weights do not
            fit its text model.
        BackendError: a chunked-attention or recurrent target (see ``check_target_layers``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dflash.models.target_torch import check_target_layers, quiet_transformers

    quiet_transformers()
    try:
        config = AutoConfig.from_pretrained(path)
        check_target_layers(config, path)
        tok = AutoTokenizer.from_pretrained(path)
        text, whole = text_only_config(config), wrapper_class(config)
        if text is None:
            model = (whole or AutoModelForCausalLM).from_pretrained(path, dtype=dtype)
        else:
            model, info = AutoModelForCausalLM.from_pretrained(path, config=text, dtype=dtype, key_mapping=WRAPPER_KEYS,
                                                               output_loading_info=True)  # fmt: skip
            check_text_weights(path, info, tied=text.tie_word_embeddings)
    except OSError as e:
        from dflash import hub
        from dflash.models.target_torch import is_hub_id

        if is_hub_id(path) and hub.is_cache_miss(e):
            raise hub.cache_miss("Target", path, "--model DIR (a local folder) or a .gguf file") from e
        raise CheckpointError(f"Cannot load target {path}: {str(e).splitlines()[0]}",
                              hint="pass a local model folder, a .gguf file or a reachable hub id") from e  # fmt: skip
    except ValueError as e:
        raise CheckpointError(f"Target {path} is not a supported causal LM: {str(e).splitlines()[0]}",
                              hint="pass a transformers causal-LM folder (config.json with a model_type)") from e  # fmt: skip
    model.to(device).eval()
    cache_cls = getattr(model, "_supports_cache_class", True)
    if not cache_cls:
        raise BackendError(f"Target {path} does not support a rollback-able KV cache.")
    return model, tok


def check_text_weights(path: str, info: dict, tied: bool) -> None:
    """Refuse a wrapper's text model that did not get all of its weights (transformers would
    leave them random) or left decoder layers, or an untied LM head, unread.

    Raises:
        CheckpointError: naming the first missing or unread tensor and the count.
    """
    missing = sorted(info.get("missing_keys") or [])
    text = ("model.layers.",) if tied else ("model.layers.", "lm_head.")
    unread = sorted(k for k in info.get("unexpected_keys") or [] if k.startswith(text))
    bad = missing or unread
    if bad:
        what = "missing" if missing else "unread"
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointError(f"Target {path}: the text model's weights do not fit its checkpoint: "
                              f"{bad[0]} {what}{more}.",
                              hint="pass the text model's own folder, or a checkpoint saved by transformers")  # fmt: skip


def load_draft(folder, device: torch.device, dtype: torch.dtype) -> DFlashDraft:
    """Load a v1 or DFlash2 draft folder onto a device in a dtype (see dflash.models.draft_load.load_draft)."""
    try:
        return load_draft_module(folder, dtype=dtype, device=device).eval()
    except (ConfigError, CheckpointError):
        raise
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"Cannot load draft weights from {folder}: {_first_lines(e)}.",
                              hint="the weights do not fit config.json: restore the folder's own config "
                                   "or its weights") from e  # fmt: skip


def _first_lines(e: Exception) -> str:
    """One line for a load error: torch's multi-line state-dict report shortened to its first
    mismatch and a count ("size mismatch for layers.0.mlp.up_proj.weight: ... (and 14 more)")."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    details = [ln for ln in lines[1:] if ln.lower().startswith(("size mismatch", "missing key", "unexpected key"))]
    if not details:
        return lines[0].rstrip(":.") if lines else type(e).__name__
    more = f" (and {len(details) - 1} more)" if len(details) > 1 else ""
    return details[0].rstrip(".") + more
