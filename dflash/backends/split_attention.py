"""Attention of a few query rows over a position-indexed KV cache, reading only the filled rows.

The static path keeps K/V in buffers of a fixed capacity S (rows indexed by position) so that
CUDA graphs have fixed shapes. ``F.scaled_dot_product_attention`` with a position mask then
reads all S rows every layer, and on the H200 the demo pair spent about half of a 16-wide
verify in attention: a cuDNN kernel with one thread block per head walking all S keys, plus
building the [T, S] mask bias. This module is a split-KV ("flash-decoding") kernel instead:

- grid (KV heads x G / GP, S / ``split``): each program takes the GP*T query rows of GP of the
  G query heads that share one KV head (GQA; T query positions; :func:`heads_per_program`: one
  head for a 16-row block, the whole group for a 1-row step) and one slice of ``split`` keys
  (:data:`SPLIT`: 256), walked 128 keys at a time; while the filled length is short
  (:func:`default_one_slice`: up to 640 keys for head dims <= 64, 448 above) the first program
  takes all of it alone and the others return, since merging slices costs more than it saves;
- the filled length is read on the device (the last query position + 1), so programs whose
  slice starts past it return at once and the others stop at it: cost follows the filled
  length, not the capacity, with no host sync and one graph for every length;
- causal by position: query row t sees keys at positions <= pos[t]; online softmax per slice
  (base 2); when the filled length spans several slices, each program publishes its partial
  output and log-sum-exp and the last one of its heads to finish (an atomic counter) merges
  them, so one launch does the whole attention: no merge kernels (which, fused by Inductor
  with the next layer's ops, cost up to 9.5 us per layer on the H200).

Same maths as SDPA with the mask (softmax(q k^T * scale) v over keys at positions <= pos[t]),
summed in another order: results agree to float rounding (float32 runs use exact fp32 dots).
``DFLASH_ATTN=sdpa`` goes back to SDPA. Needs CUDA and Triton; :func:`split_attention_reference`
is the same algorithm in torch (CPU tests), and ``TRITON_INTERPRET=1`` runs the kernel on CPU.
"""

from __future__ import annotations

import math
import os

import torch

from dflash.backends.attention_settings import (  # noqa: F401 - re-exported
    ATTN_ENV,
    BLOCK_ENV,
    BLOCK_N,
    DRAFT_SPLIT_ENV,
    ITER_KEYS,
    ONE_SLICE,
    ONE_SLICE_ENV,
    ONE_SLICE_SMALL_HEADS,
    PRELOAD_ENV,
    ROPE_ATTN_ENV,
    SPLIT,
    SPLIT_ENV,
    SPLIT_MAX_ROWS,
    default_one_slice,
    default_split,
    heads_per_program,
    iter_keys,
    one_slice_setting,
    preload_setting,
    rope_attention_setting,
    split_setting,
    split_size,
    uses_kernel,
)
from dflash.backends.pdl import pdl_enabled

try:  # Triton ships with CUDA builds of torch; CPU installs usually lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available() -> bool:
    """Whether the Triton kernel can run (Triton importable)."""
    return triton is not None


def attention_mode(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """Which attention the static forwards use (``DFLASH_ATTN``).

    - ``auto`` (default): the split kernel for every forward of up to ``SPLIT_MAX_ROWS`` query
      rows, block 1 included (longer prefills use SDPA), with bf16/fp16 weights; exact SDPA with
      float32 weights. The kernel's exact fp32 dots (no tensor cores) took 600-740 us per 16-row
      call on the H200, against about 91 us before its slices were merged inside it (cause not
      found), so float32 runs, the parity reference, use SDPA.
    - ``split``: the kernel at those widths whatever the dtype (float32 checks of the kernel).
    - ``sdpa``: never the kernel.

    Without CUDA or Triton it is always ``sdpa``. On the H200 (random demo-shaped pair, one run
    side by side) the kernel at width 1 took 0.921 ms per block-1 step against 0.993 ms with
    cuDNN's SDPA, which needs a mask and a reduction kernel per layer.

    Raises:
        InputError: another value.
    """
    from dflash.errors import env_choice

    raw = env_choice(ATTN_ENV, ("auto", "split", "sdpa"))
    if device.type != "cuda" or not available() or (raw == "auto" and dtype == torch.float32):
        return "sdpa"
    return raw


if triton is not None:

    @triton.jit
    def _store_rows(OUT, x, head, t, d, live, s_oh, s_ot):
        """Store the final rows x [ROWS, D] (row r: query head ``head[r]`` at position ``t[r]``)
        in OUT's dtype; the pointers are made here, after the key loop, not held through it."""
        tl.store(OUT + head[:, None] * s_oh + t[:, None] * s_ot + d[None, :], x.to(OUT.dtype.element_ty),
                 mask=live[:, None])  # fmt: skip

    @triton.jit
    def _tile(q, k, v, n, qpos, m_i, l_i, acc, scale_log2, IEEE: tl.constexpr):
        """One tile of keys (k [D, BLOCK], v [BLOCK, D] at positions n) into the online softmax
        of the rows (running max m_i, sum l_i, output acc [ROWS, D]); base 2."""
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = tl.where(n[None, :] <= qpos[:, None], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _rope_rows(X, off, W, COS, SIN, crow, s_cos, d, live, eps, D: tl.constexpr, NORM: tl.constexpr):
        """Rows [R, D] at X + off[r]: RMSNorm (weight W; NORM) then half-split RoPE with the
        cos/sin table rows ``crow``, in float32, rounded where :mod:`~dflash.backends.rope_cache`'s
        kernel rounds."""
        dt = X.dtype.element_ty
        dr = (d + D // 2) % D  # the other half's column
        x = tl.load(X + off[:, None] + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        xr = tl.load(X + off[:, None] + dr[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        if NORM:
            rs = tl.math.rsqrt(tl.sum(x * x, 1) / D + eps)
            x = ((x * rs[:, None]).to(dt).to(tl.float32) * tl.load(W + d).to(tl.float32)[None, :]).to(dt)
            xr = ((xr * rs[:, None]).to(dt).to(tl.float32) * tl.load(W + dr).to(tl.float32)[None, :]).to(dt)
            x, xr = x.to(tl.float32), xr.to(tl.float32)
        c = tl.load(COS + crow[:, None] * s_cos + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        s = tl.load(SIN + crow[:, None] * s_cos + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        return x * c + tl.where((d < D // 2)[None, :], -xr, xr) * s

    @triton.jit
    def _fresh_kv(k, v, n, fresh, pos0, QKV, COS, SIN, KW, K, V, kvh, s_row, s_cos, s_kh, s_ks, s_vh, s_vs,
                  eps_k, d, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
        """The tile's rows at positions n that this call writes (``fresh``: qkv row n - pos0, the
        positions consecutive): keys normed and rotated, values as they are, written into the
        caches and put into the tile (k [D, BLOCK], v [BLOCK, D])."""
        j = tl.where(fresh, n - pos0, 0)
        kn = _rope_rows(QKV, j * s_row + (H + kvh) * D, KW, COS, SIN, j, s_cos, d, fresh, eps_k, D, NORM)
        kn = kn.to(K.dtype.element_ty)
        vn = tl.load(QKV + j[:, None] * s_row + (H + HKV + kvh) * D + d[None, :], mask=fresh[:, None], other=0.0)
        vn = vn.to(V.dtype.element_ty)
        tl.store(K + kvh * s_kh + n[:, None] * s_ks + d[None, :], kn, mask=fresh[:, None])
        tl.store(V + kvh * s_vh + n[:, None] * s_vs + d[None, :], vn, mask=fresh[:, None])
        return tl.where(fresh[None, :], tl.trans(kn), k), tl.where(fresh[:, None], vn, v)

    @triton.jit
    def _split_kernel(Q, K, V, POS, OUT, PO, PL, CNT, scale_log2, cap, s_pos,
                      s_qh, s_qt, s_kh, s_ks, s_vh, s_vs, s_oh, s_ot, s_ph, s_ps, s_pr, s_lh, s_ls,
                      COS, SIN, QW, KW, s_cos, eps_q, eps_k,
                      T: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                      ROWS: tl.constexpr, SPLIT_N: tl.constexpr, BLOCK: tl.constexpr,
                      IEEE: tl.constexpr, MERGE: tl.constexpr, PDL: tl.constexpr,
                      ONE: tl.constexpr, PRE: tl.constexpr, NSP: tl.constexpr,
                      ROPE: tl.constexpr, NORM: tl.constexpr, HKV: tl.constexpr):  # fmt: skip
        # ROPE: Q is the fused qkv projection [T, (G*HKV + 2*HKV) * D] (row stride s_qt) of rows at
        # consecutive positions: this kernel norms and rotates the queries and the new keys and
        # writes the new rows into the caches (rope_cache's work), instead of a kernel before it
        unit = tl.program_id(0)  # GP query heads of one KV head: G // GP units per KV head
        kvh = unit // (G // GP)
        sp = tl.program_id(1)
        r = tl.arange(0, ROWS)
        live = r < GP * T
        g = (unit % (G // GP)) * GP + r // T  # query head within the KV head's group
        t = r % T
        d = tl.arange(0, D)
        if PRE:  # before the PDL wait: the positions and the first tile of the keys already cached
            qpos = tl.load(POS + t * s_pos, mask=live, other=-1)
            filled = tl.minimum(tl.load(POS + (T - 1) * s_pos) + 1, cap)
            pos0 = tl.load(POS)  # rows at positions >= pos0 are (being) written by this forward
            if ONE > SPLIT_N:
                span = tl.where(filled <= ONE, ONE, SPLIT_N)
            else:
                span = SPLIT_N
            lo = sp * span
            n0 = lo + tl.arange(0, BLOCK)
            old = n0 < tl.minimum(pos0, filled)
            k0 = tl.load(K + kvh * s_kh + n0[None, :] * s_ks + d[:, None], mask=old[None, :], other=0.0)
            v0 = tl.load(V + kvh * s_vh + n0[:, None] * s_vs + d[None, :], mask=old[:, None], other=0.0)
        if PDL:  # programmatic dependent launch: wait for the previous kernel before any other access
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if not PRE:
            qpos = tl.load(POS + t * s_pos, mask=live, other=-1)  # [ROWS] position of each query row
            # keys at positions < filled exist; clamped so that a position past the cache can never
            # leave a slice counter unreset (every slice counted then exists)
            filled = tl.minimum(tl.load(POS + (T - 1) * s_pos) + 1, cap)
            pos0 = tl.load(POS)
            if ONE > SPLIT_N:  # up to ONE filled keys the first program takes them all (no merge)
                span = tl.where(filled <= ONE, ONE, SPLIT_N)
            else:
                span = SPLIT_N
            lo = sp * span
        slices = (filled + span - 1) // span  # slices holding keys; later programs idle
        if lo < filled:
            m_i = tl.full([ROWS], float("-inf"), tl.float32)
            l_i = tl.zeros([ROWS], tl.float32)
            acc = tl.zeros([ROWS, D], tl.float32)
            if ROPE:
                q = _rope_rows(Q, t * s_qt + (kvh * G + g) * D, QW, COS, SIN, t, s_cos, d, live, eps_q, D, NORM)
                q = q.to(Q.dtype.element_ty)
            else:
                q = tl.load(Q + (kvh * G + g)[:, None] * s_qh + t[:, None] * s_qt + d[None, :],
                            mask=live[:, None], other=0.0)  # fmt: skip
            hi = tl.minimum(lo + span, filled)
            first = lo
            if PRE:  # the first tile: the cached rows from before the wait, the fresh rows now
                fresh = (n0 >= pos0) & (n0 < filled)
                if ROPE:
                    k, v = k0, v0
                    if lo + BLOCK > pos0:
                        k, v = _fresh_kv(k, v, n0, fresh, pos0, Q, COS, SIN, KW, K, V, kvh, s_qt, s_cos,
                                         s_kh, s_ks, s_vh, s_vs, eps_k, d, G * HKV, HKV, D, NORM)  # fmt: skip
                else:
                    k1 = tl.load(K + kvh * s_kh + n0[None, :] * s_ks + d[:, None], mask=fresh[None, :], other=0.0)
                    v1 = tl.load(V + kvh * s_vh + n0[:, None] * s_vs + d[None, :], mask=fresh[:, None], other=0.0)
                    k, v = tl.where(old[None, :], k0, k1), tl.where(old[:, None], v0, v1)
                m_i, l_i, acc = _tile(q, k, v, n0, qpos, m_i, l_i, acc, scale_log2, IEEE)
                first = lo + BLOCK
            for start in range(first, hi, BLOCK):
                n = start + tl.arange(0, BLOCK)
                inside = n < filled  # rows past the filled length are never read
                if ROPE:
                    cached = inside & (n < pos0)
                else:
                    cached = inside
                # keys and values loaded together, before the scores: both in flight at once
                k = tl.load(K + kvh * s_kh + n[None, :] * s_ks + d[:, None], mask=cached[None, :],
                            other=0.0)  # [D, BLOCK]  # fmt: skip
                v = tl.load(V + kvh * s_vh + n[:, None] * s_vs + d[None, :], mask=cached[:, None],
                            other=0.0)  # [BLOCK, D]  # fmt: skip
                if ROPE:
                    if start + BLOCK > pos0:
                        k, v = _fresh_kv(k, v, n, inside & (n >= pos0), pos0, Q, COS, SIN, KW, K, V, kvh, s_qt,
                                         s_cos, s_kh, s_ks, s_vh, s_vs, eps_k, d, G * HKV, HKV, D, NORM)  # fmt: skip
                m_i, l_i, acc = _tile(q, k, v, n, qpos, m_i, l_i, acc, scale_log2, IEEE)
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            if MERGE:  # the capacity holds several slices (a constexpr: no merge code otherwise)
                if slices == 1:  # one slice holds every key: the result is final
                    _store_rows(OUT, acc / l_safe[:, None], kvh * G + g, t, d, live, s_oh, s_ot)
                else:  # publish this slice; the last slice of this unit to finish merges
                    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
                    tl.store(PO + unit * s_ph + sp * s_ps + r[:, None] * s_pr + d[None, :],
                             acc / l_safe[:, None])  # fmt: skip
                    tl.store(PL + unit * s_lh + sp * s_ls + r, lse)
                    tl.debug_barrier()  # every thread's stores precede the release below
                    done = tl.atomic_add(CNT + unit, 1, sem="acq_rel")
                    if done == slices - 1:
                        # every slice's log-sum-exps in one load (L2, .cg: other SMs wrote them)
                        js = tl.arange(0, NSP)
                        lses = tl.load(PL + unit * s_lh + js[:, None] * s_ls + r[None, :],
                                       mask=(js < slices)[:, None], other=float("-inf"),
                                       cache_modifier=".cg")  # [NSP, ROWS]  # fmt: skip
                        m = tl.max(lses, 0)
                        m = tl.where(m == float("-inf"), 0.0, m)
                        ws = tl.exp2(lses - m[None, :])  # [NSP, ROWS]; 0 past the slices
                        num = tl.zeros([ROWS, D], tl.float32)
                        den = tl.zeros([ROWS], tl.float32)
                        for j in range(0, slices):  # L2 reads (.cg) of the live rows
                            w = tl.sum(tl.where(js[:, None] == j, ws, 0.0), 0)
                            o = tl.load(PO + unit * s_ph + j * s_ps + r[:, None] * s_pr + d[None, :],
                                        mask=live[:, None], other=0.0, cache_modifier=".cg")  # fmt: skip
                            num += o * w[:, None]
                            den += w
                        den = tl.where(den == 0.0, 1.0, den)
                        _store_rows(OUT, num / den[:, None], kvh * G + g, t, d, live, s_oh, s_ot)
                        tl.atomic_xchg(CNT + unit, 0)  # ready for the next launch (and graph replay)
            else:
                _store_rows(OUT, acc / l_safe[:, None], kvh * G + g, t, d, live, s_oh, s_ot)


def _rows(groups: int, t: int) -> int:
    return max(16, triton.next_power_of_2(groups * t)) if triton is not None else max(16, groups * t)


_COUNTERS: dict = {}  # device -> int32 slice counters, zero between launches (the kernel resets them)
_RETIRED: list = []  # outgrown counters: graphs captured before may still point at them


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The per-unit slice counters of ``device`` (one per program of a slice: at least ``n``),
    made outside graph capture.

    Raises:
        RuntimeError: first use (or growth) while a CUDA graph is being captured; run the
            attention once before capturing (the static backend warms every graph up first).
    """
    key = (device.type, device.index)
    c = _COUNTERS.get(key)
    if c is None or c.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split_attention: call it once before capturing a CUDA graph "
                               "(its counters must be allocated and zeroed outside the graph)")  # fmt: skip
        if c is not None:
            _RETIRED.append(c)
        c = _COUNTERS[key] = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
    return c


def _out_like(q: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] in q's dtype, laid out as [1, T, H, D] (so ``.transpose(1, 2).reshape`` to
    [1, T, H*D] is a view)."""
    _, h, t, dim = q.shape
    return q.new_empty(1, t, h, dim).transpose(1, 2)


def split_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                           scale: float, split: int, heads_per_program: int = 0, block: int = 0,
                           warps: int = 0, stages: int = 0, one_slice: int = 0,
                           preload: bool = False) -> torch.Tensor:  # fmt: skip
    """Run the kernel: one launch, slices merged inside it (the last slice of each unit, a KV
    head's ``heads_per_program`` query heads, to
    finish merges, counted by an atomic counter that it resets).

    Args:
        q: [1, H, T, D] queries (any strides with a unit last stride).
        k, v: [1, Hkv, S, D] contiguous caches; S a multiple of ``split``.
        pos: [T] int64 positions of the query rows, ascending (the last is the largest); row t
            sees keys at positions <= pos[t]. [1]: one position for every row (read in place,
            any stride: a view of a longer tensor costs no copy).
        scale: softmax scale (e.g. 1/sqrt(D)).
        split: keys per program (a multiple of 64).
        heads_per_program: query heads of one KV head that a program takes (its greatest
            common divisor with the group size G is used; 0 = all G, one program per KV head
            and slice). Fewer heads: more
            programs, fewer padded rows (the rows are padded to a power of two >= 16).
        block: keys per inner iteration (0 = :data:`ITER_KEYS`), lowered to a power of two
            that divides ``split``. warps, stages: Triton's num_warps and num_stages (0 =
            Triton's defaults); for tuning sweeps.
        one_slice: while the filled length (the last position + 1) is at most this many keys
            (and this is more than ``split``), the first program of each unit takes every key
            and no merge runs; past it, slices of ``split`` keys. 0: always slices.
    Returns:
        [1, H, T, D] in q's dtype (memory laid out as [1, T, H, D]).

    Raises:
        ValueError: ``pos`` is neither [T] nor [1]; ``split`` does not divide S.

    Launches on one device must not touch the counters at the same time: true of one stream and
    of graphs replayed on one stream. With PDL (``DFLASH_PDL``) a launch may start while the
    kernel before it finishes, but it waits for that kernel before any memory access.
    """
    _, h, t, dim = q.shape
    if pos.dim() != 1 or pos.shape[0] not in (1, t):
        raise ValueError(f"split_attention: positions {tuple(pos.shape)} for {t} query rows (want [{t}] or [1])")
    q = q if q.stride(-1) == 1 else q.contiguous()
    return _launch(q, h, t, q.stride(1), q.stride(2), k, v, pos, scale, split, heads_per_program, block,
                   warps, stages, one_slice, preload, None)  # fmt: skip


def _launch(src, h, t, s_qh, s_qt, k, v, pos, scale, split, heads_per_program, block, warps, stages,
            one_slice, preload, rope) -> torch.Tensor:  # fmt: skip
    """Launch :func:`_split_kernel` on queries ``src`` (or, with ``rope`` = (q_w, k_w, eps_q,
    eps_k, cos [T, D], sin [T, D]), on the fused qkv projection ``src``)."""
    hkv, cap, dim = k.shape[1], k.shape[2], k.shape[3]
    if split <= 0 or cap % split:
        raise ValueError(f"split_attention: {split} keys per program do not tile a capacity of {cap}")
    groups, nsplit = h // hkv, cap // split
    gp = math.gcd(heads_per_program, groups) if heads_per_program > 0 else groups  # 0: all G
    units, rows = hkv * (groups // gp), _rows(gp, t)  # programs per slice, rows per program
    k, v = k.contiguous(), v.contiguous()  # no-ops for the caches
    s_pos = 0 if pos.shape[0] == 1 else pos.stride(0)  # [1]: every row reads the one position
    out = src.new_empty(1, t, h, dim).transpose(1, 2)  # [1, H, T, D] laid out as [1, T, H, D]
    pdl = pdl_enabled(src.device)
    po = torch.empty(units, nsplit, rows, dim, dtype=torch.float32, device=src.device)
    pl = torch.empty(units, nsplit, rows, dtype=torch.float32, device=src.device)
    tune = {k: v for k, v in (("num_warps", warps), ("num_stages", stages)) if v}
    nsp = triton.next_power_of_2(nsplit)  # the merge loads every slice's log-sum-exps at once
    blk = 1 << (min(block or ITER_KEYS, split).bit_length() - 1)  # a power of two (tl.arange)
    while split % blk:  # the iterations must tile each slice (a multiple of 64)
        blk //= 2
    q_w, k_w, eps_q, eps_k, cos, sin = rope if rope is not None else (None, None, 0.0, 0.0, src, src)
    norm = q_w is not None
    _split_kernel[(units, nsplit)](
        src, k, v, pos, out, po, pl, _counters(src.device, units), scale * math.log2(math.e), cap, s_pos,
        s_qh, s_qt, k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        out.stride(1), out.stride(2), po.stride(0), po.stride(1), po.stride(2),
        pl.stride(0), pl.stride(1), cos, sin, q_w if norm else src, k_w if norm else src,
        cos.stride(0), eps_q, eps_k,
        T=t, G=groups, GP=gp, D=dim, ROWS=rows, SPLIT_N=split, BLOCK=blk,
        IEEE=src.dtype == torch.float32, MERGE=nsplit > 1, PDL=pdl, ONE=one_slice if nsplit > 1 else 0,
        PRE=preload, NSP=nsp, ROPE=rope is not None, NORM=norm, HKV=hkv,
        **({"launch_pdl": True} if pdl else {}), **tune,
    )  # fmt: skip
    return out


def rope_attention_kernel(qkv: torch.Tensor, q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps_q: float,
                          eps_k: float, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, heads: int, scale: float, split: int, heads_per_program: int = 0,
                          block: int = 0, one_slice: int = 0, preload: bool = False, warps: int = 0,
                          stages: int = 0) -> torch.Tensor:  # fmt: skip
    """The q/k norm, RoPE and K/V cache writes of :func:`~dflash.backends.rope_cache.rope_cache`
    (no context rows) and :func:`split_attention_kernel` in one launch: each program norms and
    rotates its query rows, and the programs whose keys include this call's rows compute those
    keys, write them and the values into the caches and attend to them (programs of one KV head
    with other query heads write the same values).

    Args:
        qkv: [T, (H + 2 Hkv) * D] the fused qkv projection (unit last stride), T <= 32 rows at
            consecutive positions pos[0], pos[0] + 1, ... (the target's forwards).
        q_w, k_w: the q/k RMSNorm weights [D] (Qwen3), or both None; eps_q, eps_k their epsilons.
        cos, sin: [T, D] RoPE tables of the rows (unit last stride, same strides).
        pos: [T] int64 positions; k, v: [1, Hkv, S, D] caches, written at ``pos``.
        heads: H; scale, split, heads_per_program, block, one_slice, preload, warps, stages: as
            :func:`split_attention_kernel` (``preload``: the kernel before writes no cache row).
    Returns:
        [1, H, T, D] in qkv's dtype (laid out as [1, T, H, D]).

    Raises:
        ValueError: shapes or strides that do not fit, or as :func:`split_attention_kernel`.
    """
    t, width = qkv.shape
    hkv, dim = k.shape[1], k.shape[3]
    if width != (heads + 2 * hkv) * dim or qkv.stride(1) != 1 or cos.shape != (t, dim) or cos.stride(-1) != 1 \
            or sin.stride() != cos.stride() or pos.shape != (t,) or v.shape != k.shape:
        raise ValueError(f"rope_attention: qkv {tuple(qkv.shape)} (strides {qkv.stride()}) does not fit {heads} + 2 x "
                         f"{hkv} heads of {dim}, cos/sin {tuple(cos.shape)}, positions {tuple(pos.shape)}, caches "
                         f"{tuple(k.shape)} / {tuple(v.shape)}")  # fmt: skip
    return _launch(qkv, heads, t, dim, qkv.stride(0), k, v, pos, scale, split, heads_per_program, block, warps,
                   stages, one_slice, preload, (q_w, k_w, eps_q, eps_k, cos, sin))  # fmt: skip


def merge_partials(o: torch.Tensor, lse: torch.Tensor, heads: int, t: int, dtype) -> torch.Tensor:
    """Merge per-slice partials (o [Hkv, NS, R, D], lse [Hkv, NS, R], base 2) into
    [1, H, T, D] in ``dtype`` (the reference's merge; the kernel merges inside itself)."""
    hkv, nsplit, _, dim = o.shape
    groups = heads // hkv
    if nsplit == 1:  # one slice: already normalised
        return o[:, 0, : groups * t].reshape(1, heads, t, dim).to(dtype)
    m = lse.amax(1, keepdim=True)  # [Hkv, 1, R]
    w = torch.exp2(lse - m)  # [Hkv, NS, R]; 0 for empty slices
    out = (o * w[..., None]).sum(1) / w.sum(1)[..., None]  # [Hkv, R, D]
    return out[:, : groups * t].reshape(1, heads, t, dim).to(dtype)


@torch.library.custom_op("dflash::split_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                  scale: float, split: int, heads: int, block: int, one: int, pre: bool) -> torch.Tensor:  # fmt: skip
    return split_attention_kernel(q, k, v, pos, scale, split, heads, block, one_slice=one, preload=pre)


@_attention_op.register_fake
def _(q, k, v, pos, scale, split, heads, block, one, pre):
    return _out_like(q)


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                    scale: float | None, draft: bool = False, fresh: bool = False) -> torch.Tensor:  # fmt: skip
    """softmax(q k^T * scale) v over the keys at positions <= pos[t], per query row t.

    Args:
        q: [1, H, T, D]; k, v: [1, Hkv, S, D] caches indexed by position (S a multiple of
        the split size, :func:`split_size`); pos: [T] int64 positions of the query rows
        (ascending; the last is the largest: keys at positions > pos[-1] are never read);
        scale: None = 1/sqrt(D). Non-causal rows (a draft block that sees all of itself):
        give every row the block's last position, e.g. as a [1] view (``pos[-1:]``).
        draft: the draft's attention (its split size: :func:`split_size`).
        fresh: the kernel just before wrote only the cache rows at positions >= pos[0], and no
            position (the target's forwards after :func:`~dflash.backends.rope_cache.rope_cache`):
            then ``DFLASH_ATTN_PRELOAD`` (:func:`preload_setting`) may load the older rows
            before waiting for it.
    Returns:
        [1, H, T, D] in q's dtype.

    Raises:
        InputError: a bad ``DFLASH_ATTN_SPLIT`` (or ``DFLASH_DRAFT_ATTN_SPLIT`` for the draft) or
            ``DFLASH_ATTN_ONE_SLICE``, or on the kernel's path a bad ``DFLASH_ATTN_BLOCK`` or
            ``DFLASH_ATTN_PRELOAD``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if triton is None or (q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        # no kernel here (CPU, Triton absent or not interpreting): the same algorithm in torch
        dim = q.shape[-1]
        return split_attention_reference(q, k, v, pos, scale, split_size(k.shape[2], draft, dim),
                                         one_slice_setting(draft, dim))  # fmt: skip
    dim, groups, rows = q.shape[-1], q.shape[1] // k.shape[1], q.shape[2]
    return _attention_op(q, k, v, pos, float(scale), split_size(k.shape[2], draft, dim),
                         heads_per_program(groups, rows), iter_keys(), one_slice_setting(draft, dim),
                         fresh and preload_setting())  # fmt: skip


def split_attention_reference(q, k, v, pos, scale, split: int = SPLIT, one_slice: int = 0) -> torch.Tensor:
    """The kernel's algorithm in torch (slices, per-slice softmax, log-sum-exp merge): [1, H, T, D].

    For tests on machines without Triton; arguments as :func:`split_attention`, ``split`` and
    ``one_slice`` as :func:`split_attention_kernel`'s."""
    _, h, t, dim = q.shape
    hkv, cap = k.shape[1], k.shape[2]
    pos = pos.expand(t) if pos.shape[0] == 1 else pos  # [1]: one position for every row
    groups, filled, split = h // hkv, min(int(pos[-1]) + 1, cap), math.gcd(split, cap)  # clamped as the kernel
    if one_slice > split and filled <= one_slice:  # the first program takes every key
        split = cap
    scale = dim**-0.5 if scale is None else scale
    rows = _rows(groups, t)
    qr = q[0].float().reshape(hkv, groups * t, dim)  # row g*T + t of KV head kvh
    qpos = pos.repeat(groups)  # [G*T]
    o = torch.zeros(hkv, cap // split, rows, dim)
    lse = torch.full((hkv, cap // split, rows), float("-inf"))
    for sp in range(cap // split):
        lo, hi = sp * split, min((sp + 1) * split, filled)
        if lo >= hi:
            continue
        keys = torch.arange(lo, hi)
        s = qr @ k[0, :, lo:hi].float().transpose(1, 2) * scale * math.log2(math.e)  # [Hkv, GT, n]
        s = s.masked_fill(keys[None, None, :] > qpos[None, :, None], float("-inf"))
        m = s.amax(-1, keepdim=True)
        p = torch.exp2(s - torch.where(m == float("-inf"), 0.0, m))  # 0 for rows with no key
        den = p.sum(-1, keepdim=True)
        o[:, sp, : groups * t] = (p @ v[0, :, lo:hi].float()) / den.clamp(min=1e-30)
        lse[:, sp, : groups * t] = torch.where(den[..., 0] > 0, m[..., 0] + torch.log2(den[..., 0]),
                                               float("-inf"))  # fmt: skip
    return merge_partials(o, lse, h, t, q.dtype)
