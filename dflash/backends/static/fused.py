"""Fused projections for the static path: one QKV matmul and one gate+up matmul per layer.

The static forwards of :mod:`dflash.backends.static.backend` are launch-bound on a GPU (a small
target runs ~600 kernels per forward), so each layer's q/k/v projections become one matmul over
a concatenated weight, and gate/up another; the outputs are split by views. Results match the
unfused forward up to float rounding of the matmul (row-wise identical maths).

Memory: the q/k/v (and gate/up) parameters of the target and the draft are re-pointed at row
slices of the fused tensors (same values, same ``Parameter`` objects), so the HF/eager forwards
- the reference path - keep working unchanged, no weight is stored twice, and an in-place
update of a module's weight (``load_state_dict``, an optimizer step) reaches the fused matmul.
Exception: where the norms run inside the projections (the ``fuse_norm`` setting, :func:`fold_norms`)
the qkv and gate+up weights with the norms' weights folded in are copies made when the backend
is built, so a later in-place update does not reach them (build the backend after loading).
Moving a model to another device or dtype after the backend is built is not supported.

The draft's forward is in :mod:`dflash.backends.static.draft`. The kernels launch as the
backend's :class:`~dflash.kernels.settings.Launch` of each forward says (``be.launch``: the
settings and PDL).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash.backends.static.moe import moe_block, moe_forward
from dflash.kernels.qkv_rope import qkv_rope
from dflash.kernels.rms_norm import MAX_ROWS as NORM_MAX_ROWS
from dflash.kernels.rms_norm import rms_norm
from dflash.kernels.rope_cache import norm_eps, rope_cache
from dflash.kernels.settings import Launch
from dflash.kernels.small_linear import MAX_ROWS as LINEAR_MAX_ROWS
from dflash.kernels.small_linear import (
    fold_norm_weight,
    small_linear,
    small_linear_glu,
    small_linear_rn,
)
from dflash.kernels.split_attention import split_attention, uses_kernel
from dflash.models.draft_torch import rope_cos_sin


def attend(q, k, v, mask, scale: float | None) -> torch.Tensor:
    """SDPA of q [1, H, T, D] over k, v [1, Hkv, S, D] with a bool mask -> [1, H, T, D]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@dataclass
class FusedLinear:
    """One matmul standing for several linears over the same input.

    Attributes:
        weight: [sum(out_i), in] concatenated weights.
        bias: [sum(out_i)] concatenated biases (zeros for a part without bias), or None.
        sizes: out_i of each part, in order (for ``torch.split``).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., in] -> one tensor [..., out_i] per part (views of one matmul's output)."""
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def fusable(*linears) -> bool:
    """Whether these modules can be fused: plain dense 2-D weights of one dtype/device/input width."""
    ws = [getattr(m, "weight", None) for m in linears]
    if any(not isinstance(w, torch.Tensor) or w.dim() != 2 for w in ws):
        return False
    if any(type(m).forward is not torch.nn.Linear.forward for m in linears):
        return False  # quantized or otherwise custom linears
    return len({(w.dtype, w.device, w.shape[1]) for w in ws}) == 1


def fuse_linears(linears) -> FusedLinear:
    """Concatenate ``linears`` (nn.Linear over the same input) into one :class:`FusedLinear`.

    The modules' weights/biases become row views of the fused tensors (same values, no second
    copy; the modules keep working). A part without bias gets zeros in the fused bias.
    """
    sizes = tuple(int(m.weight.shape[0]) for m in linears)
    prev = getattr(linears[0], "_dflash_fused", None)
    if prev is not None and _still_views(prev, linears):  # a second backend: no second copy
        return prev
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears], 0).contiguous()
        bias = None
        if any(m.bias is not None for m in linears):
            bias = torch.cat([m.bias.detach() if m.bias is not None else
                              weight.new_zeros(n) for m, n in zip(linears, sizes, strict=True)])  # fmt: skip
        off = 0
        for m, n in zip(linears, sizes, strict=True):
            m.weight.data = weight[off : off + n]
            if m.bias is not None:
                m.bias.data = bias[off : off + n]
            off += n
    out = FusedLinear(weight, bias, sizes)
    object.__setattr__(linears[0], "_dflash_fused", out)  # plain attribute, not in state_dict
    return out


def _still_views(fused: FusedLinear, linears) -> bool:
    """Whether the modules' weights/biases are still the row views ``fused`` left them as."""
    if tuple(int(m.weight.shape[0]) for m in linears) != fused.sizes:
        return False
    off = 0
    for m, n in zip(linears, fused.sizes, strict=True):
        if m.weight.data_ptr() != fused.weight[off].data_ptr() or m.weight.shape[1] != fused.weight.shape[1]:
            return False
        if m.bias is not None and (fused.bias is None or m.bias.data_ptr() != fused.bias[off].data_ptr()):
            return False
        off += n
    return True


def dense_mlp(layer) -> bool:
    """Whether a target layer's feed-forward is a dense gate/up/down MLP (else an expert block)."""
    return all(hasattr(layer.mlp, name) for name in ("gate_proj", "up_proj", "down_proj"))


def target_fusable(target) -> bool:
    """Whether every layer of an HF Llama/Qwen2/Qwen3/Mistral/Qwen3-MoE target has plain linears
    to fuse, and a dense MLP or an expert block :func:`~dflash.backends.static.moe.moe_block`
    runs (the static path needs it: :func:`dflash.backends.static.support.supports_static`)."""
    return all(fusable(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
               and (fusable(layer.mlp.gate_proj, layer.mlp.up_proj) if dense_mlp(layer) else moe_block(layer.mlp))
               for layer in target.model.layers)  # fmt: skip


def fuse_target(target) -> list[tuple[FusedLinear, FusedLinear | None]] | None:
    """Per layer (qkv, gate_up) fused projections of the target (gate_up None for an expert
    block), or None when a layer does not fit (:func:`target_fusable`)."""
    layers = target.model.layers
    if not target_fusable(target):
        return None
    return [(fuse_linears((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)),
             fuse_linears((layer.mlp.gate_proj, layer.mlp.up_proj)) if dense_mlp(layer) else None)
            for layer in layers]  # fmt: skip


def fuse_draft(draft) -> list[tuple[FusedLinear, FusedLinear]] | None:
    """Per layer (qkv, gate_up) fused projections of a DFlash v1 draft, or None."""
    for layer in draft.layers:
        a, m = layer.self_attn, layer.mlp
        if not (fusable(a.q_proj, a.k_proj, a.v_proj) and fusable(m.gate_proj, m.up_proj)):
            return None
    return [(fuse_linears((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)),
             fuse_linears((layer.mlp.gate_proj, layer.mlp.up_proj))) for layer in draft.layers]  # fmt: skip


def small_linear_fits(target) -> bool:
    """Whether the fused target forward can run o_proj and down_proj (with their residual adds)
    through :func:`~dflash.kernels.small_linear.small_linear`: dense row-major linears of the
    activations' dtype."""
    return _out_projs_fit(target.model.layers, target.get_input_embeddings().weight.dtype)


def _out_projs_fit(layers, dtype: torch.dtype) -> bool:
    """Every layer's o_proj and (dense MLPs) down_proj is a dense row-major linear of ``dtype``."""
    mods = [m for layer in layers for m in (layer.self_attn.o_proj, getattr(layer.mlp, "down_proj", None))
            if isinstance(m, torch.nn.Module)]  # fmt: skip
    return all(_plain(m, dtype) for m in mods)


def _plain(linear, dtype: torch.dtype) -> bool:
    """A dense row-major linear of ``dtype`` (what small_linear takes)."""
    return fusable(linear) and linear.weight.dtype == dtype and linear.weight.stride(-1) == 1


def row_argmax(logits: torch.Tensor, chunks: int = 64) -> torch.Tensor:
    """``logits.argmax(-1)`` for [R, V] logits in two reductions: the max of each of ``chunks``
    slices of a row, then the first slice holding the row's max. Same index as ``argmax`` (the
    first maximal entry, ties included). Inductor compiles a plain argmax over a few long rows
    into one program per row (~10 us for 16 x 49,152 on the H200); this spreads the first pass
    over R * chunks programs. V not divisible by ``chunks`` falls back to ``argmax``.

    Returns [R] int64.
    """
    rows, vocab = logits.shape
    if vocab % chunks or vocab < 4 * chunks:
        return logits.argmax(-1)
    width = vocab // chunks
    best, where = logits.view(rows, chunks, width).max(-1)  # [R, C]; first max of each slice
    pick = best.argmax(-1, keepdim=True)  # [R, 1] first slice with the row's max
    return pick[:, 0] * width + where.gather(1, pick)[:, 0]


def realized(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors unchanged, made one buffer each when Inductor compiles the forward.

    Inductor passes a custom op (``rope_cache``, ``split_attention``) a tensor computed in the
    graph as a buffer of fixed strides, and when the tensor is still an unrealised expression
    (the RoPE tables, the block's positions) it computes that buffer again for every call: on
    the H200 one or two extra kernels per layer (~1.2 us each), e.g. 5-8 in the demo draft's
    16-wide graph. Inductor's own ``force_stride_order`` prim here makes one buffer that every
    call reads. An identity outside ``torch.compile`` and where this torch lacks the prim."""
    if not torch.compiler.is_compiling():
        return tensors
    try:
        from torch._inductor import inductor_prims  # noqa: F401  (registers the prim)

        force = torch.ops.prims.inductor_force_stride_order
    except (ImportError, AttributeError):  # pragma: no cover - older or newer torch
        return tensors
    return tuple(force(t, t.stride()) for t in tensors)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def _norm(kernel: bool, norm, x: torch.Tensor, kl: Launch) -> torch.Tensor:
    """``norm(x)`` for [1, T, H] activations: :func:`~dflash.kernels.rms_norm.rms_norm` when
    ``kernel`` (the caller checked :func:`~dflash.kernels.rms_norm.rms_norm_fits`), else the module."""
    if kernel:
        return rms_norm(x[0], norm.weight, norm_eps(norm), kl.pdl)[None]
    return norm(x)


def _out_proj(lin: bool, proj, h: torch.Tensor, x: torch.Tensor, kl: Launch) -> torch.Tensor:
    """x + proj(h) for [1, T, *] activations: one small_linear kernel when ``lin``."""
    if lin:
        return small_linear(h[0], proj.weight, proj.bias, residual=x[0], launch=kl)[None]
    return x + proj(h)


def _in_proj_joint(lin: bool, fused: FusedLinear, x: torch.Tensor, kl: Launch) -> torch.Tensor:
    """The fused projection of [1, T, in] activations, unsplit: [T, sum(out_i)]; one
    small_linear kernel when ``lin`` (and T fits)."""
    if lin and x.shape[1] <= LINEAR_MAX_ROWS:
        return small_linear(x[0], fused.weight, fused.bias, launch=kl)
    return F.linear(x[0], fused.weight, fused.bias)


def _in_proj(lin: bool, fused: FusedLinear, x: torch.Tensor, kl: Launch) -> tuple[torch.Tensor, ...]:
    """fused(x) for [1, T, in] activations, one [1, T, out_i] view per part (as
    :func:`_in_proj_joint`; off the kernel the 3-D matmul, fewer eager ops)."""
    if lin and x.shape[1] <= LINEAR_MAX_ROWS:
        return _in_proj_joint(lin, fused, x, kl)[None].split(fused.sizes, dim=-1)
    return fused(x)


def _mlp(lin: bool, lin_in: bool, gate_up: FusedLinear, down, act, h: torch.Tensor, x: torch.Tensor,
         glu: bool, kl: Launch) -> torch.Tensor:  # fmt: skip
    """x + down(act(gate) * up) for the normed [1, T, H] activations ``h``; ``glu`` (the act is
    SiLU): SiLU(gate) * up as the gate+up kernel's epilogue where that runs ``small_linear``."""
    if glu and lin_in and h.shape[1] <= LINEAR_MAX_ROWS:
        return _out_proj(lin, down, small_linear_glu(h[0], gate_up.weight, gate_up.bias, launch=kl)[None], x, kl)
    g, u = _in_proj(lin_in, gate_up, h, kl)
    return _out_proj(lin, down, act(g) * u, x, kl)


def fold_norm(fused: FusedLinear, norm) -> FusedLinear:
    """A copy of ``fused`` with the RMSNorm ``norm``'s weight folded into its weight (per input
    column), for :func:`~dflash.kernels.small_linear.small_linear_rn` (the ``fuse_norm`` setting)."""
    return FusedLinear(fold_norm_weight(fused.weight, norm.weight), fused.bias, fused.sizes)


def fold_norms(layers, fused, which=("input", "post")) -> list[tuple[FusedLinear | None, FusedLinear | None]]:
    """Per layer (qkv with the input norm folded in, gate+up with the post-attention norm), each
    None when ``which`` leaves it out (the draft's qkv also takes un-normed context rows) or
    the layer has no gate+up (an expert block)."""
    return [(fold_norm(qkv, layer.input_layernorm) if "input" in which else None,
             fold_norm(gate_up, layer.post_attention_layernorm) if "post" in which and gate_up is not None else None)
            for layer, (qkv, gate_up) in zip(layers, fused, strict=True)]  # fmt: skip


def _rn(folded: FusedLinear, norm, x: torch.Tensor, kl: Launch, glu: bool = False) -> torch.Tensor:
    """folded's projection of norm(x) for [1, T, H] activations, the norm inside the kernel:
    [T, sum(out_i)] (``glu``: [T, I], SiLU(gate) * up)."""
    return small_linear_rn(x[0], folded.weight, folded.bias, norm_eps(norm), glu, launch=kl)


def _mlp_rn(lin: bool, folded: FusedLinear, down, act, norm, x: torch.Tensor, glu: bool, kl: Launch):
    """x + down(act(gate) * up) of norm(x), the norm inside the gate+up kernel."""
    if glu:
        a = _rn(folded, norm, x, kl, glu=True)
    else:
        g, u = _rn(folded, norm, x, kl).split(folded.sizes, dim=-1)
        a = act(g) * u
    return _out_proj(lin, down, a[None], x, kl)


def norms_fit(layers, dtype: torch.dtype) -> bool:
    """Whether every layer's input and post-attention norms are plain RMSNorms (a [H] weight of
    ``dtype``, an epsilon; the module's ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``) that
    :func:`~dflash.kernels.small_linear.small_linear_rn` can run inside a projection."""
    for layer in layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            w = getattr(norm, "weight", None)
            if not (type(norm).__name__.endswith("RMSNorm") and isinstance(w, torch.Tensor) and w.dim() == 1
                    and w.dtype == dtype and (hasattr(norm, "eps") or hasattr(norm, "variance_epsilon"))):  # fmt: skip
                return False
            if "gemma" in type(norm).__name__.lower():  # (1 + weight) scale: another formula
                return False
    return True


def target_forward_fused(be, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The static target forward of ``be`` (a StaticBackend) with fused projections.

    ids, pos [1, T] -> logits [T, V]; writes K/V at ``pos`` and the target features at ``pos``.
    Which kernels run is the backend's (``linear``, ``linear_in``, ``attention``, ``target_rope``,
    ``qkv_rope_target``, ``fuse_norm``, ``glu``, ``norm_kernel``), launched as ``be.launch["target"]``.
    A sliding-window layer (``be.windows[i]`` = W) sees keys at positions in (pos - W, pos]:
    a mask over the position-indexed cache, which keeps every row. Expert blocks run
    :func:`~dflash.backends.static.moe.moe_forward` (the route ``be.moe_route``).
    """
    t, hd = ids.shape[-1], be.head_dim
    kl = be.launch["target"]
    # one buffer when the positions are computed in the graph (the device loop's), so that the
    # kernels reading them early (past layer 0, below) never read a per-call copy made just before
    (pos,) = realized(pos)
    x = F.embedding(ids, be.embed_weight)  # [1, T, H]
    cos, sin = realized(*rope_cos_sin(pos, be.inv_freq, be.rope_scale, be.dtype))  # [1, 1, T, D], once
    split = uses_kernel(be.attention, t)  # split-KV kernel: reads filled rows, no mask; prefills of <= 32 rows too
    masks = {}  # window (None: full) -> [1, 1, T, S] bool
    if not split:
        causal = be.key_pos[None, :] <= pos[0, :, None]
        for w in set(be.windows):
            masks[w] = (causal if w is None else causal & (be.key_pos[None, :] > pos[0, :, None] - w))[None, None]
    lin = t <= LINEAR_MAX_ROWS and be.linear != "torch"  # residual adds fused in
    lin_in = lin and t <= be.linear_in  # the qkv and gate+up projections too
    rope = split and be.target_rope  # q/k (norm +) RoPE + cache writes: one kernel
    fuse = lin_in and be.fuse_norm  # the input and post-attention norms inside the qkv and gate+up kernels
    glu = be.glu
    nk = be.norm_kernel and t <= NORM_MAX_ROWS  # stand-alone norms: our kernel
    qr = rope and lin_in and be.qkv_rope_target
    slots: list[torch.Tensor] = [None] * len(be.layer_ids)  # type: ignore[list-item]
    for i, layer in enumerate(be.target.model.layers):
        a, (qkv, gate_up), window = layer.self_attn, be.fused_target[i], be.windows[i]
        fq, fg = be.folded_target[i] if fuse else (None, None)  # norms folded in (fuse_norm)
        h = x if fuse else _norm(nk and i > 0, layer.input_layernorm, x, kl)  # layer 0's: with the embedding
        norms = (a.q_norm, a.k_norm) if hasattr(a, "q_norm") else (None, None)  # Qwen3
        if qr:  # the projection inside the RoPE + cache-write kernel too (qkv_rope)
            w, b, eps = (fq.weight, fq.bias, norm_eps(layer.input_layernorm)) if fuse else (qkv.weight, qkv.bias, None)
            q = qkv_rope(h[0], w, b, eps, *norms, cos, sin, pos[0], be.k[i], be.v[i], 0, be.heads, be.kv_heads, i > 0,
                         kl)  # fmt: skip
            o = split_attention(q, be.k[i], be.v[i], pos[0], a.scaling, i > 0, kl, window)
        elif rope:
            raw = _rn(fq, layer.input_layernorm, x, kl) if fuse else _in_proj_joint(lin_in, qkv, h, kl)  # [T, (H + 2 Hkv) D]
            # early: past the first layer the tables and positions were written long before
            q = rope_cache(raw, *norms, cos, sin, pos[0], be.k[i], be.v[i], 0, be.heads, be.kv_heads, i > 0, kl)
            o = split_attention(q, be.k[i], be.v[i], pos[0], a.scaling, i > 0, kl, window)
        else:
            if fuse:
                q, k, v = _rn(fq, layer.input_layernorm, x, kl)[None].split(fq.sizes, dim=-1)
            else:
                q, k, v = _in_proj(lin_in, qkv, h, kl)
            q, k = q.view(1, t, be.heads, hd), k.view(1, t, be.kv_heads, hd)
            if hasattr(a, "q_norm"):  # Qwen3
                q, k = a.q_norm(q), a.k_norm(k)
            q = _rotate(q.transpose(1, 2), cos, sin)  # [1, H, T, D]
            k = _rotate(k.transpose(1, 2), cos, sin)
            be.k[i].index_copy_(2, pos[0], k)
            be.v[i].index_copy_(2, pos[0], v.view(1, t, be.kv_heads, hd).transpose(1, 2))
            if split:
                o = split_attention(q, be.k[i], be.v[i], pos[0], a.scaling, launch=kl, window=window)
            else:
                o = attend(q, be.k[i], be.v[i], masks[window], a.scaling)
        o = o.transpose(1, 2).reshape(1, t, be.heads * hd)
        x = _out_proj(lin, a.o_proj, o, x, kl)
        if gate_up is None:  # an expert block
            x = moe_forward(layer.mlp, _norm(nk, layer.post_attention_layernorm, x, kl), be.moe_route, residual=x)
        elif fuse:
            x = _mlp_rn(lin, fg, layer.mlp.down_proj, layer.mlp.act_fn, layer.post_attention_layernorm, x, glu, kl)
        else:
            x = _mlp(lin, lin_in, gate_up, layer.mlp.down_proj, layer.mlp.act_fn,
                     _norm(nk, layer.post_attention_layernorm, x, kl), x, glu, kl)  # fmt: skip
        if i < be.n_layers - 1:
            for n in be.feature_layers.get(i, ()):
                slots[n] = x[0]
    x = _norm(nk, be.target.model.norm, x, kl)
    for n in be.feature_layers.get(be.n_layers - 1, ()):  # HF's hidden_states[N] is final-normed
        slots[n] = x[0]
    if be.layer_ids:
        be.feats.index_copy_(0, pos[0], torch.cat(slots, dim=-1))
    return be.lm_head(x)[0]  # [T, V]
