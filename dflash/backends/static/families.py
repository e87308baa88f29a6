"""Static (CUDA-graph) target forwards of gpt-oss, Gemma 3 and Gemma 4 text targets.

These families differ from the Llama-like layout :func:`~dflash.backends.static.fused.target_forward_fused`
runs, so their forward is written here, over the HF model's own modules (norms, projections, MLPs,
embeddings: their maths is transformers' by construction), with the KV cache in position-indexed
buffers as for the other families (a sliding window is a position mask; rollback is free):

- gpt-oss: attention sinks (a per-head logit in each softmax's denominator, with no value),
  alternating sliding (128) and full layers, its expert blocks
  (:func:`~dflash.backends.static.moe.gpt_oss_forward`);
- Gemma 3: scaled embeddings (the embedding module's sqrt(hidden) in the weights' dtype), the
  (1 + w) RMSNorms (the modules), q/k norms, the query pre-attention scalar (the module's
  ``scaling``), local/global RoPE bases (one table per layer type), pre/post feed-forward norms,
  final logit soft-capping;
- Gemma 4: as Gemma 3, plus per-layer head dims and KV heads (the global layers' ``global_head_dim``),
  ``attention_k_eq_v`` (v from the raw k projection), the v norm, per-layer inputs, the layer
  scalar, layers that reuse an earlier layer's K/V (``num_kv_shared_layers``: they read that
  layer's buffers), and the expert branch beside the dense MLP
  (:func:`~dflash.backends.static.moe.gemma4_moe_forward`).

Transformers 5.17 and 5.25 agree on every piece used here (checked side by side). Attention
runs the split-KV kernel (:func:`~dflash.kernels.split_attention.split_attention`, with windows
and sinks) where the backend's ``attention`` mode takes it and the head dim is a power of two
up to :data:`KERNEL_MAX_HEAD_DIM` (Gemma 4's global 512 included); else SDPA with the position
mask, or, with sinks, the softmax over the scores and the sink column written out (float32), as
transformers' eager attention. On CUDA in bf16 a layer launches about as many kernels as a
dense Qwen3 layer (docs/cuda-path.md): the projections as ``small_linear`` (Gemma's GELU-tanh
in the gate+up kernel), q/k (/v) norms + RoPE + cache writes as one ``rope_cache`` /
``rope_cache_family`` kernel, Gemma's sandwich norms with their residual adds as ``add_norm``,
the expert blocks' router and slot sum as ``moe_topk`` / ``moe_combine`` (the ``fused`` route).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dflash.backends.static.family_checks import (  # noqa: F401  (family_refusal, FAMILY_TYPES re-exported)
    FAMILY_TYPES,
    family_refusal,
    family_type,
)
from dflash.backends.static.fused import (
    _in_proj,
    _in_proj_joint,
    _out_proj,
    _plain,
    fusable,
    fuse_linears,
    realized,
)
from dflash.backends.static.moe import (
    gemma4_moe_forward,
    gpt_oss_forward,
    kernel_act,
)
from dflash.kernels.add_norm import add_norm, add_norm_fits
from dflash.kernels.rms_norm import MAX_HEAD_ROWS, MAX_HIDDEN, ONE_PLUS, ROUND_ONCE, rms_norm
from dflash.kernels.rms_norm import MAX_ROWS as NORM_MAX_ROWS
from dflash.kernels.rms_norm import available as rms_norm_available
from dflash.kernels.rope_cache import norm_eps, rope_cache, rope_cache_family, rope_cache_fits
from dflash.kernels.small_linear import MAX_ROWS as LINEAR_MAX_ROWS
from dflash.kernels.small_linear import linear_mode, small_linear, small_linear_glu
from dflash.kernels.split_attention import split_attention, uses_kernel
from dflash.models.draft_torch import rope_cos_sin

KERNEL_MAX_HEAD_DIM = 512  # Gemma 4's global layers' 512 included; larger heads attend through SDPA


@dataclass
class LayerSpec:
    """One target layer's attention layout.

    Attributes:
        heads, kv_heads, head_dim: query heads, K/V heads and head dim of this layer.
        window: sliding window W (tokens; keys at positions > pos - W seen) or None (full).
        rope: the layer type whose RoPE table it uses (None: the model's one table).
        scale: the softmax scale (the module's ``scaling``).
        src: the layer whose K/V buffers it reads (itself, or the layer it shares K/V with).
        sinks: [H] attention-sink logits (gpt-oss) or None.
        qkv: the layer's q, k and v projections as one matmul (k and v only where the layer
            owns its K/V, v only where it has a v_proj;
            :func:`~dflash.backends.static.fused.fuse_linears`), or None.
        gate_up: Gemma's dense MLP's gate and up projections as one matmul, or None.
        sinks_log2: ``sinks`` in float32 times log2(e), for the split-KV kernel (made when the
            backend's kernels are configured).
    """

    heads: int
    kv_heads: int
    head_dim: int
    window: int | None
    rope: str | None
    scale: float
    src: int
    sinks: torch.Tensor | None = None
    qkv: Any = None
    gate_up: Any = None
    sinks_log2: torch.Tensor | None = None


def layer_specs(target: Any) -> list[LayerSpec]:
    """Per target layer its :class:`LayerSpec` (the caller checked :func:`family_refusal`)."""
    cfg, family = target.config, family_type(target)
    kinds = list(cfg.layer_types)
    heads = cfg.num_attention_heads
    shared_from = (
        len(kinds) - int(getattr(cfg, "num_kv_shared_layers", 0) or 0)
        if family == "gemma4_text"
        else len(kinds)
    )
    specs = []
    for i, layer in enumerate(target.model.layers):
        a, kind = layer.self_attn, kinds[i]
        src = i
        if i >= shared_from:  # reuses the K/V of the last earlier layer of its kind
            src = max(j for j in range(shared_from) if kinds[j] == kind)
        owner = target.model.layers[src].self_attn
        hd = int(a.head_dim)
        projs = [a.q_proj]
        if src == i:
            projs += [a.k_proj] + ([a.v_proj] if getattr(a, "v_proj", None) is not None else [])
        specs.append(LayerSpec(heads=heads, kv_heads=owner.k_proj.out_features // hd, head_dim=hd,
                               window=cfg.sliding_window if kind == "sliding_attention" else None,
                               rope=None if family == "gpt_oss" else kind, scale=float(a.scaling), src=src,
                               sinks=a.sinks if family == "gpt_oss" else None,
                               qkv=fuse_linears(projs) if fusable(*projs) else None,
                               gate_up=_gate_up(layer.mlp) if family != "gpt_oss" else None))  # fmt: skip
    return specs


def _gate_up(mlp) -> Any:
    """A dense Gemma MLP's gate and up projections fused (None where they do not fuse)."""
    parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if (
        any(p is None for p in parts)
        or not callable(getattr(mlp, "act_fn", None))
        or not fusable(*parts[:2])
    ):
        return None
    return fuse_linears(parts[:2])


def _mlp(spec: LayerSpec, mlp, h: torch.Tensor, lin: bool = False, kl=None) -> torch.Tensor:
    """down(act(gate(h)) * up(h)) for h [1, T, H] with gate and up as one matmul where fused,
    else the module; ``lin``: both projections as :func:`~dflash.kernels.small_linear.small_linear`
    kernels, the activation (SiLU, GELU-tanh) as the gate+up kernel's epilogue where it is one."""
    if spec.gate_up is None:
        return mlp(h)
    act = kernel_act(mlp.act_fn) if lin else None
    if act is not None:
        a = small_linear_glu(h[0], spec.gate_up.weight, spec.gate_up.bias, kl, act)[None]
    else:
        g, u = _in_proj(lin, spec.gate_up, h, kl)
        a = mlp.act_fn(g) * u
    return _proj(lin, mlp.down_proj, a, kl)


def _proj(lin: bool, proj, h: torch.Tensor, kl) -> torch.Tensor:
    """proj(h) for [1, T, in] activations (no residual): one small_linear kernel when ``lin``."""
    if lin:
        return small_linear(h[0], proj.weight, proj.bias, launch=kl)[None]
    return proj(h)


def allocate(specs: list[LayerSpec], capacity: int, dtype, device) -> tuple[list, list]:
    """K and V buffers [1, Hkv_i, S, D_i] per layer (a layer sharing K/V gets its source's)."""
    ks, vs = [], []
    for i, s in enumerate(specs):
        if s.src != i:
            ks.append(ks[s.src])
            vs.append(vs[s.src])
            continue
        shape = (1, s.kv_heads, capacity, s.head_dim)
        ks.append(torch.zeros(shape, dtype=dtype, device=device))
        vs.append(torch.zeros(shape, dtype=dtype, device=device))
    return ks, vs


def _projections_fit(spec: LayerSpec, layer, dtype: torch.dtype) -> bool:
    """Whether a layer's fused qkv, and a dense Gemma MLP's fused gate+up and down_proj, are
    plain row-major linears of ``dtype`` (what small_linear takes)."""
    if spec.qkv is not None and (spec.qkv.weight.dtype != dtype or spec.qkv.weight.stride(-1) != 1):
        return False
    if spec.gate_up is None:
        return True
    w = spec.gate_up.weight
    return w.dtype == dtype and w.stride(-1) == 1 and _plain(layer.mlp.down_proj, dtype)


def _norms(target) -> list:
    """The target's RMSNorm modules with a weight (the per-layer, head and final norms)."""
    return [m for m in target.modules() if type(m).__name__.endswith("RMSNorm") and isinstance(
        getattr(m, "weight", None), torch.Tensor)]  # fmt: skip


def configure_family(be, settings) -> None:
    """The kernels a family forward runs (the backend's ``configure`` calls it after its own
    choices): ``norm_kernel``, the norms as :func:`~dflash.kernels.rms_norm.rms_norm` (bf16/fp16
    on CUDA: gpt-oss's and Gemma 4's rounding once, Gemma 3's (1 + w)); ``target_rope``
    (gpt-oss, where the split-KV kernel runs): RoPE and the K/V cache writes as
    :func:`~dflash.kernels.rope_cache.rope_cache`; ``linear``: the projections as
    :func:`~dflash.kernels.small_linear.small_linear` kernels in forwards of up to 32 rows, as the
    dense path's (o_proj, with gpt-oss's residual add; under ``auto``/``all`` the fused qkv and
    Gemma's gate+up, its GELU-tanh as the epilogue, and down_proj too). All are rungs of the
    fall-back ladder."""
    target, dtype = be.target, be.dtype
    be.norm_kernel = bool(settings.norm_kernel and be.device.type == "cuda" and rms_norm_available()
                          and dtype in (torch.bfloat16, torch.float16)
                          and all(m.weight.dim() == 1 and m.weight.numel() <= MAX_HIDDEN and m.weight.stride(0) == 1
                                  for m in _norms(target)))  # fmt: skip
    layers = target.model.layers
    if all(_plain(layer.self_attn.o_proj, dtype) and _projections_fit(spec, layer, dtype)
           for spec, layer in zip(be.family, layers, strict=True)):  # fmt: skip
        be.linear = linear_mode(settings.linear, be.device)
    for spec in be.family:
        spec.sinks_log2 = (
            None if spec.sinks is None else spec.sinks.detach().float() * math.log2(math.e)
        )
    be.family_ones = {d: torch.ones(d, device=be.device) for d in {s.head_dim for s in be.family}}
    attn = target.model.layers[0].self_attn
    if family_type(target) == "gpt_oss":
        fits = rope_cache_fits(attn, dtype, norms=False)
    else:  # Gemma: the owners of K/V rows, with their head norms
        fits = all(_gemma_rope_fits(layer.self_attn, spec, dtype)
                   for i, (spec, layer) in enumerate(zip(be.family, target.model.layers, strict=True)) if spec.src == i)  # fmt: skip
    be.target_rope = bool(settings.rope_target and be.attention != "sdpa" and fits
                          and all(s.qkv is not None for s in be.family))  # fmt: skip


def _gemma_rope_fits(attn, spec: LayerSpec, dtype: torch.dtype) -> bool:
    """Whether :func:`~dflash.kernels.rope_cache.rope_cache_family` runs a Gemma layer: a
    power-of-two head dim of 16 to 512, q/k norms with [D] weights, 16- or 32-bit activations."""
    d = spec.head_dim
    norms = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
    return (16 <= d <= 512 and d & (d - 1) == 0 and dtype in (torch.float32, torch.bfloat16, torch.float16)
            and all(isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.shape == (d,) for m in norms))  # fmt: skip


def _norm(be, norm, x: torch.Tensor, kl, mode: int) -> torch.Tensor:
    """norm(x) for [..., N] rows: the rms_norm kernel (``mode``) where ``be.norm_kernel`` and
    the rows fit, else the module."""
    w = getattr(norm, "weight", None)
    rows = x.numel() // x.shape[-1]
    if (
        w is None and getattr(norm, "with_scale", True) is False and mode == ROUND_ONCE
    ):  # Gemma 4's v norm
        w = be.family_ones.get(x.shape[-1])
    if not be.norm_kernel or w is None or rows > MAX_HEAD_ROWS or x.shape[-1] != w.numel():
        return norm(x)
    flat = x.reshape(rows, x.shape[-1])
    return rms_norm(flat, w, norm_eps(norm), kl.pdl, mode).view(x.shape)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [1, H, T, D] rotated as transformers' ``apply_rotary_pos_emb`` (half-split)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def attend_sinks(q, k, v, mask, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over [q k^T * scale, sink] without the sink's column, times v, in float32 (as
    transformers' eager gpt-oss attention): q [1, H, T, D], k/v [1, Hkv, S, D], mask bool
    [1, 1, T, S], sinks [H] -> [1, H, T, D] in q's dtype."""
    _, h, t, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(1, hkv, h // hkv, t, d)
    s = (qg @ k.float()[:, :, None].transpose(-1, -2)) * scale  # [1, Hkv, G, T, S]
    s = s.masked_fill(~mask[:, :, None], float("-inf"))
    sink = sinks.float().view(1, hkv, h // hkv, 1, 1).expand(1, hkv, h // hkv, t, 1)
    s = torch.cat((s, sink), -1)
    p = torch.softmax(s - s.amax(-1, keepdim=True), -1)[..., :-1]
    return (p @ v.float()[:, :, None]).view(1, h, t, d).to(q.dtype)


def kernel_head(head_dim: int) -> bool:
    """Whether the split-KV kernel takes this head dim: a power of two up to
    :data:`KERNEL_MAX_HEAD_DIM` (its tiles are ``tl.arange(0, D)``)."""
    return 0 < head_dim <= KERNEL_MAX_HEAD_DIM and head_dim & (head_dim - 1) == 0


def _attention(be, spec: LayerSpec, q, pos, masks, split: bool, kl) -> torch.Tensor:
    """The layer's attention over its K/V buffers: q [1, H, T, D] -> [1, H, T, D]."""
    k, v = be.k[spec.src], be.v[spec.src]
    if split and kernel_head(spec.head_dim):
        return split_attention(q, k, v, pos[0], spec.scale, launch=kl, window=spec.window,
                               sinks_log2=spec.sinks_log2)  # fmt: skip
    if spec.sinks is not None:
        return attend_sinks(q, k, v, masks[spec.window], spec.scale, spec.sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=masks[spec.window], scale=spec.scale,
                                          enable_gqa=q.shape[1] != k.shape[1])  # fmt: skip


def _rope_tables(be, pos: torch.Tensor) -> dict:
    """RoPE cos/sin [1, 1, T, D] per layer type (None: the one table), from the target's rotary
    module's buffers, as transformers computes them (float32, then the model's dtype)."""
    rot, out = be.target.model.rotary_emb, {}
    for key in {s.rope for s in be.family}:
        if key is None:
            inv, scale = rot.inv_freq, rot.attention_scaling
        else:
            inv, scale = getattr(rot, f"{key}_inv_freq"), getattr(rot, f"{key}_attention_scaling")
        out[key] = realized(
            *rope_cos_sin(pos, inv.float(), float(scale), be.dtype)
        )  # one buffer each
    return out


def _queries(
    be, i: int, h: torch.Tensor, cos, sin, pos, lin_in: bool, rope: bool, nm, kl
) -> torch.Tensor:
    """Layer i's queries [1, H, T, D] (normed and rotated) from its normed input h [1, T, H],
    writing its K/V rows at ``pos`` where it owns them (a sharing layer reads its source's):
    with ``rope`` (Gemma 3/4) one :func:`~dflash.kernels.rope_cache.rope_cache_family` kernel
    after the fused projection, else torch ops and the norms ``nm``."""
    spec, family = be.family[i], family_type(be.target)
    a, t, hd = be.target.model.layers[i].self_attn, h.shape[1], be.family[i].head_dim
    gemma4 = family == "gemma4_text"
    if rope and spec.src == i and family != "gpt_oss":
        raw = _in_proj_joint(lin_in, spec.qkv, h, kl)  # [T, (H + 2 Hkv) D] (k = v: (H + Hkv) D)
        return rope_cache_family(raw, a.q_norm, a.k_norm, a.v_norm if gemma4 else None, cos, sin, pos[0], be.k[i],
                                 be.v[i], spec.heads, spec.kv_heads, ONE_PLUS if family == "gemma3_text" else ROUND_ONCE,
                                 getattr(a, "v_proj", None) is None, i > 0, kl)  # fmt: skip
    parts = _in_proj(lin_in, spec.qkv, h, kl) if spec.qkv is not None else None  # q (, k (, v))
    q = (parts[0] if parts else a.q_proj(h)).view(1, t, spec.heads, hd)
    if family != "gpt_oss":
        q = nm(a.q_norm, q)
    q = _rotate(q.transpose(1, 2), cos, sin)  # [1, H, T, D]
    if spec.src == i:  # this layer writes its K/V rows (a sharing layer reads its source's)
        kr = (parts[1] if parts else a.k_proj(h)).view(1, t, spec.kv_heads, hd)
        if getattr(a, "v_proj", None) is None:  # attention_k_eq_v: v is the raw k projection
            vr = kr
        else:
            vr = (parts[2] if parts else a.v_proj(h)).view(1, t, spec.kv_heads, hd)
        if family != "gpt_oss":
            kr = nm(a.k_norm, kr)
        if gemma4:
            vr = nm(a.v_norm, vr)  # no weight: a weight of ones in the kernel
        be.k[i].index_copy_(2, pos[0], _rotate(kr.transpose(1, 2), cos, sin))
        be.v[i].index_copy_(2, pos[0], vr.transpose(1, 2))
    return q


def _gemma_rest(be, i: int, o, x, pli, lin: bool, lin_in: bool, kl, nm, mode: int) -> torch.Tensor:
    """A Gemma layer after its attention: o_proj, the sandwich norms and residual adds, the MLP,
    Gemma 4's expert branch, per-layer input and layer scalar; o [1, T, H*D], x [1, T, H] -> x.
    Where the norm kernel runs, each post-norm, its residual add and what follows (the next
    norm; Gemma 4's layer scalar) are one :func:`~dflash.kernels.add_norm.add_norm` launch."""
    layer, spec = be.target.model.layers[i], be.family[i]
    gemma4 = family_type(be.target) == "gemma4_text"
    post, pre, ff = (
        layer.post_attention_layernorm,
        layer.pre_feedforward_layernorm,
        layer.post_feedforward_layernorm,
    )
    out = _proj(lin, layer.self_attn.o_proj, o, kl)
    fuse = (be.norm_kernel and x.shape[1] <= NORM_MAX_ROWS
            and add_norm_fits(x.shape[-1], x.dtype, *(getattr(n, "weight", None) for n in (post, pre, ff))))  # fmt: skip
    if fuse:
        x2, h = add_norm(
            out[0], x[0], post.weight, norm_eps(post), mode, None, pre.weight, norm_eps(pre), kl.pdl
        )
        x, h = x2[None], h[None]
    else:
        x = x + nm(post, out)
        h = nm(pre, x)
    m = _mlp(spec, layer.mlp, h, lin_in, kl)
    if gemma4 and getattr(layer, "enable_moe_block", False):
        m = nm(layer.post_feedforward_layernorm_1, m) + nm(
            layer.post_feedforward_layernorm_2, gemma4_moe_forward(layer, x, be.moe_route)
        )
    scale = getattr(layer, "layer_scalar", None) if gemma4 else None
    if fuse and pli is None and (scale is None or (scale.numel() == 1 and scale.dtype == x.dtype)):
        return add_norm(m[0], x[0], ff.weight, norm_eps(ff), mode, scale, pdl=kl.pdl)[0][None]
    x = x + nm(ff, m)
    if pli is not None:
        g = layer.act_fn(layer.per_layer_input_gate(x)) * pli[:, :, i]
        x = x + nm(layer.post_per_layer_input_norm, layer.per_layer_projection(g))
    if gemma4:
        x = x * layer.layer_scalar
    return x


def family_forward(be, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The static forward of a gpt-oss / Gemma 3 / Gemma 4 target (``be``: a StaticBackend
    whose ``family`` is its :func:`layer_specs`): ids, pos [1, T] -> logits [T, V] (soft-capped
    as the model's ``final_logit_softcapping`` says); writes K/V at ``pos`` and the target's
    features (HF ``hidden_states``, the last one final-normed) at ``pos``."""
    target, family = be.target, family_type(be.target)
    inner, cfg = target.model, target.config
    t = ids.shape[-1]
    kl = be.launch["target"]
    x = inner.embed_tokens(ids)  # [1, T, H]; Gemma: times sqrt(H) in the weights' dtype
    pli = None
    if family == "gemma4_text" and getattr(inner, "hidden_size_per_layer_input", 0):
        pli = inner.project_per_layer_inputs(x, inner.get_per_layer_inputs(ids, x))  # [1, T, L, P]
    # one buffer each under Inductor: the RoPE kernels load the positions and tables before their
    # PDL wait past layer 0 (``early``), which a per-call copy made just before them would race
    (pos,) = realized(pos)
    tables = _rope_tables(be, pos)
    split = uses_kernel(be.attention, t)
    masks = {}
    if not split or not all(kernel_head(s.head_dim) for s in be.family):
        causal = be.key_pos[None, :] <= pos[0, :, None]
        for w in {s.window for s in be.family}:
            masks[w] = (
                causal if w is None else causal & (be.key_pos[None, :] > pos[0, :, None] - w)
            )[None, None]
    slots: list[torch.Tensor] = [None] * len(be.layer_ids)  # type: ignore[list-item]
    n_layers = len(be.family)
    mode = ONE_PLUS if family == "gemma3_text" else ROUND_ONCE
    rope = split and be.target_rope  # RoPE (Gemma: and the q/k/v norms) + K/V writes in one kernel
    lin = (
        t <= LINEAR_MAX_ROWS and be.linear != "torch"
    )  # o_proj (gpt-oss: + residual) as small_linear
    lin_in = lin and be.linear in ("auto", "all")  # the qkv and gate+up projections too (and down)

    def nm(norm, y):
        return _norm(be, norm, y, kl, mode)

    for i, layer in enumerate(inner.layers):
        spec, a = be.family[i], layer.self_attn
        hd = spec.head_dim
        cos, sin = tables[spec.rope]
        h = nm(layer.input_layernorm, x)
        if (
            rope and spec.src == i and family == "gpt_oss"
        ):  # RoPE and the cache writes in one kernel
            raw = _in_proj_joint(lin_in, spec.qkv, h, kl)  # [T, (H + 2 Hkv) D]
            q = rope_cache(raw, None, None, cos, sin, pos[0], be.k[i], be.v[i], 0, spec.heads, spec.kv_heads,
                           i > 0, kl)  # fmt: skip
            o = _attention(be, spec, q, pos, masks, split, kl)
            x = _out_proj(lin, a.o_proj, o.transpose(1, 2).reshape(1, t, spec.heads * hd), x, kl)
            x = gpt_oss_forward(
                layer.mlp, nm(layer.post_attention_layernorm, x), be.moe_route, residual=x
            )
            if i < n_layers - 1:
                for n in be.feature_layers.get(i, ()):
                    slots[n] = x[0]
            continue
        q = _queries(be, i, h, cos, sin, pos, lin_in, rope, nm, kl)
        o = _attention(be, spec, q, pos, masks, split, kl)
        o = o.transpose(1, 2).reshape(1, t, spec.heads * hd)
        if family == "gpt_oss":
            x = _out_proj(lin, a.o_proj, o, x, kl)
            x = gpt_oss_forward(
                layer.mlp, nm(layer.post_attention_layernorm, x), be.moe_route, residual=x
            )
        else:
            x = _gemma_rest(be, i, o, x, pli, lin, lin_in, kl, nm, mode)
        if i < n_layers - 1:
            for n in be.feature_layers.get(i, ()):
                slots[n] = x[0]
    x = nm(inner.norm, x)
    for n in be.feature_layers.get(n_layers - 1, ()):  # HF's hidden_states[N] is final-normed
        slots[n] = x[0]
    if be.layer_ids:
        be.feats.index_copy_(0, pos[0], torch.cat(slots, dim=-1))
    logits = be.lm_head(x)[0]  # [T, V]
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits
