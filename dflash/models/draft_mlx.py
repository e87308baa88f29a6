"""The DFlash v1 draft model in MLX (paper §4.2 and appendix A.3; brief §2, §5.1).

Same skeleton and parameter names as :mod:`dflash.models.draft_torch`, so one checkpoint
(config.json + safetensors) serves both backends. Queries come only from the block
``[anchor, mask x (L-1)]``; keys/values are the projected target context followed by the block.
The draft owns no embedding and no LM head: the backend passes the target's.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from dflash.errors import CheckpointError, ConfigError, InputError
from dflash.models.config import DraftConfig
from dflash.models.draft_vocab import load_draft_vocab

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (``mx.fast.rms_norm``, float32 accumulation)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dim,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


class Rope:
    """Rotary embedding at contiguous absolute positions, half-split convention.

    Default rope builds cos/sin tables in float32 from the inverse frequencies (as the torch
    draft does); scaled rope types (linear, llama3, yarn, ...) use mlx-lm's rope factory.
    """

    def __init__(self, cfg: DraftConfig):
        self.rope_type = cfg.rope.get("rope_type") or cfg.rope.get("type") or "default"
        theta = float(cfg.rope.get("rope_theta", 10000.0))
        d = cfg.head_dim
        self.inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
        self.scaled = None
        if self.rope_type != "default":
            from mlx_lm.models.rope_utils import initialize_rope

            self.scaled = initialize_rope(d, theta, False, {**cfg.rope, "rope_type": self.rope_type},
                                          cfg.max_position_embeddings)  # fmt: skip

    def tables(self, start: int, length: int) -> tuple[mx.array, mx.array] | int:
        """(cos, sin) [length, D] float32 for positions start..start+length-1 (or the offset)."""
        if self.scaled is not None:
            return start
        pos = np.arange(start, start + length, dtype=np.float32)[:, None]
        freqs = pos * self.inv_freq[None]  # float32 like the torch draft
        emb = np.concatenate([freqs, freqs], axis=-1)
        return mx.array(np.cos(emb)), mx.array(np.sin(emb))

    def tables_at(self, positions: mx.array) -> tuple[mx.array, mx.array] | mx.array:
        """As :meth:`tables` for positions [L] int32 held on the device (the next block's anchor
        position is known on the device before the host reads it); scaled rope: the offset."""
        if self.scaled is not None:
            return positions[0]
        freqs = positions.astype(mx.float32)[:, None] * mx.array(self.inv_freq)[None]
        emb = mx.concatenate([freqs, freqs], axis=-1)
        return mx.cos(emb), mx.sin(emb)

    def apply(self, x: mx.array, tables) -> mx.array:
        """Rotate x [B, H, T, D] with tables from :meth:`tables`."""
        if self.scaled is not None:
            return self.scaled(x, offset=tables)
        return _rotate(x, *tables)


@mx.compile
def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Half-split rotation of x [B, H, T, D] by float32 tables [T, D] (one fused kernel; a
    trace per shape)."""
    half = x.shape[-1] // 2
    xf = x.astype(mx.float32)
    rot = mx.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rot * sin).astype(x.dtype)


@partial(mx.compile, shapeless=True)
def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up, fused."""
    return nn.silu(gate) * up


class DraftCache:
    """Per-layer K/V of the context rows the draft has seen (never block rows).

    Context K/V are k-normed and rotated once and reused in later rounds. Rows are contiguous in
    position: layer i holds positions ``first[i] .. first[i] + len - 1``. Rows no future query can
    see (older than a sliding layer's window) and rows beyond ``--draft-window`` are dropped.

    Args:
        num_layers: draft layers.
        windows: per layer, the number of most recent context rows worth keeping (None = all).
    """

    def __init__(self, num_layers: int, windows: list[int | None]):
        self.windows = windows
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.first = [0] * num_layers

    def length(self, i: int) -> int:
        """Cached context rows of layer i."""
        return 0 if self.keys[i] is None else int(self.keys[i].shape[2])

    def append(self, i: int, k: mx.array, v: mx.array, ctx_start: int, slack: int = 0):
        """Append k, v [B, Hkv, Tc, D] at positions ctx_start..; returns (keys, values, first).

        ``slack``: rows kept beyond the window (the pipelined draft appends a verify's rows
        before the host knows how many are real; :meth:`drop_tail` then removes the rest)."""
        if self.keys[i] is None or self.length(i) == 0:
            self.first[i] = ctx_start
        else:
            k = mx.concatenate([self.keys[i], k], axis=2)
            v = mx.concatenate([self.values[i], v], axis=2)
        self.keys[i], self.values[i] = k, v
        self._cut(i, slack)
        return self.keys[i], self.values[i], self.first[i]

    def _cut(self, i: int, slack: int = 0) -> None:
        """Drop the oldest rows of layer i beyond its window (+ slack)."""
        w, n = self.windows[i], self.length(i)
        if w is not None and n > w + slack:
            drop = n - w - slack
            self.keys[i], self.values[i] = self.keys[i][:, :, drop:], self.values[i][:, :, drop:]
            self.first[i] += drop

    def drop_tail(self, n: int) -> None:
        """Forget the newest n rows of every layer (rows appended for proposals the target
        rejected), then apply the windows."""
        for i in range(len(self.keys)):
            if self.keys[i] is None:
                continue
            if n:
                keep = self.length(i) - n
                self.keys[i], self.values[i] = (
                    self.keys[i][:, :, :keep],
                    self.values[i][:, :, :keep],
                )
            self._cut(i)

    def reset(self) -> None:
        """Forget every context row (start of a new request)."""
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)
        self.first = [0] * len(self.first)


class DraftAttention(nn.Module):
    """GQA attention: Q from the block only, K/V from [context; block], per-head q/k RMSNorm."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        b, t, _ = x.shape
        return x.reshape(b, t, n, self.head_dim).transpose(0, 2, 1, 3)  # [B, n, T, D]

    def __call__(self, x, ctx, rope, q_tab, c_tab, mask_fn, cache, idx, ctx_start, slack=0):
        """x [B, L, H] normed block; ctx [B, Tc, H] projected context; returns [B, L, H].

        ``mask_fn(first_ctx_pos, n_ctx_rows)`` gives the bool mask [L, Tk] or None.
        """
        b, lq, _ = x.shape
        q = rope.apply(self.q_norm(self._heads(self.q_proj(x), self.heads)), q_tab)
        kb = rope.apply(self.k_norm(self._heads(self.k_proj(x), self.kv_heads)), q_tab)
        vb = self._heads(self.v_proj(x), self.kv_heads)
        kc = rope.apply(self.k_norm(self._heads(self.k_proj(ctx), self.kv_heads)), c_tab)
        vc = self._heads(self.v_proj(ctx), self.kv_heads)
        first = ctx_start
        if cache is not None:
            kc, vc, first = cache.append(idx, kc, vc, ctx_start, slack)
        k = mx.concatenate([kc, kb], axis=2)
        v = mx.concatenate([vc, vb], axis=2)
        mask = mask_fn(idx, first, kc.shape[2])
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, lq, self.heads * self.head_dim))


class DraftMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(_swiglu(self.gate_proj(x), self.up_proj(x)))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer with context K/V injection (brief §2.3)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def __call__(self, h, ctx, *args):
        h = h + self.self_attn(self.input_layernorm(h), ctx, *args)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftMLX(nn.Module):
    """DFlash v1 draft in MLX: ``fc`` + ``hidden_norm`` context projection, layers, final norm.

    Args:
        cfg: the draft configuration (the same file the torch draft reads).
        window: ``--draft-window N``: keep at most the N most recent context rows per layer
            (positions stay absolute); None keeps all (sliding layers still drop rows that
            their window hides).

    ``draft_vocab``: the draft vocabulary's target ids (numpy [Vd]) set by
    :func:`load_draft_mlx`, or None (:mod:`dflash.models.draft_vocab`).
    """

    draft_vocab = None
    layer_class: type[nn.Module] = DraftLayer
    is_dflash2 = False

    def __init__(self, cfg: DraftConfig, window: int | None = None):
        super().__init__()
        self.config = cfg
        self.window = window
        self.fc = nn.Linear(cfg.num_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = [self.layer_class(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._rope = Rope(cfg)

    @property
    def feature_width(self) -> int:
        """F: the width of the concatenated target features the draft expects."""
        return self.config.num_features * self.config.hidden_size

    @staticmethod
    def module_names(state: dict) -> dict:
        """Checkpoint tensor names -> this module's parameter names (the same for v1)."""
        return state

    @staticmethod
    def checkpoint_names(state: dict) -> dict:
        """This module's parameter names -> checkpoint tensor names (the same for v1)."""
        return state

    def new_cache(self) -> DraftCache:
        """An empty context cache for one request (windows per layer applied)."""
        wins = []
        for i in range(len(self.layers)):
            w = self.config.layer_window(i)
            keep = None if w is None else w  # rows older than q - W + 1 are invisible anyway
            if self.window is not None:
                keep = self.window if keep is None else min(keep, self.window)
            wins.append(keep)
        return DraftCache(len(self.layers), wins)

    def _mask_fn(self, q_start: int, length: int):
        cfg = self.config
        q_pos = np.arange(q_start, q_start + length)

        def mask(i: int, first: int, n_ctx: int):
            causal, window = cfg.layer_is_causal(i), cfg.layer_window(i)
            if not causal and window is None:
                return None
            k_pos = np.concatenate([np.arange(first, first + n_ctx), q_pos])
            diff = q_pos[:, None] - k_pos[None, :]
            ok = np.ones(diff.shape, dtype=bool)
            if causal:
                ok &= diff >= 0
            if window is not None:
                ok &= diff < window
                if not causal:
                    ok &= -diff < window
            return mx.array(ok)

        return mask

    def __call__(self, block_embeds: mx.array, target_hidden: mx.array, start: int,
                 cache: DraftCache | None = None) -> mx.array:  # fmt: skip
        """Run the draft over one block.

        Args:
            block_embeds: [B, L, H] target embeddings of [anchor, mask...] at positions start...
            target_hidden: [B, Tc, F] features of new context rows at start - Tc .. start - 1.
            start: absolute position of the anchor.
            cache: context cache (new context K/V are appended), or None (no memory).

        Returns:
            [B, L, H] final-normed hidden states; project with the target LM head.
        """
        lq, tc = block_embeds.shape[1], target_hidden.shape[1]
        ctx = self.hidden_norm(self.fc(target_hidden))
        q_tab = self._rope.tables(start, lq)
        c_tab = self._rope.tables(start - tc, tc)
        mask_fn = self._mask_fn(start, lq)
        h = block_embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx, self._rope, q_tab, c_tab, mask_fn, cache, i, start - tc)
        return self.norm(h)

    def ahead(self, block_embeds: mx.array, target_hidden: mx.array, ctx_start: int,
              valid: mx.array, cache: DraftCache) -> mx.array:  # fmt: skip
        """Run the draft over the block that follows a verify whose acceptance only the device
        knows yet (the pipelined step, :mod:`dflash.backends.mlx_loop`).

        Args:
            block_embeds: [B, L, H] embeddings of [anchor, mask...]; the anchor sits at
                position ``ctx_start + valid``.
            target_hidden: [B, W, F] features of the verify's rows at ctx_start .. ctx_start+W-1,
                of which the first ``valid`` are committed.
            valid: [] int32 on the device, 1 <= valid <= W.
            cache: context cache; all W rows are appended (masked beyond ``valid``); the host
                calls ``cache.drop_tail(W - valid)`` once it has read ``valid``.

        Returns:
            [B, L, H] final-normed hidden states: the same as ``self(block_embeds,
            target_hidden[:, :valid], ctx_start + valid, cache)`` up to summation order.
        """
        lq, w = block_embeds.shape[1], target_hidden.shape[1]
        ctx = self.hidden_norm(self.fc(target_hidden))
        q_pos = ctx_start + valid + mx.arange(lq, dtype=mx.int32)  # [L] on the device
        q_tab = self._rope.tables_at(q_pos)
        c_tab = self._rope.tables(ctx_start, w)
        cfg = self.config

        masks: dict[tuple, mx.array] = {}  # layers alike share one mask

        def mask(i: int, first: int, n_ctx: int) -> mx.array:  # [L, n_ctx + L] bool
            key = (cfg.layer_is_causal(i), cfg.layer_window(i), cache.windows[i], first, n_ctx)
            if key not in masks:
                masks[key] = build(i, first, n_ctx)
            return masks[key]

        def build(i: int, first: int, n_ctx: int) -> mx.array:
            real = n_ctx - w + valid  # context rows in the cache that are committed
            col = mx.arange(n_ctx, dtype=mx.int32)
            ok = col[None] < real  # [1, n_ctx]
            keep = cache.windows[i]
            if keep is not None:  # the host path keeps the last `keep` real rows only
                ok = ok & (col[None] >= real - keep)
            k_pos = mx.concatenate([first + col, q_pos])  # [n_ctx + L]
            diff = q_pos[:, None] - k_pos[None]  # [L, n_ctx + L]
            vis = mx.concatenate(
                [mx.broadcast_to(ok, (lq, n_ctx)), mx.ones((lq, lq), dtype=mx.bool_)], axis=1
            )
            if cfg.layer_is_causal(i):
                vis = vis & (diff >= 0)
            win = cfg.layer_window(i)
            if win is not None:
                vis = vis & (diff < win)
                if not cfg.layer_is_causal(i):
                    vis = vis & (-diff < win)
            return vis

        h = block_embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx, self._rope, q_tab, c_tab, mask, cache, i, ctx_start, w)
        return self.norm(h)


def check_draft_options(bits: int | None, window: int | None) -> None:
    """Raise InputError unless bits is None/4/8 and window is None or >= 1 (before any load)."""
    if bits not in (None, 4, 8):
        raise InputError(f"--draft-bits must be 4 or 8, got {bits}.")
    if window is not None and window < 1:
        raise InputError(f"--draft-window must be >= 1 token, got {window}.")


def load_draft_mlx(folder: str | Path, *, dtype=mx.float32, bits: int | None = None,
                   window: int | None = None, group_size: int = 64,
                   model_class: type[DFlashDraftMLX] | None = None) -> DFlashDraftMLX:  # fmt: skip
    """Load a draft folder (config.json + safetensors, sharded or not) as an MLX module.

    Args:
        folder: the draft folder (the same one the torch backend reads).
        dtype: parameter dtype (mx.float32, mx.bfloat16, mx.float16).
        bits: 4 or 8 quantizes the linear layers at load (``--draft-bits``, group size 64);
            layers whose input width is not a multiple of the group size stay unquantized.
        window: ``--draft-window`` (see :class:`DFlashDraftMLX`).
        model_class: the module class (:class:`DFlashDraftMLX`, or the DFlash2 class that
            :func:`dflash.models.draft2_mlx.load_any_draft_mlx` picks from the config).

    Raises:
        CheckpointError: no weights, an unreadable file, missing/unexpected tensors, or a bad
            ``draft_vocab.json``.
        ConfigError: an invalid config, a draft of the other architecture than ``model_class``,
            or an fc width that does not fit it.
        InputError: bits not in (4, 8) or a window < 1.
    """
    check_draft_options(bits, window)
    folder = Path(folder)
    cfg = DraftConfig.load(folder)
    cls = model_class or DFlashDraftMLX
    if cfg.is_dflash2 != cls.is_dflash2:
        have, want = ("DFlash2", "DFlash v1") if cfg.is_dflash2 else ("DFlash v1", "DFlash2")
        raise ConfigError(f"{folder} is a {have} draft, not a {want} draft.",
                          hint="load it with dflash.models.draft2_mlx.load_any_draft_mlx")  # fmt: skip
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"No .safetensors weights in draft folder {folder}.",
                              hint="a draft folder needs config.json and model.safetensors")  # fmt: skip
    state: dict[str, mx.array] = {}
    for f in files:
        try:
            state.update(mx.load(str(f)))
        except (RuntimeError, ValueError, OSError) as e:
            raise CheckpointError(f"Cannot read draft weights {f.name}: {e}.") from e
    state = cls.module_names(state)
    width = cfg.num_features * cfg.hidden_size
    fc = state.get("fc.weight")
    if fc is not None and tuple(fc.shape) != (cfg.hidden_size, width):
        raise ConfigError(f"Draft fc.weight has shape {tuple(fc.shape)} but len(target_layer_ids) x "
                          f"hidden_size needs ({cfg.hidden_size}, {width}).",
                          hint="the weights and config.json belong to different drafts")  # fmt: skip
    model = cls(cfg, window=window)
    expected = {k for k, _ in tree_flatten(model.parameters())}
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise CheckpointError(f"Draft weights in {folder} do not match its config: "
                              f"{len(missing)} missing (e.g. {sorted(missing)[:2]}), "
                              f"{len(unexpected)} unexpected (e.g. {sorted(unexpected)[:2]}).")  # fmt: skip
    model.load_weights([(k, v.astype(dtype)) for k, v in state.items()])
    if bits is not None:
        nn.quantize(model, group_size=group_size, bits=bits,
                    class_predicate=lambda _p, m: isinstance(m, nn.Linear)
                    and m.weight.shape[-1] % group_size == 0)  # fmt: skip
    mx.eval(model.parameters())
    vocab = load_draft_vocab(folder, cfg.vocab_size)  # dflash.models.draft_vocab
    model.draft_vocab = None if vocab is None else np.array(vocab, dtype=np.int64)  # not a child
    return model


def random_draft_mlx(cfg: DraftConfig, seed: int = 0, std: float = 0.02) -> DFlashDraftMLX:
    """An untrained draft: linear weights ~ N(0, std), norm scales 1 (as ``dflash init-draft``)."""
    model = DFlashDraftMLX(cfg)
    keys = mx.random.split(mx.random.key(seed), len(tree_flatten(model.parameters())))
    new = []
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        if name.endswith("norm.weight"):
            new.append((name, mx.ones(p.shape)))
        else:
            new.append((name, std * mx.random.normal(p.shape, key=keys[i])))
    model.load_weights(new)
    mx.eval(model.parameters())
    return model


def save_draft_mlx(model: DFlashDraftMLX, folder: str | Path, dtype: str = "bfloat16") -> Path:
    """Write config.json + model.safetensors in the layout the torch draft reads (brief §1.2).

    Raises:
        InputError: a quantized draft (save the unquantized one) or an unknown dtype.
    """
    if dtype not in DTYPES:
        raise InputError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    weights = model.checkpoint_names(dict(tree_flatten(model.parameters())))
    if any(k.endswith(".scales") for k in weights):
        raise InputError("A quantized draft cannot be saved as a DFlash checkpoint.")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    model.config.extra["dtype"] = dtype
    model.config.save(out)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: v.astype(DTYPES[dtype]) for k, v in weights.items()},
                        metadata={"format": "pt"})  # fmt: skip
    return out
