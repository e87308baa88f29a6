"""The draft's static forward with fused projections (the CUDA-graph path).

Split from :mod:`dflash.backends.static.fused` (the target's forward and the shared helpers
stay there). :func:`draft_forward_fused` is :meth:`DFlashDraft.forward
<dflash.models.draft_torch.DFlashDraft.forward>` for the static cache.

Tried and removed (``benchmarks/results/h200-v23/4-draft-ctx-kv``): every
layer's context keys and values in one projection (``hidden_norm`` inside it), the layers' qkv
kernels on the block rows only with the input norm inside, ``rope_cache`` taking the context
rows' K/V from that projection: five kernels fewer, but the demo draft's graph took 0.154 /
0.153 ms against 0.144 ms on the H200 (commit bef496b).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.backends.static.fused import (
    _in_proj,
    _in_proj_joint,
    _mlp,
    _mlp_rn,
    _out_proj,
    _out_projs_fit,
    _plain,
    _rotate,
    attend,
    realized,
)
from dflash.kernels.qkv_rope import qkv_rope
from dflash.kernels.rope_cache import rope_cache, rope_cache_fits
from dflash.kernels.settings import Launch
from dflash.kernels.small_linear import MAX_ROWS as LINEAR_MAX_ROWS
from dflash.kernels.small_linear import small_linear, small_linear_glu
from dflash.kernels.split_attention import split_attention
from dflash.models.draft_torch import rope_cos_sin


class StaticDraftCache:
    """Draft context K/V in position-indexed buffers [1, Hkv, S, D] per layer.

    Only context rows are written (at ``write_pos``); block K/V stay transient. Validity of a
    row is decided by the caller's mask (key position < start).
    """

    def __init__(self, layers: int, kv_heads: int, capacity: int, head_dim: int, dtype, device):
        shape = (1, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.write_pos: torch.Tensor | None = None  # [Tc] positions of this call's context rows

    @property
    def positions(self) -> None:
        """Always None: row validity comes from the caller's mask, so the draft's forward never
        concatenates position history (which would bake a stale tensor into a CUDA graph)."""
        return None

    @positions.setter
    def positions(self, _value) -> None:
        pass

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor):
        self.keys[i].index_copy_(2, self.write_pos, k)
        self.values[i].index_copy_(2, self.write_pos, v)
        return self.keys[i], self.values[i]


def draft_forward_fused(draft, fused, block_embeds, target_hidden, q_pos, ctx_pos, cache, masks, kl: Launch,
                        split_kinds=frozenset(), lin: bool = False, lin_in: bool = False, rope: bool = False,
                        glu: bool = False, folded=None, qkv_fused: bool = False, final_norm: bool = True,
                        tables=None):  # fmt: skip
    """:meth:`DFlashDraft.forward` for the static cache with fused projections (a DFlash2
    draft's convolutions around its sublayers too: then ``folded`` must be None, as the
    post-attention norm is not followed by the gate+up projection).

    Context and block rows go through one QKV matmul ([Tc + L] rows; the context rows' Q is
    computed and dropped, cheaper than a second launch). Args as the draft's forward, with
    ``cache`` a StaticDraftCache (``write_pos`` set) and ``masks`` given (bool, not None);
    ``kl``: how the kernels launch (the settings and PDL). Returns [1, L, H].

    ``split_kinds``: layer types whose block rows see every context row and the whole block
    (no causal rule, no window). Those layers write the block's K/V into the cache at the block's
    positions (rows the next call's context write overwrites before any query can read them as
    context) and attend with the split-KV kernel over the rows < start + L, instead of SDPA over
    the whole capacity with a mask (:mod:`dflash.kernels.split_attention`).

    ``lin``: o_proj and down_proj with their residual adds, and the context projection ``fc``
    (up to ``MAX_ROWS`` context rows), run as
    :func:`~dflash.kernels.small_linear.small_linear` kernels; ``lin_in``: the fused qkv and
    gate+up projections too (``glu``: with SiLU(gate) * up as that kernel's epilogue,
    :func:`~dflash.kernels.small_linear.small_linear_glu`); ``folded``: per layer (None, gate+up
    with the post-attention norm's weight folded in, :func:`fold_norms`) to run that norm inside
    the gate+up kernel (the ``fuse_norm`` setting), or None; ``rope``: in ``split_kinds`` layers
    the q/k norm, RoPE and the context and block rows' cache writes run as one
    :func:`~dflash.kernels.rope_cache.rope_cache` kernel (the caller checks
    :func:`draft_rope_fits`); ``qkv_fused``: with ``rope`` (and ``lin_in``) the qkv projection
    inside that kernel too (:func:`~dflash.kernels.qkv_rope.qkv_rope`, the ``qkv_rope``
    setting); ``final_norm=False``: the last layer's output without the final norm (the
    caller's head has the norm's weight folded in and takes only the argmax, which the norm's
    positive per-row scale does not change); ``tables``: (cos, sin) [S, D] RoPE tables of every
    cache position, which the RoPE kernel reads by position when every layer runs it (no
    per-call tables), or None.
    """
    cfg, tc, lq = draft.config, target_hidden.shape[1], block_embeds.shape[1]
    fc = draft.fc
    if lin and tc <= LINEAR_MAX_ROWS and _plain(fc, target_hidden.dtype):  # one kernel, not
        ctx = draft.hidden_norm(
            small_linear(target_hidden[0].contiguous(), fc.weight, fc.bias, launch=kl)[None]
        )
    else:  # cuBLAS's split-K GEMM and its reduction (two, ~7 us on the H200)
        ctx = draft.hidden_norm(fc(target_hidden))  # [1, Tc, H]
    qkv_fused = qkv_fused and lin_in and tc + lq <= LINEAR_MAX_ROWS
    by_pos = (tables is not None and rope and not qkv_fused
              and all(kind in split_kinds for kind in cfg.layer_types))  # fmt: skip
    if by_pos:  # every layer's RoPE kernel reads the tables at its rows' positions
        cos, sin = tables
        (q_pos,) = realized(q_pos)
    else:
        cos, sin = rope_cos_sin(torch.cat((ctx_pos, q_pos), 1), draft.inv_freq, draft.rope_scale,
                                block_embeds.dtype)  # [1, 1, Tc + L, D], shared by layers  # fmt: skip
        cos, sin, q_pos = realized(cos, sin, q_pos)  # not once per layer
    h = block_embeds
    # [1] every block row sees the keys < start + L: a view the split kernel reads in place (an
    # expanded [L] copy was materialised once per layer by Inductor: ~1 us each on the H200)
    see = q_pos[0, -1:] if split_kinds else None
    # [Tc + L] cache rows, one buffer (a per-call copy would be made just before each kernel)
    wpos = realized(torch.cat((cache.write_pos, q_pos[0])))[0] if rope and split_kinds else None
    # early: after the first RoPE-kernel call every buffer made in the graph for these kernels
    # (cos/sin, wpos, q_pos) was written before an earlier layer's kernels, so the RoPE kernel
    # and the attention may load them before their PDL wait (the attn_early setting)
    early = False
    for i, layer in enumerate(draft.layers):
        a, (qkv, gate_up) = layer.self_attn, fused[i]
        d, kind = a.head_dim, cfg.layer_types[i]
        conv = getattr(layer, "attention_conv", None)  # DFlash2: convolutions around sublayers
        nb = layer.input_layernorm(h)
        if conv is not None:
            nb, taps = conv.prepare(nb)
        x = torch.cat((ctx, nb), 1)  # [1, Tc + L, H]
        fg = folded[i][1] if folded is not None and lin_in else None  # gate+up, norm folded in
        if wpos is not None and kind in split_kinds and qkv_fused:  # the qkv_rope setting
            kc, vc = cache.keys[i], cache.values[i]
            # early: after the first such call the tables and wpos were written long before
            q = qkv_rope(x[0], qkv.weight, qkv.bias, None, a.q_norm, a.k_norm, cos, sin, wpos, kc, vc, tc,
                         a.heads, a.kv_heads, early, kl)  # fmt: skip
            out = split_attention(q, kc, vc, see, None, early, kl)
            early = True
        elif wpos is not None and kind in split_kinds:
            raw = _in_proj_joint(lin_in, qkv, x, kl)  # [Tc + L, (H + 2 Hkv) D]
            kc, vc = cache.keys[i], cache.values[i]
            q = rope_cache(
                raw, a.q_norm, a.k_norm, cos, sin, wpos, kc, vc, tc, a.heads, a.kv_heads, early, kl
            )
            out = split_attention(q, kc, vc, see, None, early, kl)
            early = True
        else:
            q, k, v = _in_proj(lin_in, qkv, x, kl)  # [1, Tc + L, *]
            q = _rotate(a.q_norm(q[:, tc:].view(1, lq, a.heads, d).transpose(1, 2)),
                        cos[:, :, tc:], sin[:, :, tc:])  # fmt: skip
            k = _rotate(a.k_norm(k.view(1, tc + lq, a.kv_heads, d).transpose(1, 2)), cos, sin)
            v = v.view(1, tc + lq, a.kv_heads, d).transpose(1, 2)
            kc, vc = cache.append(i, k[:, :, :tc], v[:, :, :tc])
            if kind in split_kinds:
                kc.index_copy_(2, q_pos[0], k[:, :, tc:])
                vc.index_copy_(2, q_pos[0], v[:, :, tc:])
                out = split_attention(q, kc, vc, see, None, launch=kl)
            else:
                k, v = torch.cat((kc, k[:, :, tc:]), 2), torch.cat((vc, v[:, :, tc:]), 2)
                out = attend(q, k, v, masks[kind], None)
        out = out.transpose(1, 2).reshape(1, lq, a.heads * d)
        if conv is not None:  # DFlash2 (brief §4.1): h + finish(sublayer(prepare(norm(h))))
            h = h + conv.finish(_proj(lin, a.o_proj, out, kl), taps)
            m, taps = layer.mlp_conv.prepare(layer.post_attention_layernorm(h))
            if glu and lin_in and lq <= LINEAR_MAX_ROWS:
                act = small_linear_glu(m[0], gate_up.weight, gate_up.bias, launch=kl)[None]
            else:
                g, u = _in_proj(lin_in, gate_up, m, kl)
                act = F.silu(g) * u
            h = h + layer.mlp_conv.finish(_proj(lin, layer.mlp.down_proj, act, kl), taps)
            continue
        h = _out_proj(lin, a.o_proj, out, h, kl)
        if fg is not None:
            h = _mlp_rn(
                lin, fg, layer.mlp.down_proj, F.silu, layer.post_attention_layernorm, h, glu, kl
            )
        else:
            h = _mlp(lin, lin_in, gate_up, layer.mlp.down_proj, F.silu, layer.post_attention_layernorm(h), h, glu,
                     kl)  # fmt: skip
    return draft.norm(h) if final_norm else h


def _proj(lin: bool, proj, x: torch.Tensor, kl: Launch) -> torch.Tensor:
    """proj(x) for [1, T, *] activations (no residual): one small_linear kernel when ``lin``."""
    if lin:
        return small_linear(x[0], proj.weight, proj.bias, launch=kl)[None]
    return proj(x)


def draft_rope_fits(draft) -> bool:
    """Whether :func:`draft_forward_fused` can run with ``rope`` (every layer's attention fits
    :func:`~dflash.kernels.rope_cache.rope_cache_fits` in the draft's dtype)."""
    dtype = draft.norm.weight.dtype
    return all(rope_cache_fits(layer.self_attn, dtype) for layer in draft.layers)


def draft_small_linear_fits(draft) -> bool:
    """Whether :func:`draft_forward_fused` can run with ``lin`` (dense row-major o_proj and
    down_proj of the draft's dtype)."""
    return _out_projs_fit(draft.layers, draft.norm.weight.dtype)
