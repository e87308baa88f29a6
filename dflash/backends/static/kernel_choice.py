"""Which kernels the static (CUDA-graph) path's forwards run: :func:`choose_kernels`, the body of
:meth:`StaticBackend.configure <dflash.backends.static.backend.StaticBackend.configure>` (run at
build and after a fall-back), from the resolved
:class:`~dflash.kernels.settings.KernelSettings` and what the target, the draft, the device and
the dtype allow."""

from __future__ import annotations

from typing import Any

from dflash.backends.static.draft import draft_rope_fits, draft_small_linear_fits
from dflash.backends.static.families import configure_family
from dflash.backends.static.fused import fold_norms, norms_fit, small_linear_fits
from dflash.kernels.gdn_norms import norms_fit as hybrid_norms_fit
from dflash.kernels.qkv_rope import qkv_rope_fits, qkv_rope_wanted
from dflash.kernels.rms_norm import available as rms_norm_available
from dflash.kernels.rms_norm import rms_norm_fits
from dflash.kernels.rope_cache import rope_cache_fits
from dflash.kernels.settings import KernelSettings, Launch
from dflash.kernels.small_linear import MAX_ROWS, fuse_norm_auto, linear_mode
from dflash.kernels.split_attention import attention_mode


def _in_proj_rows(mode: str) -> int:
    """Forwards of up to how many rows run the fused qkv and gate+up projections through
    ``small_linear`` under the ``linear`` mode ``mode``:
    :data:`~dflash.kernels.small_linear.MAX_ROWS` under ``auto`` and ``all`` (every width, as
    measured on both the demo pair and Qwen3-8B's shape, see
    :func:`~dflash.kernels.small_linear.linear_mode`), else 0."""
    return MAX_ROWS if mode in ("auto", "all") else 0


def _target_norms(target: Any) -> list:
    """The target's RMSNorm modules that can run as their own kernels: every layer's two and the
    final norm."""
    layers = target.model.layers
    return [
        n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ] + [target.model.norm]


def choose_kernels(be, settings: KernelSettings) -> None:
    """Set on the :class:`~dflash.backends.static.backend.StaticBackend` ``be`` which kernels its
    forwards run under ``settings`` (the attributes :meth:`StaticBackend.configure
    <dflash.backends.static.backend.StaticBackend.configure>` lists)."""
    be.settings = settings
    target, draft, device = be.target, be.draft_model, be.device
    # the fused forwards' attention (target; the draft's all-visible layers when the draft is
    # fused too): split-KV kernel over the filled rows or SDPA with a position mask
    be.attention = attention_mode(settings.attention, device, be.dtype)
    # o_proj/down_proj of the fused forwards for <= 32 rows: one Triton kernel each with the
    # residual add fused in, or torch (see dflash.kernels.small_linear)
    linear = linear_mode(settings.linear, device)
    # (hybrids: torch for now, not yet measured; their forward takes small_linear where allowed)
    be.linear = (
        linear if be.family is None and not be.hybrid and small_linear_fits(target) else "torch"
    )
    be.draft_linear = (
        be.fused_draft is not None and linear != "torch" and draft_small_linear_fits(draft)
    )
    # the fused qkv and gate+up projections too, in forwards of up to linear_in rows (every
    # width under "auto" and "all")
    be.linear_in = _in_proj_rows(be.linear)
    be.draft_linear_in = be.draft_linear and _in_proj_rows(linear) == MAX_ROWS
    # SiLU(gate) * up as the epilogue of those gate+up kernels (SiLU MLPs)
    glu = settings.glu
    be.glu = (
        glu and be.linear_in > 0 and getattr(target.config, "hidden_act", None) in ("silu", "swish")
    )
    be.draft_glu = glu and be.draft_linear_in
    # q/k (norm +) RoPE + cache writes as one kernel (see dflash.kernels.rope_cache)
    split = be.attention != "sdpa"  # the kernel feeds the split-KV attention only
    be.draft_rope = settings.rope_draft and be.draft_linear and split and draft_rope_fits(draft)
    attn = None if be.hybrid else target.model.layers[0].self_attn
    be.target_rope = (not be.hybrid and settings.rope_target and be.linear != "torch" and split
                      and rope_cache_fits(attn, be.dtype, norms=hasattr(attn, "q_norm")))  # fmt: skip
    be.rope_table = settings.rope_table  # the draft's RoPE kernel reads [S, D] tables
    # the qkv projection inside that kernel too (dflash.kernels.qkv_rope)
    be.qkv_rope_target = be.qkv_rope_draft = False
    if be.target_rope and be.linear_in > 0:
        qkvs = [qkv.weight for qkv, _ in be.fused_target]
        norms = hasattr(attn, "q_norm")
        be.qkv_rope_target = qkv_rope_wanted(qkvs, norms, settings.qkv_rope) and all(
            qkv_rope_fits(layer.self_attn, w, norms)
            for layer, w in zip(target.model.layers, qkvs, strict=True)
        )
    if be.draft_rope and be.draft_linear_in:
        qkvs = [qkv.weight for qkv, _ in be.fused_draft]
        be.qkv_rope_draft = qkv_rope_wanted(qkvs, True, settings.qkv_rope) and all(
            qkv_rope_fits(layer.self_attn, w, True)
            for layer, w in zip(draft.layers, qkvs, strict=True)
        )
    # RMSNorms inside the in-projections' kernels, with the norms' weights folded into copies
    # of the projections' weights (fold_norms); None: by size and dtype, and only where every
    # forward's in-projections run small_linear (as measured)

    def fused_norms(model, layers, every_width: bool) -> bool:
        if settings.fuse_norm is not None:
            return settings.fuse_norm and norms_fit(layers, be.dtype)
        return (
            every_width
            and fuse_norm_auto(model.config.hidden_size, be.dtype)
            and norms_fit(layers, be.dtype)
        )

    be.fuse_norm = (
        not be.hybrid
        and be.linear_in > 0
        and fused_norms(target, target.model.layers, be.linear_in >= MAX_ROWS)
    )
    be.draft_fuse_norm = (bool(be.draft_linear_in) and not be.dflash2  # DFlash2: a conv
                          and fused_norms(draft, draft.layers, True))  # after that norm  # fmt: skip
    if not be.fuse_norm:  # the folded weight copies: made once, kept while used
        be.folded_target = None
    elif be.folded_target is None:
        be.folded_target = fold_norms(target.model.layers, be.fused_target)
    if not be.draft_fuse_norm:
        be.folded_draft = None
    elif be.folded_draft is None:
        be.folded_draft = fold_norms(draft.layers, be.fused_draft, ("post",))
    # the target's stand-alone norms through one Triton kernel each
    be.norm_kernel = (settings.norm_kernel and device.type == "cuda" and rms_norm_available() and be.family is None
                      and not be.hybrid and not be.fuse_norm
                      and all(rms_norm_fits(n, be.dtype) for n in _target_norms(target)))  # fmt: skip
    if be.family is not None:  # gpt-oss, Gemma: their norms and RoPE kernels
        configure_family(be, settings)
    # a hybrid's RMSNorms (centred and gated) through one Triton kernel each (bf16/fp16 on CUDA)
    be.hybrid_norms = (
        be.hybrid and settings.norm_kernel and hybrid_norms_fit(target, be.dtype, device)
    )
    # programmatic dependent launch of this project's kernels, per forward
    be.launch = {part: Launch(settings, be.pdl_on(part)) for part in ("target", "draft")}
