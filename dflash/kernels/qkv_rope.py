"""A layer's qkv projection, q/k norm, RoPE and K/V cache writes in one kernel (static path).

On the demo pair every layer's attention input took two kernels: the fused qkv projection
(:func:`~dflash.kernels.small_linear.small_linear`, or ``small_linear_rn`` with the input norm
inside) and :func:`~dflash.kernels.rope_cache.rope_cache` (q/k norm, RoPE, cache writes), both
latency-bound there (a 1.1 MB weight). This kernel does both: each program computes some
columns of the projection for every row, streaming their weight rows along K as
``small_linear`` does (same K tiles, same float32 accumulator, the input norm's row factor on
it when asked), rounds them as the projection's output, then rotates (and normalises) and
stores them as ``rope_cache`` does: queries of the block rows to a [1, H, L, D] tensor, keys and
values into the caches at the rows' positions. The raw projection never goes to memory.

- Without q/k norms (Llama, Qwen2: the demo target) a program takes ``P`` columns of a head's
  first half and the same ``P`` of its second half (the pairs RoPE mixes), as many columns as
  ``small_linear`` would take (16 on the demo's shapes: 60 programs).
- With q/k norms (Qwen3, DFlash drafts) a program takes a whole head (the norm needs its sum of
  squares): 15 programs on the demo draft's shapes, 48 on Qwen3-8B's.

Measured on the H200 (``benchmarks/results/h200-v23``, demo shapes at
prompt 300, random weights, same machine, alternating runs): column pairs in the target took
the verify-1 graph from 0.595 / 0.596 to 0.572 / 0.571 ms and the loop steps from 0.617 / 0.620
to 0.590 / 0.591 ms (block 1) and 0.795 / 0.796 to 0.767 / 0.768 ms (block 16); the real pair
on gsm8k's first 32 prompts gave 1,749.1 / 5,410.0 tok/s (baseline / DFlash) against 1,678.5 /
5,188.3 without it, the same acceptance lengths, 32/32 identical in both. Whole heads were
slower: the draft graph 0.148 against 0.146 ms, Qwen3-8B's block-1 step 4.62 against 4.18 ms.
So the ``qkv_rope`` setting unset (None, ``auto``) runs it where there are no q/k norms and the
weight is at most :data:`AUTO_MAX_BYTES` (:func:`qkv_rope_wanted`); True wherever it can run,
False nowhere.

Maths: the projection's product and rounding are ``small_linear``'s (``small_linear_rn``'s with
``rn_eps``), the rest is ``rope_cache``'s, so results equal the two-kernel path's up to the
order of float32 sums inside a tile (the real pair's texts were the same). Off CUDA (or without
Triton, unless ``TRITON_INTERPRET=1``) :func:`qkv_rope_reference` runs the two references in a row.
"""

from __future__ import annotations

import os

import torch

from dflash.kernels.pdl import default_launch
from dflash.kernels.rope_cache import norm_eps, rope_cache_fits, rope_cache_reference
from dflash.kernels.settings import Launch
from dflash.kernels.small_linear import SMEM_BUDGET, kernel_config

AUTO_MAX_BYTES = 8 << 20  # the qkv_rope setting unset: on for qkv weights up to this size
MAX_HEAD_DIM = 128  # one [rows, D] float32 accumulator per program
MAX_ROWS = 32

try:
    import triton
    import triton.language as tl

    from dflash.kernels.small_linear import _rows_times_weight
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def qkv_rope_fits(attn, weight: torch.Tensor, norms: bool) -> bool:
    """Whether :func:`qkv_rope` can run an attention module ``attn`` whose fused qkv weight is
    ``weight`` ([(H + 2 Hkv) D, K]): what :func:`~dflash.kernels.rope_cache.rope_cache_fits`
    asks, a head size of at most :data:`MAX_HEAD_DIM`, a dense row-major weight."""
    d = getattr(attn, "head_dim", 0)
    return (rope_cache_fits(attn, weight.dtype, norms) and d <= MAX_HEAD_DIM and weight.dim() == 2
            and weight.stride(1) == 1 and weight.shape[0] % d == 0)  # fmt: skip


def qkv_rope_wanted(weights, norms: bool, setting: bool | None = None) -> bool:
    """Whether the fused kernel runs for layers with these qkv ``weights`` (``norms``: with q/k
    norms): the ``qkv_rope`` ``setting`` when given, else (None, ``auto``) without q/k norms and
    every weight at most :data:`AUTO_MAX_BYTES`. With q/k norms each program takes a whole head (its sum of
    squares), which measured slower on the H200: the demo draft's graph 0.148 against 0.146 ms,
    Qwen3-8B's block-1 step 4.62 against 4.18 ms."""
    if setting is not None:
        return setting
    return not norms and all(w.numel() * w.element_size() <= AUTO_MAX_BYTES for w in weights)


if triton is not None:

    @triton.jit
    def _norm_rope_rows(x1, x2, w1, w2, c1, c2, s1, s2, eps, HALF: tl.constexpr, DT: tl.constexpr,
                        NORM: tl.constexpr):  # fmt: skip
        """rope_cache's ``_norm_rope`` for [BM, P] halves of one head in many rows (``NORM``: P is
        the whole half, the norm's weight halves w1, w2 [P]; c*/s* the rows' tables [BM, P])."""
        n1, n2 = x1, x2
        if NORM:
            r = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
            n1 = (x1 * r[:, None]).to(DT).to(tl.float32) * w1[None, :]
            n2 = (x2 * r[:, None]).to(DT).to(tl.float32) * w2[None, :]
            n1, n2 = n1.to(DT).to(tl.float32), n2.to(DT).to(tl.float32)
        return n1 * c1 - n2 * s1, n2 * c2 + n1 * s2

    @triton.jit
    def _tables(COS, SIN, POS, rm, m_ok, s_cos, d, HALF: tl.constexpr):
        """The rows' cos/sin halves at columns d ([BM, P] each, float32) and cache positions [BM]."""
        at = rm[:, None] * s_cos + d[None, :]
        c1 = tl.load(COS + at, mask=m_ok[:, None], other=0.0).to(tl.float32)
        c2 = tl.load(COS + at + HALF, mask=m_ok[:, None], other=0.0).to(tl.float32)
        s1 = tl.load(SIN + at, mask=m_ok[:, None], other=0.0).to(tl.float32)
        s2 = tl.load(SIN + at + HALF, mask=m_ok[:, None], other=0.0).to(tl.float32)
        return c1, c2, s1, s2, tl.load(POS + rm, mask=m_ok, other=0)

    @triton.jit
    def _qkv_rope_kernel(X, W, B, QW, KW, COS, SIN, POS, QO, KC, VC, M, K, TC, s_xm, s_wn, s_cos, s_qh, s_qt,
                         s_kh, s_ks, s_vh, s_vs, eps_q, eps_k, rn_eps, H: tl.constexpr, KV: tl.constexpr,
                         HALF: tl.constexpr, P: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                         RN: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                         PDL: tl.constexpr, EARLY: tl.constexpr):  # fmt: skip
        head = tl.program_id(0) // (HALF // P)
        d = (tl.program_id(0) % (HALF // P)) * P + tl.arange(0, P)  # this program's columns of each half
        rm = tl.arange(0, BM)
        m_ok = rm < M
        c = tl.arange(0, 2 * P)
        rn = head * (2 * HALF) + tl.where(c < P, 0, HALF - P) + (tl.program_id(0) % (HALF // P)) * P + c
        n_ok = rn < (H + 2 * KV) * (2 * HALF)
        w1 = tl.zeros([P], tl.float32)
        w2 = tl.zeros([P], tl.float32)
        if NORM:  # the norms' weights: not written by the kernels before
            if head < H:
                w1 = tl.load(QW + d).to(tl.float32)
                w2 = tl.load(QW + HALF + d).to(tl.float32)
            else:
                w1 = tl.load(KW + d).to(tl.float32)
                w2 = tl.load(KW + HALF + d).to(tl.float32)
        if EARLY:  # the tables and positions come from kernels that are done before the previous one
            c1, c2, s1, s2, at = _tables(COS, SIN, POS, rm, m_ok, s_cos, d, HALF)
        acc = _rows_times_weight(X, W, rm, rn, m_ok, n_ok, K, s_xm, s_wn, IEEE, BM, 2 * P, BK, PDL, RN, rn_eps)
        if not EARLY:
            c1, c2, s1, s2, at = _tables(COS, SIN, POS, rm, m_ok, s_cos, d, HALF)
        if HAS_BIAS:
            acc += tl.load(B + rn).to(tl.float32)[None, :]
        dt = X.dtype.element_ty
        # the projection's output rounded as small_linear's, then the halves in float32
        x1, x2 = tl.split(tl.permute(tl.reshape(acc.to(dt).to(tl.float32), [BM, 2, P]), [0, 2, 1]))
        if head < H:  # a query head: block rows only (the context rows' queries are dropped)
            ok = m_ok & (rm >= TC)
            y1, y2 = _norm_rope_rows(x1, x2, w1, w2, c1, c2, s1, s2, eps_q, HALF, dt, NORM)
            out = QO + head * s_qh + (rm - TC)[:, None] * s_qt + d[None, :]
            tl.store(out, y1.to(QO.dtype.element_ty), mask=ok[:, None])
            tl.store(out + HALF, y2.to(QO.dtype.element_ty), mask=ok[:, None])
        elif head < H + KV:  # a key head: into the cache at each row's position
            y1, y2 = _norm_rope_rows(x1, x2, w1, w2, c1, c2, s1, s2, eps_k, HALF, dt, NORM)
            out = KC + (head - H) * s_kh + at[:, None] * s_ks + d[None, :]
            tl.store(out, y1.to(KC.dtype.element_ty), mask=m_ok[:, None])
            tl.store(out + HALF, y2.to(KC.dtype.element_ty), mask=m_ok[:, None])
        else:  # a value head, as projected
            out = VC + (head - H - KV) * s_vh + at[:, None] * s_vs + d[None, :]
            tl.store(out, x1.to(VC.dtype.element_ty), mask=m_ok[:, None])
            tl.store(out + HALF, x2.to(VC.dtype.element_ty), mask=m_ok[:, None])


def _launch(x, weight, bias, rn_eps, rn, q_w, k_w, eps_q, eps_k, cos, sin, pos, kc, vc, tc, heads, kv_heads,
            early=False, pdl=False, config=""):  # fmt: skip
    t, k = x.shape
    d = kc.shape[-1]
    cos, sin = cos[0, 0], sin[0, 0]  # [T, D]
    if t > MAX_ROWS or t <= tc or weight.shape != ((heads + 2 * kv_heads) * d, k) or x.stride(1) != 1 \
            or weight.stride(1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride() or cos.shape[0] != t \
            or pos.shape != (t,) or pos.stride(0) != 1 or kc.shape[1] != kv_heads or vc.shape != kc.shape \
            or kc.stride(-1) != 1 or vc.stride(-1) != 1 or d > MAX_HEAD_DIM:
        raise ValueError(f"qkv_rope: x {tuple(x.shape)} (strides {x.stride()}), weight {tuple(weight.shape)}, "
                         f"{heads} + 2 x {kv_heads} heads, cos/sin {tuple(cos.shape)}, positions {tuple(pos.shape)} "
                         f"and caches {tuple(kc.shape)} / {tuple(vc.shape)} do not fit (at most {MAX_ROWS} rows, "
                         f"more than {tc} context rows, head dim <= {MAX_HEAD_DIM})")  # fmt: skip
    q = x.new_empty(1, t - tc, heads, d).transpose(1, 2)  # [1, H, L, D]
    bm, bn, bk, warps, _ = kernel_config(t, weight.shape[0], k, weight.element_size(), config)  # small_linear's tiles
    norm = q_w is not None
    # columns of each half per program: the whole half with norms (a head's sum of squares),
    # else small_linear's columns per program (pairs of columns RoPE mixes: j and j + D/2)
    half = d // 2 if norm else max(8, min(d // 2, bn // 2))
    stages = max(2, min(4, SMEM_BUDGET // ((bm + 2 * half) * bk * weight.element_size())))
    _qkv_rope_kernel[((heads + 2 * kv_heads) * (d // 2 // half),)](
        x, weight, bias if bias is not None else weight, q_w if norm else weight, k_w if norm else weight, cos, sin,
        pos, q, kc, vc, t, k, tc, x.stride(0), weight.stride(0), cos.stride(-2), q.stride(1), q.stride(2),
        kc.stride(1), kc.stride(2), vc.stride(1), vc.stride(2), eps_q, eps_k, rn_eps, H=heads, KV=kv_heads,
        HALF=d // 2, P=half, HAS_BIAS=bias is not None, NORM=norm, RN=rn, IEEE=x.dtype == torch.float32, BM=bm,
        BK=bk, PDL=pdl, EARLY=early, num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return q


if triton is not None:

    @torch.library.custom_op("dflash::qkv_rope", mutates_args=("kc", "vc"))
    def _qkv_rope_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rn_eps: float, rn: bool,
                     q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps_q: float, eps_k: float,
                     cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                     tc: int, heads: int, kv_heads: int, early: bool, pdl: bool, config: str) -> torch.Tensor:  # fmt: skip
        return _launch(x, weight, bias, rn_eps, rn, q_w, k_w, eps_q, eps_k, cos, sin, pos, kc, vc, tc, heads, kv_heads,
                       early, pdl, config)  # fmt: skip

    @_qkv_rope_op.register_fake
    def _(x, weight, bias, rn_eps, rn, q_w, k_w, eps_q, eps_k, cos, sin, pos, kc, vc, tc, heads, kv_heads, early,
          pdl, config):  # fmt: skip
        return x.new_empty(1, x.shape[0] - tc, heads, kc.shape[-1]).transpose(1, 2)


def qkv_rope_reference(x, weight, bias, rn_eps, q_norm, k_norm, cos, sin, pos, kc, vc, tc: int, heads: int,
                       kv_heads: int) -> torch.Tensor:  # fmt: skip
    """:func:`qkv_rope` as the two-kernel path's torch references (same args): the projection
    (``small_linear_rn_reference`` with ``rn_eps``, else ``small_linear_reference``), then
    :func:`~dflash.kernels.rope_cache.rope_cache_reference`. Writes kc/vc, returns q."""
    from dflash.kernels.small_linear import small_linear_reference, small_linear_rn_reference

    if rn_eps is None:
        raw = small_linear_reference(x, weight, bias)
    else:
        raw = small_linear_rn_reference(x, weight, bias, rn_eps)
    return rope_cache_reference(raw, q_norm, k_norm, cos, sin, pos, kc, vc, tc, heads, kv_heads)


def qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rn_eps: float | None, q_norm,
             k_norm, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
             tc: int, heads: int, kv_heads: int, early: bool = False, launch: Launch | None = None) -> torch.Tensor:  # fmt: skip
    """One layer's fused qkv projection, q/k RMSNorm, RoPE and K/V cache writes in one kernel.

    Args:
        x: [T, K] the layer's input rows, Tc context rows then L block rows (unit last stride;
            T <= 32); with ``rn_eps`` the un-normed residual rows.
        weight: [(H + 2 Hkv) D, K] the fused q, k, v projection weight (row major), with the
            input norm's weight folded in when ``rn_eps`` is given
            (:func:`~dflash.kernels.small_linear.fold_norm_weight`); bias: [(H + 2 Hkv) D] or None.
        rn_eps: the input RMSNorm's epsilon to apply its row factor inside (as
            :func:`~dflash.kernels.small_linear.small_linear_rn`), or None (x is already normed).
        q_norm, k_norm, cos, sin, pos, kc, vc, tc, heads, kv_heads: as
            :func:`~dflash.kernels.rope_cache.rope_cache` (cos/sin [1, 1, T, D], pos [T] int64,
            caches [1, Hkv, S, D] written at ``pos``).
        early: cos, sin and pos were written before the kernel that runs just before this one
            (not the first layer's call): under PDL they load before the wait for that kernel
            (when the ``attn_early`` setting says so).
        launch: the settings (``linear_config``, ``attn_early``) and PDL; None =
            :func:`~dflash.kernels.pdl.default_launch`.

    Returns:
        q: [1, H, L, D] the block's queries, normed and rotated (laid out as [1, L, H, D]).

    Raises:
        ValueError: shapes that do not fit (more than 32 rows, head dim over 128, ...).
    """
    if triton is None or (x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        return qkv_rope_reference(x, weight, bias, rn_eps, q_norm, k_norm, cos, sin, pos, kc, vc, tc, heads, kv_heads)
    rn, eps = rn_eps is not None, float(rn_eps or 0.0)
    launch = default_launch(x.device) if launch is None else launch
    run = (early and launch.settings.attn_early, launch.pdl, launch.settings.linear_config)
    if q_norm is None:
        return _qkv_rope_op(x, weight, bias, eps, rn, None, None, 0.0, 0.0, cos, sin, pos, kc, vc, tc, heads,
                            kv_heads, *run)  # fmt: skip
    return _qkv_rope_op(x, weight, bias, eps, rn, q_norm.weight, k_norm.weight, norm_eps(q_norm), norm_eps(k_norm),
                        cos, sin, pos, kc, vc, tc, heads, kv_heads, *run)  # fmt: skip
