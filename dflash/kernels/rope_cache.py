"""A layer's q/k norm, RoPE and K/V cache writes in one kernel (static path, draft and target).

After its fused qkv projection a draft layer (the static path, layers whose block rows see the
whole context and block: :func:`~dflash.backends.static.draft.draft_forward_fused`'s
``split_kinds``) normalises and rotates the block's queries and every row's keys, and writes the
keys and values of the context rows and of the block rows into its position-indexed cache. Under
``torch.compile`` that was seven small kernels per layer on the H200 (the query norm + RoPE kernel
alone 9.9 us, about 18 us in all of the draft's ~40 us per layer, ``scripts/kernel_count.py
--sequence``). This Triton kernel does it in one launch: grid (rows, H + 2 Hkv),
one program per (row, head) of the projection's output, reading the head's D values once.

The target's layers (forwards of up to 32 rows, with the split-KV attention) take the same
kernel with no context rows, and without the norms unless the target has them (Qwen3): there it
replaces two or three Inductor kernels per layer.

Maths as the module path: RMSNorm in float32 (``x * rsqrt(mean(x^2) + eps)``), rounded to the
activations' dtype, times the norm's weight and rounded again; RoPE (half-split) on that with the
caller's cos/sin tables in float32, rounded once (Inductor's fused kernel rounds once too; eager
torch rounds each product). Values are copied as they are.

Off CUDA (or without Triton, unless ``TRITON_INTERPRET=1``) :func:`rope_cache_reference` runs
the same steps in torch ops. The ``rope_target`` and ``rope_draft`` settings turn it off (torch
ops on CUDA too) in the target's or the draft's forward.
"""

from __future__ import annotations

import os

import torch

from dflash.kernels.pdl import default_launch
from dflash.kernels.rms_norm import LLAMA
from dflash.kernels.settings import Launch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def norm_eps(norm) -> float:
    """An RMSNorm module's epsilon (ours: ``eps``; transformers': ``variance_epsilon``)."""
    return float(norm.eps if hasattr(norm, "eps") else norm.variance_epsilon)


def rope_cache_fits(attn, dtype: torch.dtype, norms: bool = True) -> bool:
    """Whether :func:`rope_cache` can run an attention module ``attn`` (its ``head_dim``): a
    power-of-two head size of 16 to 256, 16-bit or 32-bit activations, and with ``norms``
    q_norm and k_norm with a weight of the head size (``eps`` or ``variance_epsilon``)."""
    d = getattr(attn, "head_dim", 0)
    ok = (
        16 <= d <= 256
        and d & (d - 1) == 0
        and dtype in (torch.float32, torch.bfloat16, torch.float16)
    )
    if norms:
        mods = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
        ok = ok and all(getattr(m, "weight", None) is not None and m.weight.numel() == d
                        and (hasattr(m, "eps") or hasattr(m, "variance_epsilon")) for m in mods)  # fmt: skip
    return ok


if triton is not None:

    @triton.jit
    def _norm_rope(x1, x2, w1, w2, c1, c2, s1, s2, eps, HALF: tl.constexpr, DT: tl.constexpr,
                   NORM: tl.constexpr):  # fmt: skip
        """RMSNorm (weight halves w1, w2; NORM: 0 none, 1 Llama/Qwen3's two roundings, 2 times w
        rounded once (gpt-oss, Gemma 4), 3 times (1 + w) rounded once (Gemma 3)) then RoPE
        (tables c1, c2, s1, s2) of one head's halves x1, x2 [HALF] (float32)."""
        n1, n2 = _head_norm(x1, x2, w1, w2, eps, HALF, DT, NORM)
        return n1 * c1 - n2 * s1, n2 * c2 + n1 * s2

    @triton.jit
    def _head_norm(x1, x2, w1, w2, eps, HALF: tl.constexpr, DT: tl.constexpr, NORM: tl.constexpr):
        """One head's RMSNorm (NORM as :func:`_norm_rope`'s), rounded to DT, back in float32."""
        n1, n2 = x1, x2
        if NORM > 0:
            r = tl.math.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
            if NORM == 1:
                n1 = (x1 * r).to(DT).to(tl.float32) * w1
                n2 = (x2 * r).to(DT).to(tl.float32) * w2
            elif NORM == 2:
                n1, n2 = x1 * r * w1, x2 * r * w2
            else:
                n1, n2 = x1 * r * (1.0 + w1), x2 * r * (1.0 + w2)
            n1, n2 = n1.to(DT).to(tl.float32), n2.to(DT).to(tl.float32)
        return n1, n2

    @triton.jit
    def _row_inputs(QW, KW, COS, SIN, POS, row, head, s_cos, d, H: tl.constexpr, KV: tl.constexpr,
                    HALF: tl.constexpr, NORM: tl.constexpr, TABLE: tl.constexpr = False):  # fmt: skip
        """What a (row, head) program reads besides the projection: the norm's weight halves
        (float32; ones without NORM or for a value head), the row's cos/sin halves and its
        cache position (TABLE: cos/sin are tables by position, read at that position)."""
        at = tl.load(POS + row)
        t = at if TABLE else row
        w1 = tl.full([HALF], 1.0, tl.float32)
        w2 = tl.full([HALF], 1.0, tl.float32)
        if NORM:
            if head < H:
                w1 = tl.load(QW + d).to(tl.float32)
                w2 = tl.load(QW + HALF + d).to(tl.float32)
            elif head < H + KV:
                w1 = tl.load(KW + d).to(tl.float32)
                w2 = tl.load(KW + HALF + d).to(tl.float32)
        c1 = tl.load(COS + t * s_cos + d).to(tl.float32)
        c2 = tl.load(COS + t * s_cos + HALF + d).to(tl.float32)
        s1 = tl.load(SIN + t * s_cos + d).to(tl.float32)
        s2 = tl.load(SIN + t * s_cos + HALF + d).to(tl.float32)
        return w1, w2, c1, c2, s1, s2, at

    @triton.jit
    def _rope_cache_kernel(QKV, QW, KW, COS, SIN, POS, QO, KC, VC, TC, s_row, s_cos, s_qh, s_qt,
                           s_kh, s_ks, s_vh, s_vs, eps_q, eps_k, H: tl.constexpr, KV: tl.constexpr,
                           HALF: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
                           EARLY: tl.constexpr = False, TABLE: tl.constexpr = False, eps_v=0.0,
                           VNORM: tl.constexpr = False, KEQV: tl.constexpr = False):  # fmt: skip
        row = tl.program_id(0)
        head = tl.program_id(1)
        d = tl.arange(0, HALF)
        if EARLY:  # the tables and positions come from kernels done before the previous one
            w1, w2, c1, c2, s1, s2, at = _row_inputs(
                QW, KW, COS, SIN, POS, row, head, s_cos, d, H, KV, HALF, NORM, TABLE
            )
        if PDL:  # the rest (the projection's output) comes from the kernel just before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if not EARLY:
            w1, w2, c1, c2, s1, s2, at = _row_inputs(
                QW, KW, COS, SIN, POS, row, head, s_cos, d, H, KV, HALF, NORM, TABLE
            )
        base = QKV + row * s_row + head * (2 * HALF)
        dt = QKV.dtype.element_ty
        if head < H:  # a query head: block rows only (the context rows' queries are dropped)
            if row >= TC:
                x1 = tl.load(base + d).to(tl.float32)
                x2 = tl.load(base + HALF + d).to(tl.float32)
                y1, y2 = _norm_rope(x1, x2, w1, w2, c1, c2, s1, s2, eps_q, HALF, dt, NORM)
                out = QO + head * s_qh + (row - TC) * s_qt
                tl.store(out + d, y1.to(QO.dtype.element_ty))
                tl.store(out + HALF + d, y2.to(QO.dtype.element_ty))
        elif head < H + KV:  # a key head: into the cache at the row's position
            x1 = tl.load(base + d).to(tl.float32)
            x2 = tl.load(base + HALF + d).to(tl.float32)
            y1, y2 = _norm_rope(x1, x2, w1, w2, c1, c2, s1, s2, eps_k, HALF, dt, NORM)
            out = KC + (head - H) * s_kh + at * s_ks
            tl.store(out + d, y1.to(KC.dtype.element_ty))
            tl.store(out + HALF + d, y2.to(KC.dtype.element_ty))
        else:  # a value head, as it is (KEQV: the raw key head's values; VNORM: normed, no weight)
            out = VC + (head - H - KV) * s_vh + at * s_vs
            if KEQV:
                base = base - KV * (2 * HALF)
            if VNORM:
                x1 = tl.load(base + d).to(tl.float32)
                x2 = tl.load(base + HALF + d).to(tl.float32)
                r = tl.math.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps_v)
                tl.store(out + d, (x1 * r).to(VC.dtype.element_ty))
                tl.store(out + HALF + d, (x2 * r).to(VC.dtype.element_ty))
            else:
                tl.store(out + d, tl.load(base + d))
                tl.store(out + HALF + d, tl.load(base + HALF + d))


def _launch(qkv, q_w, k_w, eps_q, eps_k, cos, sin, pos, kc, vc, tc, heads, kv_heads, early=False,
            pdl=False, mode=LLAMA, eps_v=None, k_eq_v=False) -> torch.Tensor:  # fmt: skip
    t, width = qkv.shape
    d = kc.shape[-1]
    table = cos.dim() == 2  # [S, D] tables by position, else [1, 1, T, D] by row
    cos, sin = (
        (cos, sin) if table else (cos[0, 0], sin[0, 0])
    )  # sliced here, inside the op (see rope_cache)
    if (
        width != (heads + (1 if k_eq_v else 2) * kv_heads) * d
        or qkv.stride(1) != 1
        or cos.stride(-1) != 1
        or sin.stride() != cos.stride()
        or cos.shape[-1] != d
        or (not table and cos.shape[0] != t)
        or (table and cos.shape[0] < kc.shape[2])
        or pos.shape != (t,)
        or pos.stride(0) != 1
        or kc.shape[1] != kv_heads
        or vc.shape != kc.shape
        or kc.stride(-1) != 1
        or vc.stride(-1) != 1
    ):
        raise ValueError(f"rope_cache: qkv {tuple(qkv.shape)} (strides {qkv.stride()}) does not fit "
                         f"{heads} + 2 x {kv_heads} heads of {d}, cos/sin {tuple(cos.shape)}, positions "
                         f"{tuple(pos.shape)} and caches {tuple(kc.shape)} / {tuple(vc.shape)}")  # fmt: skip
    q = qkv.new_empty(1, t - tc, heads, d).transpose(1, 2)  # [1, H, L, D]
    norm = q_w is not None
    _rope_cache_kernel[(t, heads + 2 * kv_heads)](
        qkv, q_w if norm else qkv, k_w if norm else qkv, cos, sin, pos, q, kc, vc, tc, qkv.stride(0),
        cos.stride(-2), q.stride(1), q.stride(2), kc.stride(1), kc.stride(2), vc.stride(1), vc.stride(2),
        eps_q, eps_k, H=heads, KV=kv_heads, HALF=d // 2, NORM=mode + 1 if norm else 0, PDL=pdl, EARLY=early,
        TABLE=table, eps_v=float(eps_v or 0.0), VNORM=eps_v is not None, KEQV=k_eq_v,
        num_warps=1 if d <= 256 else 2,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return q


@torch.library.custom_op("dflash::rope_cache_family", mutates_args=("kc", "vc"))
def _rope_cache_family_op(qkv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, eps_q: float, eps_k: float,
                          cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, kc: torch.Tensor,
                          vc: torch.Tensor, heads: int, kv_heads: int, early: bool, pdl: bool, mode: int,
                          eps_v: float, v_norm: bool, k_eq_v: bool) -> torch.Tensor:  # fmt: skip
    return _launch(qkv, q_w, k_w, eps_q, eps_k, cos, sin, pos, kc, vc, 0, heads, kv_heads, early, pdl, mode,
                   eps_v if v_norm else None, k_eq_v)  # fmt: skip


@_rope_cache_family_op.register_fake
def _(
    qkv,
    q_w,
    k_w,
    eps_q,
    eps_k,
    cos,
    sin,
    pos,
    kc,
    vc,
    heads,
    kv_heads,
    early,
    pdl,
    mode,
    eps_v,
    v_norm,
    k_eq_v,
):
    return qkv.new_empty(1, qkv.shape[0], heads, kc.shape[-1]).transpose(1, 2)


@torch.library.custom_op("dflash::rope_cache", mutates_args=("kc", "vc"))
def _rope_cache_op(qkv: torch.Tensor, q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps_q: float, eps_k: float,
                   cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, kc: torch.Tensor,
                   vc: torch.Tensor, tc: int, heads: int, kv_heads: int, early: bool, pdl: bool) -> torch.Tensor:  # fmt: skip
    return _launch(
        qkv, q_w, k_w, eps_q, eps_k, cos, sin, pos, kc, vc, tc, heads, kv_heads, early, pdl
    )


@_rope_cache_op.register_fake
def _(qkv, q_w, k_w, eps_q, eps_k, cos, sin, pos, kc, vc, tc, heads, kv_heads, early, pdl):
    return qkv.new_empty(1, qkv.shape[0] - tc, heads, kc.shape[-1]).transpose(1, 2)


def rope_cache_reference(qkv, q_norm, k_norm, cos, sin, pos, kc, vc, tc: int, heads: int,
                         kv_heads: int) -> torch.Tensor:  # fmt: skip
    """The module path's torch ops for :func:`rope_cache` (same args); writes kc/vc, returns q."""
    from dflash.models.draft_torch import apply_rope

    t, d = qkv.shape[0], kc.shape[-1]
    if cos.dim() == 2:  # [S, D] tables by position
        cos, sin = cos[pos][None, None], sin[pos][None, None]
    q, k, v = qkv[None].split((heads * d, kv_heads * d, kv_heads * d), dim=-1)
    q, k = (
        q[:, tc:].view(1, t - tc, heads, d).transpose(1, 2),
        k.view(1, t, kv_heads, d).transpose(1, 2),
    )
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = apply_rope(q, cos[:, :, tc:], sin[:, :, tc:]), apply_rope(k, cos, sin)
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v.view(1, t, kv_heads, d).transpose(1, 2))
    return q


def rope_cache_family(qkv: torch.Tensor, q_norm, k_norm, v_norm, cos: torch.Tensor, sin: torch.Tensor,
                      pos: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, heads: int, kv_heads: int,
                      mode: int, k_eq_v: bool = False, early: bool = False,
                      launch: Launch | None = None) -> torch.Tensor:  # fmt: skip
    """A Gemma 3 / Gemma 4 target layer's q/k norms, RoPE, v norm and K/V cache writes in one
    kernel (as :func:`rope_cache` with no context rows, for the norms of those families).

    Args:
        qkv: [T, (H + 2 Hkv) * D] the fused projection (``k_eq_v``: [T, (H + Hkv) * D], no v
            part: the values are the raw keys, Gemma 4's ``attention_k_eq_v`` layers).
        q_norm, k_norm: the head norms (``weight`` [D]); v_norm: Gemma 4's weightless v norm
            (its ``eps``), or None (values copied as they are).
        cos, sin: [1, 1, T, D] RoPE tables; pos: [T] cache positions; kc, vc: [1, Hkv, S, D].
        mode: the norms' maths, :data:`~dflash.kernels.rms_norm.ROUND_ONCE` (Gemma 4: times the
            weight, rounded once) or :data:`~dflash.kernels.rms_norm.ONE_PLUS` (Gemma 3); the
            v norm rounds once.
        early, launch: as :func:`rope_cache`'s.
    Returns:
        q: [1, H, T, D] normed and rotated (laid out as [1, T, H, D]). Off CUDA (or without
        Triton, unless ``TRITON_INTERPRET=1``) the modules and torch ops run instead.
    """
    if triton is None or (qkv.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        return rope_cache_family_reference(
            qkv, q_norm, k_norm, v_norm, cos, sin, pos, kc, vc, heads, kv_heads, k_eq_v
        )
    launch = default_launch(qkv.device) if launch is None else launch
    eps_v = norm_eps(v_norm) if v_norm is not None else 0.0
    return _rope_cache_family_op(qkv, q_norm.weight, k_norm.weight, norm_eps(q_norm), norm_eps(k_norm), cos, sin,
                                 pos, kc, vc, heads, kv_heads, early and launch.settings.attn_early, launch.pdl,
                                 mode, eps_v, v_norm is not None, k_eq_v)  # fmt: skip


def rope_cache_family_reference(qkv, q_norm, k_norm, v_norm, cos, sin, pos, kc, vc, heads: int, kv_heads: int,
                                k_eq_v: bool = False) -> torch.Tensor:  # fmt: skip
    """:func:`rope_cache_family` in the modules and torch ops (the family forward's own steps)."""
    from dflash.models.draft_torch import apply_rope

    t, d = qkv.shape[0], kc.shape[-1]
    sizes = (heads * d, kv_heads * d) if k_eq_v else (heads * d, kv_heads * d, kv_heads * d)
    parts = qkv[None].split(sizes, dim=-1)
    q, k = parts[0].view(1, t, heads, d), parts[1].view(1, t, kv_heads, d)
    v = k if k_eq_v else parts[2].view(1, t, kv_heads, d)
    q, k = q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2)
    if v_norm is not None:
        v = v_norm(v)
    kc.index_copy_(2, pos, apply_rope(k, cos, sin))
    vc.index_copy_(2, pos, v.transpose(1, 2))
    return apply_rope(q, cos, sin)


def rope_cache(qkv: torch.Tensor, q_norm, k_norm, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
               kc: torch.Tensor, vc: torch.Tensor, tc: int, heads: int, kv_heads: int,
               early: bool = False, launch: Launch | None = None) -> torch.Tensor:  # fmt: skip
    """One draft layer's q/k RMSNorm + RoPE and K/V cache writes.

    Args:
        qkv: [T, (H + 2 Hkv) * D] the fused qkv projection of T = Tc context rows then L block
            rows (unit last stride): queries, keys, values, head after head.
        q_norm, k_norm: the layer's RMSNorm modules (``weight`` [D], ``eps`` or
            ``variance_epsilon``), or both None (no norms: Llama, Qwen2).
        cos, sin: [1, 1, T, D] RoPE tables of the T rows (row-major last two dims), or [S, D]
            tables of every cache position S (read at ``pos``: no per-call tables to compute,
            the ``rope_table`` setting).
        pos: [T] int64 cache positions of the rows; rows sharing a position must hold the same
            values (the static loop's clamped context rows do), and no context row may share
            one with a block row.
        kc, vc: [1, Hkv, S, D] the layer's caches, written at ``pos`` (keys normed and rotated).
        tc: context rows Tc; heads, kv_heads: H and Hkv.
        early: cos, sin, pos (and the norms' weights) were written before the kernel that runs
            just before this one (not the first layer's call): under PDL they load before the
            wait for that kernel, which writes only ``qkv`` (when the ``attn_early`` setting
            says so, as :func:`~dflash.kernels.split_attention.split_attention`'s ``early``).
        launch: the settings and PDL; None = :func:`~dflash.kernels.pdl.default_launch`.

    Pass whole tensors, not views of computed ones: Inductor materialises a view of an unrealised
    tensor once per custom-op call (the cos/sin tables were recomputed by two kernels in every
    layer on the H200); the tensor itself once per graph.

    Returns:
        q: [1, H, L, D] the block's queries, normed and rotated (laid out as [1, L, H, D]).
    """
    if triton is None or (qkv.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        return rope_cache_reference(qkv, q_norm, k_norm, cos, sin, pos, kc, vc, tc, heads, kv_heads)
    launch = default_launch(qkv.device) if launch is None else launch
    early, pdl = early and launch.settings.attn_early, launch.pdl
    if q_norm is None:
        return _rope_cache_op(
            qkv, None, None, 0.0, 0.0, cos, sin, pos, kc, vc, tc, heads, kv_heads, early, pdl
        )
    return _rope_cache_op(qkv, q_norm.weight, k_norm.weight, norm_eps(q_norm), norm_eps(k_norm),
                          cos, sin, pos, kc, vc, tc, heads, kv_heads, early, pdl)  # fmt: skip
