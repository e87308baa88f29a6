"""The DFlash v1 draft model in PyTorch (paper §4.2 and appendix A.3; brief §2).

A stack of pre-norm Qwen3 decoder layers whose queries come only from the block
``[anchor, mask x (L-1)]`` while keys/values are the projected target context features
followed by the block. The draft owns no embedding and no LM head: it borrows the target's.
The same ``forward`` serves inference (with a :class:`DraftCache`) and training (explicit masks).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash.errors import CheckpointError, ConfigError
from dflash.models.config import DraftConfig
from dflash.models.draft_vocab import load_draft_vocab, save_draft_vocab
from dflash.models.safetensors_io import SHARD_BYTES, read_safetensors, write_shards

try:  # FlexAttention (torch >= 2.5) serves training with a sparse block mask
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask = flex_attention = None
_FLEX_COMPILED = None


def flex_attention_fn(device: torch.device):
    """flex_attention, compiled once on CUDA (eager flex is a slow reference), eager on CPU.

    The compiled kernel takes every size as a symbol (``dynamic=True``, no duck sizing), so the
    varying training shapes (sequences, width, anchors per batch) reuse one compile instead of
    recompiling on a new shape. Sizes of 1 still specialise: training keeps batch rows and query tiles >= 2 (``Trainer._batch``).
    """
    global _FLEX_COMPILED
    if device.type != "cuda":
        return flex_attention
    if _FLEX_COMPILED is None:
        _FLEX_COMPILED = _no_duck_sizing(torch.compile(flex_attention, dynamic=True))
    return _FLEX_COMPILED


def _no_duck_sizing(fn):
    """Call ``fn`` with duck sizing off: two sizes equal at the first compile (say 2 rows and 2
    query tiles) would otherwise be assumed equal forever, and recompile when they differ."""
    try:
        import torch.fx.experimental._config as fx_config
    except ImportError:  # pragma: no cover - private module; duck sizing then stays on
        return fn
    if not hasattr(fx_config, "use_duck_shape"):  # pragma: no cover
        return fn

    def call(*args, **kwargs):
        with fx_config.patch(use_duck_shape=False):
            return fn(*args, **kwargs)

    return call


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: DraftConfig) -> tuple[torch.Tensor, float]:
    """Inverse RoPE frequencies [D/2] float32 and the attention scaling for the draft's rope.

    Default rope is computed here; scaled variants (linear, yarn, llama3, ...) use transformers'
    rope initialisers so they match the target family exactly.
    """
    rope_type = cfg.rope.get("rope_type") or cfg.rope.get("type") or "default"
    theta = float(cfg.rope.get("rope_theta", 10000.0))
    if rope_type == "default":
        exps = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
        return 1.0 / (theta**exps), 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = Qwen3Config(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={**cfg.rope, "rope_type": rope_type, "rope_theta": theta},
    )
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, None)
    return inv.float(), float(scale)


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype):
    """cos, sin tables [B, 1, T, D] for absolute positions pos [B, T] (computed in float32)."""
    freqs = pos[..., None].float() * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] with cos/sin [B, 1, T, D] (half-split convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DraftCache:
    """Per-layer K/V of the context rows the draft has seen (never block rows).

    Context K/V are already k-normed and rotated, so they are appended once and reused in
    every later round (brief §2.3 step 5). ``length`` is the number of cached context rows;
    ``positions`` [1, length] int64 holds their absolute positions (used by window masks).

    Args:
        num_layers: draft layers.
        window: ``--draft-window N``: keep only the N most recent context rows (the draft then
            attends to at most N context rows; positions stay absolute); None keeps all.
    """

    def __init__(self, num_layers: int, window: int | None = None):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None
        self.window = window

    @property
    def length(self) -> int:
        return 0 if self.positions is None else int(self.positions.shape[-1])

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [B, Hkv, T, D] to layer i; returns the layer's cached K/V (the last
        ``window`` rows when a window is set)."""
        if self.keys[i] is not None:
            k = torch.cat((self.keys[i], k), dim=2)
            v = torch.cat((self.values[i], v), dim=2)
        if self.window is not None and k.shape[2] > self.window:
            k, v = k[:, :, -self.window :], v[:, :, -self.window :]
        self.keys[i], self.values[i] = k, v
        return k, v

    def reset(self) -> None:
        """Forget every context row (start of a new request)."""
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)
        self.positions = None


def extend_positions(cache, ctx_pos: torch.Tensor) -> torch.Tensor:
    """A context cache's row positions [1, length'] once rows at ``ctx_pos`` [1, Tc] are added:
    the last ``window`` of them for a :class:`DraftCache` with a window (static caches keep no
    positions: ``ctx_pos``)."""
    pos = ctx_pos if cache.positions is None else torch.cat((cache.positions, ctx_pos), 1)
    window = getattr(cache, "window", None)
    return pos if window is None else pos[:, -window:]


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

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)  # [B, n, T, D]

    def key_values(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """K (k-normed, rotated by the (cos, sin) tables ``rope``) and V [B, Hkv, T, D] of the
        rows x [B, T, H]."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.kv_heads)), *rope)
        return k, self._heads(self.v_proj(x), self.kv_heads)

    def forward(self, x, ctx, q_rope, ctx_rope, mask, cache: DraftCache | None, idx: int):
        """x [B, Lq, H] normed block states; ctx [B, Tc, H] projected context (Tc may be 0).

        q_rope and ctx_rope are (cos, sin) tables of the block and context positions
        (see :func:`rope_cos_sin`); mask is a bool
        [B or 1, 1, Lq, Tk] (True = may attend), a FlexAttention BlockMask of the same
        shape (training), or None for full visibility.
        Returns [B, Lq, H].
        """
        b, lq, _ = x.shape
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.heads)), *q_rope)
        kb, vb = self.key_values(x, q_rope)
        kc, vc = self.key_values(ctx, ctx_rope)
        if cache is not None:
            kc, vc = cache.append(idx, kc, vc)
        k = torch.cat((kc, kb), dim=2)  # [B, Hkv, Tk, D]
        v = torch.cat((vc, vb), dim=2)
        if q.dtype != v.dtype:  # under autocast the normed q/k are float32, v is not
            q, k = q.to(v.dtype), k.to(v.dtype)
        if BlockMask is not None and isinstance(mask, BlockMask):  # training on CUDA
            out = flex_attention_fn(q.device)(q, k, v, block_mask=mask,
                                              enable_gqa=self.heads != self.kv_heads)  # fmt: skip
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads
            )  # [B, H, Lq, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, lq, self.heads * self.head_dim))


class DraftMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer with context K/V injection (brief §2.3)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def forward(self, h, ctx, q_rope, ctx_rope, mask, cache, idx):
        h = h + self.self_attn(self.input_layernorm(h), ctx, q_rope, ctx_rope, mask, cache, idx)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    """DFlash v1 draft: ``fc`` + ``hidden_norm`` context projection, decoder layers, final norm.

    Parameter names match the published safetensors layout (brief §1.2).

    Args:
        cfg: the draft configuration.
    """

    layer_class: type[nn.Module] = DraftLayer
    is_dflash2 = False

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self._inv_freq_f32 = inv_freq  # master copy: RoPE tables stay float32 in every dtype
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.draft_vocab: list[int] | None = None  # draft_vocab.json (dflash.models.draft_vocab)
        self.context_window: int | None = None  # --draft-window: context rows attended, at most

    def _apply(self, fn, recurse=True):
        """``.to()``/``.half()``/``.bfloat16()`` move the RoPE frequencies but keep them float32
        (training, HF and upstream compute RoPE in float32; a bf16 table is wrong by whole
        radians at a few thousand positions)."""
        out = super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq_f32.to(self.inv_freq.device)
        return out

    @property
    def feature_width(self) -> int:
        """F: the width of the concatenated target features the draft expects."""
        return self.fc.in_features

    def new_cache(self) -> DraftCache:
        """An empty context cache for one request (``context_window`` rows at most)."""
        return DraftCache(len(self.layers), self.context_window)

    def forward(
        self,
        block_embeds: torch.Tensor,
        target_hidden: torch.Tensor,
        q_pos: torch.Tensor,
        ctx_pos: torch.Tensor,
        cache: DraftCache | None = None,
        masks: dict[str, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Run the draft over one or more blocks.

        Args:
            block_embeds: [B, Lq, H] target embeddings of the block tokens (anchor, masks...).
            target_hidden: [B, Tc, F] concatenated target features of new context rows.
            q_pos: [B, Lq] int64 absolute positions of the block tokens.
            ctx_pos: [B, Tc] int64 absolute positions of the context rows.
            cache: inference cache; new context K/V are appended to it. None in training.
            masks: per layer type ("full_attention", "sliding_attention") a bool mask
                [B or 1, 1, Lq, Tk] (True = attend) or a FlexAttention BlockMask of that
                shape, Tk = cached + new context + Lq. When None,
                masks are derived from positions (inference; brief §2.5).

        Returns:
            [B, Lq, H] final-normed hidden states; project with the target LM head.
        """
        return self._forward(block_embeds, target_hidden, q_pos, ctx_pos, cache, masks)

    def _forward(self, block_embeds, target_hidden, q_pos, ctx_pos, cache, masks, *layer_args):
        """The body of :meth:`forward`; ``layer_args`` go to every layer after its own arguments
        (DFlash2: the rows per packed block)."""
        ctx = self.hidden_norm(self.fc(target_hidden))  # [B, Tc, H]
        if cache is not None:
            new_pos = extend_positions(cache, ctx_pos)
        if masks is None:
            k_ctx = new_pos if cache is not None else ctx_pos
            masks = self.inference_masks(q_pos, torch.cat((k_ctx, q_pos), dim=1))
        dt = block_embeds.dtype
        q_rope = rope_cos_sin(q_pos, self.inv_freq, self.rope_scale, dt)  # once, shared by layers
        ctx_rope = rope_cos_sin(ctx_pos, self.inv_freq, self.rope_scale, dt)
        h = block_embeds
        for i, layer in enumerate(self.layers):
            h = layer(
                h, ctx, q_rope, ctx_rope, masks[self.config.layer_types[i]], cache, i, *layer_args
            )
        if cache is not None:
            cache.positions = new_pos
        return self.norm(h)

    @torch.no_grad()
    def write_context(self, target_hidden: torch.Tensor, ctx_pos: torch.Tensor, cache) -> None:
        """Append the context K/V of ``target_hidden`` to ``cache`` without running a block.

        The draft's context keys/values depend on the target features only (projected by
        ``fc``, normed, then each layer's k/v projections; paper §3, brief §2.3), so a prompt's
        rows can be written once at prefill; the next :meth:`forward` then only needs the
        rows committed since. The same K/V as :meth:`forward` writes for those rows.

        Args:
            target_hidden: [B, Tc, F] concatenated target features of the rows.
            ctx_pos: [B, Tc] int64 absolute positions of the rows.
            cache: a :class:`DraftCache`, or a static cache with ``append(i, k, v)`` whose
                write positions the caller has set.
        """
        ctx = self.hidden_norm(self.fc(target_hidden))  # [B, Tc, H]
        rope = rope_cos_sin(ctx_pos, self.inv_freq, self.rope_scale, ctx.dtype)
        for i, layer in enumerate(self.layers):
            cache.append(i, *layer.self_attn.key_values(ctx, rope))  # [B, Hkv, Tc, D] each
        if isinstance(cache, DraftCache):
            cache.positions = extend_positions(cache, ctx_pos)

    def inference_masks(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> dict:
        """Masks from absolute positions: causal and/or windowed per layer type (brief §2.5).

        Args:
            q_pos: [B, Lq] query positions; k_pos: [B, Tk] key positions.

        Returns:
            dict layer type -> bool [B, 1, Lq, Tk] mask or None (everything visible).
        """
        out: dict[str, torch.Tensor | None] = {}
        for i, kind in enumerate(self.config.layer_types):
            causal, window = self.config.layer_is_causal(i), self.config.layer_window(i)
            if kind in out:
                continue
            if not causal and window is None:
                out[kind] = None
                continue
            diff = q_pos[:, :, None] - k_pos[:, None, :]  # [B, Lq, Tk] q - k
            ok = torch.ones_like(diff, dtype=torch.bool)
            if causal:
                ok &= diff >= 0
            if window is not None:
                ok &= diff < window
                if not causal:
                    ok &= -diff < window
            out[kind] = ok[:, None]
        return out

    # ------------------------------------------------------------------ checkpoints
    def save(self, folder: str | Path, max_shard_bytes: int = SHARD_BYTES) -> Path:
        """Write config.json and safetensors shards of at most ``max_shard_bytes`` each.

        One shard is named ``model.safetensors``; several are ``model-0000i-of-0000n``
        with a ``model.safetensors.index.json`` (the HF layout). Every file gets the mode the
        umask gives (0644 typically), the weights as well as config.json.
        """
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        self.config.save(out)
        state = self.checkpoint_names(self.state_dict())
        # Copies: weights may be views of one fused tensor (static path), which safetensors refuses.
        tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
        if self.draft_vocab is not None:
            save_draft_vocab(out, self.draft_vocab)
        write_shards(tensors, out, max_shard_bytes)
        return out

    @staticmethod
    def checkpoint_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Module state dict -> tensor names as published (identity for v1)."""
        return state

    @staticmethod
    def module_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Published tensor names -> module state dict names (identity for v1)."""
        return state

    @classmethod
    def load(
        cls, folder: str | Path, dtype: torch.dtype | None = None, device="cpu"
    ) -> DFlashDraft:
        """Load a draft folder (config.json + safetensors, sharded or not).

        The folder must hold this class's architecture (v1 or DFlash2);
        :func:`dflash.models.draft_load.load_draft` picks the class from ``architectures``.

        Raises:
            CheckpointError: no weights, an unreadable shard, missing/unexpected tensors, or a
                bad ``draft_vocab.json`` (kept as ``draft_vocab``, :mod:`dflash.models.draft_vocab`).
            ConfigError: an invalid config, or a v1 config given to a DFlash2 class.
        """
        folder = Path(folder)
        cfg = DraftConfig.load(folder)
        if cfg.is_dflash2 != getattr(cls, "is_dflash2", False):
            kind = (
                "a DFlash2 draft, not a DFlash v1"
                if cfg.is_dflash2
                else "a DFlash v1 draft, not a DFlash2"
            )
            raise ConfigError(f"Draft {folder} is {kind} draft.",
                              hint="load it with dflash.models.draft_load.load_draft, which picks the class")  # fmt: skip
        state = cls.module_names(read_safetensors(folder))
        fc = state.get("fc.weight")
        width = cfg.num_features * cfg.hidden_size
        if fc is not None and tuple(fc.shape) != (cfg.hidden_size, width):
            raise ConfigError(
                f"Draft fc.weight has shape {tuple(fc.shape)} but len(target_layer_ids) x "
                f"hidden_size needs ({cfg.hidden_size}, {width}).",
                hint="the weights and config.json belong to different drafts",
            )
        with torch.device("meta"):
            model = cls(cfg)
        expected = set(model.state_dict().keys())
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise CheckpointError(
                f"Draft weights in {folder} do not match its config: "
                f"{len(missing)} missing (e.g. {sorted(missing)[:2]}), "
                f"{len(unexpected)} unexpected (e.g. {sorted(unexpected)[:2]})."
            )
        model.load_state_dict(state, assign=True)
        inv_freq, model.rope_scale = rope_inv_freq(cfg)
        model._inv_freq_f32, model.inv_freq = inv_freq, inv_freq
        model.draft_vocab = load_draft_vocab(folder, cfg.vocab_size)
        return model.to(device=device, dtype=dtype)  # inv_freq stays float32 (see _apply)
