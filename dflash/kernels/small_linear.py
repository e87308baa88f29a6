"""Output projections over a few rows (decode and verify, M <= 32) with the residual add fused.

A block-1 step of the demo target on the H200 is a chain of small kernels, and a cuBLAS GEMV
over a 0.7 MB weight took ~3.1 us while the weight streams in ~0.2 us. This Triton kernel
computes ``residual + x @ W^T (+ bias)`` in one launch; each program owns ``BN`` output columns
and streams their weight rows along K (row major, coalesced), with the few input rows padded to
a 16-row tensor-core tile. The static forwards use it for each layer's o_proj and down_proj
(the two projections followed by a residual add) and for the draft's context projection fc.

Measured on the H200 (``scripts/small_linear_sweep.py``, bf16, CUDA graphs of 50 calls): o_proj
2.9 vs 3.1 us (demo) and 7.8 vs 10.3 us (Qwen3-8B shape); down_proj 3.8-4.4 vs 4.7 us and
26.8 vs 29.7 us.

Where the gate+up projection runs this kernel, SiLU(gate) * up is its epilogue
(:func:`small_linear_glu`, ``DFLASH_GLU``, seventeenth session): each program takes the same
output columns of the gate rows and of the up rows in one [2 BN, BK] weight tile, so the
activation needs no kernel of its own. H200, one machine, against ``DFLASH_GLU=0``: demo loop
steps at prompt 300 0.880 -> 0.831 ms (block 16) and 0.691 -> 0.649 ms (block 1), the draft
graph 0.154 -> 0.147 ms; Qwen3-8B's block 1 4.319 -> 4.240 ms.

The RMSNorm in front of an in-projection runs inside it where ``DFLASH_FUSE_NORM`` says so
(:func:`small_linear_rn`, eighteenth session: the norm's weight folded into the projection's,
the row factor on the accumulator; see :func:`fuse_norm_setting` for the measurements).

Fusing more was tried and removed: an RMSNorm prologue (two-pass, or one pass with the norm as
a row scale) and, with it, a first SwiGLU epilogue (2026-12-01, before this kernel's
in-projection tiles) made qkv and gate+up 1.5-2.5x slower than cuBLAS plus Inductor's fused
norm kernel, and a whole block-1 step 8-30% slower. SiLU(gate) * up computed while loading the down
projection's input (``DFLASH_FUSE_SILU``, twelfth session: every program recomputes the whole
activation) made the demo-shaped loop steps 2.2x slower and an 8B-shaped block-1 step 12.7
against 4.5 ms; removed. A wider first weight tile loaded before the PDL wait (``DFLASH_PDL_TILE``, up
to 32-128 KiB per program, seventeenth session) made the demo loop steps 0.880 -> 0.952 ms
(block 16) and 0.695 -> 0.735 ms (block 1) and Qwen3-8B's block 1 4.50 -> 5.14 ms at 64 KiB;
removed (``benchmarks/results/h200-v17``).

Rounding is the unfused ops': the product rounded to the input dtype, then added to the residual
(float32 inputs use exact fp32 dots, no TF32). On by default on CUDA with Triton for forwards
of at most :data:`MAX_ROWS` rows (``DFLASH_LINEAR=auto``, which also takes the fused qkv and
gate+up projections, see :func:`linear_mode`); ``DFLASH_LINEAR=torch`` keeps cuBLAS. Whole steps of a random demo-shaped pair (``scripts/bench_big.py --shape smollm2``, H200,
three runs side by side): block 1 0.987 ms against 1.007 / 1.010 ms, block 16 1.271 ms against
1.298 / 1.294 ms.
:func:`small_linear_reference` is the same maths in torch (CPU, tests); ``TRITON_INTERPRET=1``
runs the kernel on CPU.

The host-side settings (``DFLASH_LINEAR``, ``DFLASH_GLU``, ``DFLASH_FUSE_NORM``,
``DFLASH_PDL_PREFETCH``, :func:`kernel_config`) live in :mod:`dflash.kernels.linear_settings`
and the PDL switch with its process state in :mod:`dflash.kernels.pdl`; their public names
are re-exported here.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from dflash.kernels.linear_settings import (  # noqa: F401 - re-exported
    CONFIG_ENV,
    FUSE_NORM_AUTO_MAX_K,
    FUSE_NORM_ENV,
    GLU_ENV,
    LINEAR_ENV,
    PRELOAD_ENV,
    SMEM_BUDGET,
    TUNED,
    fuse_norm_auto,
    fuse_norm_setting,
    glu_setting,
    kernel_config,
    linear_mode,
    preload_bytes,
    preload_columns,
)
from dflash.kernels.pdl import (  # noqa: F401 - re-exported
    PDL_ENV,
    PDL_VALUES,
    disable_pdl,
    pdl_enabled,
    pdl_part,
    pdl_setting,
)

MAX_ROWS = 32  # rows (M) the kernel takes; longer forwards (prefill) use torch
ONE_TILE_ENV = "DFLASH_LINEAR_ONE_TILE"
ONE_TILE_MAX_K = 1024  # K up to this in one tile (the x and weight tiles stay in registers)


def one_tile_setting() -> bool:
    """``DFLASH_LINEAR_ONE_TILE`` (an experiment, off by default): plain projections (no norm
    inside, no SiLU epilogue) with K <= :data:`ONE_TILE_MAX_K` take all of K in one tile: a
    program's whole weight slice loads before the PDL wait, x and the residual in one round trip
    after it, where the K loop waits on three (the first x tile, the rest of K, the residual).
    ``1`` on, unset or ``0`` off. H200, demo shapes at prompt 300 (twenty-sixth session,
    ``benchmarks/results/h200-v26/5-one-tile``): verify-1 graph 0.537 against 0.562 ms, block-1
    loop step 0.556 against 0.580, block-16 step 0.735 against 0.757; off by default until the
    real pair's bf16 parity is checked.

    Raises:
        InputError: another value.
    """
    raw = os.environ.get(ONE_TILE_ENV, "").strip()
    if raw not in ("", "0", "1"):
        from dflash.errors import InputError

        raise InputError(f"{ONE_TILE_ENV} must be 1 or 0, got {raw!r}.", hint="unset it for the default (0)")
    return raw == "1"

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


if triton is not None:

    @triton.jit
    def _prefetch_rows(W, rn, n_ok, k_from, k_to, s_wn, LINE: tl.constexpr, LINES: tl.constexpr):
        """PTX ``prefetch.global.L2`` of weight rows ``rn``, columns k_from..k_to, one per
        128-byte line (``LINE`` elements), ``LINES`` lines of every row per pass."""
        rows = tl.where(n_ok, rn, 0)  # rows past N prefetch row 0 again (harmless)
        for k0 in range(k_from, k_to, LINE * LINES):
            col = tl.minimum(k0 + tl.arange(0, LINES) * LINE, k_to - 1)
            ptr = W + rows[:, None] * s_wn + col[None, :]
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptr],
                                      dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip

    @triton.jit
    def _add_squares(sq, x, IEEE: tl.constexpr, RN: tl.constexpr):
        """``RN``: x's squares added to the running sums as x x^T into ``sq`` ([BM, BM], its
        diagonal the rows' sums). Float32 elementwise squares into a [BM, BK] tile instead were
        slower on the H200 (demo verify-1 0.593 -> 0.681 ms, Qwen3-8B block 1 4.73 -> 6.53 ms)."""
        if RN and IEEE:
            sq += tl.dot(x, tl.trans(x), input_precision="ieee")
        elif RN:
            sq += tl.dot(x, tl.trans(x))
        return sq

    @triton.jit
    def _partial_sums(SQ, NP, S_SQ, rm, m_ok, PP: tl.constexpr):
        """Each row's sum of the ``NP`` partial sums of squares SQ[p, row] (p < NP <= PP) that
        the previous kernel wrote (:func:`small_linear_sq`), in one fixed order."""
        p = tl.arange(0, PP)
        parts = tl.load(SQ + p[:, None] * S_SQ + rm[None, :], mask=(p < NP)[:, None] & m_ok[None, :], other=0.0)
        return tl.sum(parts, 0)

    @triton.jit
    def _rows_times_weight(X, W, rm, rn, m_ok, n_ok, K, s_xm, s_wn, IEEE: tl.constexpr, BM: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, PRE_K=0,
                           LINE: tl.constexpr = 64, RN: tl.constexpr = False, EPS=0.0, SQ=0, NP=0, S_SQ=0,
                           RNP: tl.constexpr = False, PP: tl.constexpr = 1):  # fmt: skip
        """x[rm, :] @ W[rn, :]^T in float32 ([BM, BN]), streaming the weight rows along K; with
        PDL the first weight tile is loaded before waiting for the previous kernel, and (``PRE_K``
        > 0, ``DFLASH_PDL_PREFETCH``) columns BK..PRE_K of the rows are sent to L2 meanwhile
        (shared by this module's kernel and :mod:`dflash.kernels.head_argmax`). ``RN``: the
        product scaled by each x row's RMS factor rsqrt(mean(x^2) + ``EPS``), the sums of
        squares taken from the tiles as they pass (the diagonal of x x^T on the tensor cores);
        ``RNP``: the same factor from the previous kernel's partial sums (:func:`_partial_sums`)."""
        acc = tl.zeros([BM, BN], tl.float32)
        sq = tl.zeros([BM, BM], tl.float32)  # RN: x x^T, its diagonal the rows' sums of squares
        ss = tl.zeros([BM], tl.float32)  # RNP: the rows' sums of squares
        k_first = 0
        if RNP:
            if not PDL:
                ss = _partial_sums(SQ, NP, S_SQ, rm, m_ok, PP)
        if PDL:  # the first weight tile does not depend on the previous kernel: load it first
            rk0 = tl.arange(0, BK)  # own names: the loop's values are not carried from here
            k_ok0 = rk0 < K
            w0 = tl.load(W + rn[:, None] * s_wn + rk0[None, :], mask=n_ok[:, None] & k_ok0[None, :], other=0.0)
            if PRE_K > BK:
                _prefetch_rows(W, rn, n_ok, BK, PRE_K, s_wn, LINE, 16)  # 16 lines a pass
            tl.extra.cuda.gdc_wait()  # the previous kernel is done: x (and a residual) are ready
            tl.extra.cuda.gdc_launch_dependents()
            if RNP:
                ss = _partial_sums(SQ, NP, S_SQ, rm, m_ok, PP)
            x0 = tl.load(X + rm[:, None] * s_xm + rk0[None, :], mask=m_ok[:, None] & k_ok0[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(x0, tl.trans(w0), input_precision="ieee")
            else:
                acc += tl.dot(x0, tl.trans(w0))
            sq = _add_squares(sq, x0, IEEE, RN)
            k_first = BK
        for k0 in range(k_first, K, BK):
            rk = k0 + tl.arange(0, BK)
            k_ok = rk < K
            x = tl.load(X + rm[:, None] * s_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W + rn[:, None] * s_wn + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
            sq = _add_squares(sq, x, IEEE, RN)
        if RN:
            eye = tl.arange(0, BM)[:, None] == tl.arange(0, BM)[None, :]
            ssq = tl.sum(tl.where(eye, sq, 0.0), 1)
            acc = acc * tl.rsqrt(ssq / K + EPS)[:, None]
        if RNP:
            acc = acc * tl.rsqrt(ss / K + EPS)[:, None]
        return acc

    @triton.jit
    def _small_linear_kernel(X, W, B, RES, Y, M, N, K, s_xm, s_wn, s_rm, s_ym, PRE_K, HAS_BIAS: tl.constexpr,
                             HAS_RES: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
                             LINE: tl.constexpr, GLU: tl.constexpr, RN: tl.constexpr, EPS,
                             SQO, SQ, NP, S_SQ, HAS_SQO: tl.constexpr, RNP: tl.constexpr, PP: tl.constexpr,
                             KT: tl.constexpr = 0):  # fmt: skip
        rm = tl.arange(0, BM)
        m_ok = rm < M
        if GLU:  # W holds [gate; up] (2N rows): this program's N columns of each, side by side
            r = tl.arange(0, 2 * BN)
            rn = tl.program_id(0) * BN + r % BN  # output column of each weight row taken
            n_ok2 = rn < N
            wrow = tl.where(r < BN, rn, rn + N)
            acc2 = _rows_times_weight(X, W, rm, wrow, m_ok, n_ok2, K, s_xm, s_wn, IEEE, BM, 2 * BN, BK, PDL,
                                      PRE_K, LINE, RN, EPS, SQ, NP, S_SQ, RNP, PP)  # [BM, 2 BN]: gate, then up  # fmt: skip
            if HAS_BIAS:
                acc2 += tl.load(B + wrow, mask=n_ok2, other=0.0).to(tl.float32)[None, :]
            # the projection's outputs rounded as F.linear's, then SiLU(gate) * up in float32
            # rounded once (as Inductor's fused kernel)
            g, u = tl.split(tl.permute(tl.reshape(acc2.to(Y.dtype.element_ty).to(tl.float32), [BM, 2, BN]),
                                       [0, 2, 1]))  # fmt: skip
            acc = g * tl.sigmoid(g) * u
            rn = tl.program_id(0) * BN + tl.arange(0, BN)
            n_ok = rn < N
        else:
            rn = tl.program_id(0) * BN + tl.arange(0, BN)  # output columns of this program
            n_ok = rn < N
            if KT > 0:  # DFLASH_LINEAR_ONE_TILE: all of K in one tile, the weights before the wait,
                # x and the residual in one round trip after it (no RN/RNP/GLU/PRE_K: see _launch)
                rk = tl.arange(0, KT)
                k_ok = rk < K
                w = tl.load(W + rn[:, None] * s_wn + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                if PDL:
                    tl.extra.cuda.gdc_wait()
                    tl.extra.cuda.gdc_launch_dependents()
                x = tl.load(X + rm[:, None] * s_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                if HAS_RES:
                    r_early = tl.load(RES + rm[:, None] * s_rm + rn[None, :], mask=m_ok[:, None] & n_ok[None, :],
                                      other=0.0)  # fmt: skip
                if IEEE:
                    acc = tl.dot(x, tl.trans(w), input_precision="ieee")
                else:
                    acc = tl.dot(x, tl.trans(w))
            else:
                acc = _rows_times_weight(X, W, rm, rn, m_ok, n_ok, K, s_xm, s_wn, IEEE, BM, BN, BK, PDL, PRE_K,
                                         LINE, RN, EPS, SQ, NP, S_SQ, RNP, PP)  # fmt: skip
            if HAS_BIAS:
                acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = acc.to(Y.dtype.element_ty)
        ym = m_ok[:, None] & n_ok[None, :]
        if HAS_RES:  # torch: residual + linear(...) adds two rounded tensors
            if KT > 0 and not GLU:
                r = r_early
            else:
                r = tl.load(RES + rm[:, None] * s_rm + rn[None, :], mask=ym, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(Y.dtype.element_ty)
        tl.store(Y + rm[:, None] * s_ym + rn[None, :], y, mask=ym)
        if HAS_SQO:  # this program's share of each row's sum of squares, for the next kernel's norm
            yf = y.to(tl.float32)
            tl.store(SQO + tl.program_id(0) * M + rm, tl.sum(tl.where(ym, yf * yf, 0.0), 1), mask=m_ok)


def _launch(x, weight, bias, residual, glu: bool = False, rn_eps: float | None = None,
            sq: torch.Tensor | None = None, sq_out: bool = False):  # fmt: skip
    """One kernel launch: y [M, N]; ``rn_eps``: the product scaled by x's rows' RMS factors
    rsqrt(mean(x^2) + rn_eps) (see :func:`small_linear_rn`), the sums of squares from ``sq``
    ([P, M] partial sums, :mod:`dflash.kernels.norm_partials`) when given; ``sq_out``: (y,
    [P, M] float32 partial sums of y's squares, P = the programs)."""
    m = x.shape[0]
    rows, k = weight.shape
    if m > MAX_ROWS:  # one tile of rows per program
        raise ValueError(f"small_linear: {m} rows, at most {MAX_ROWS}")
    if x.shape[1] != k or x.stride(1) != 1 or (glu and rows % 2):
        raise ValueError(f"small_linear: input {tuple(x.shape)} (strides {x.stride()}) does not fit "
                         f"weight {tuple(weight.shape)}{' (gate and up halves)' if glu else ''}")  # fmt: skip
    n = rows // 2 if glu else rows  # output columns
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = kernel_config(m, rows, k, weight.element_size())  # tiles by the weight read
    if glu:  # each program takes bn weight rows: bn // 2 columns of gate and of up
        bn //= 2
    pdl = pdl_enabled(x.device)
    elem = weight.element_size()
    pre_k = preload_columns(rows, k, bk, elem, preload_bytes()) if pdl else 0
    programs = triton.cdiv(n, bn)
    kt = (triton.next_power_of_2(k) if one_tile_setting() and not glu and rn_eps is None and sq is None
          and not pre_k and k <= ONE_TILE_MAX_K else 0)  # fmt: skip
    sqo = torch.empty(programs, m, dtype=torch.float32, device=x.device) if sq_out else y
    _small_linear_kernel[(programs,)](
        x, weight, bias if bias is not None else y, residual if residual is not None else y, y, m, n, k,
        x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0), pre_k,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, IEEE=x.dtype == torch.float32,
        BM=bm, BN=bn, BK=bk, PDL=pdl, LINE=128 // elem, GLU=glu, RN=rn_eps is not None and sq is None,
        EPS=float(rn_eps or 0.0), SQO=sqo, SQ=sq if sq is not None else y, NP=sq.shape[0] if sq is not None else 0,
        S_SQ=sq.stride(0) if sq is not None else 0, HAS_SQO=sq_out, RNP=sq is not None,
        PP=triton.next_power_of_2(sq.shape[0]) if sq is not None else 1, KT=kt,
        num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return (y, sqo) if sq_out else y


@torch.library.custom_op("dflash::small_linear", mutates_args=())
def _small_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     residual: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    return _launch(x, weight, bias, residual)


@_small_linear_op.register_fake
def _(x, weight, bias, residual):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("dflash::small_linear_glu", mutates_args=())
def _small_linear_glu_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _launch(x, weight, bias, None, glu=True)


@_small_linear_glu_op.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


@torch.library.custom_op("dflash::small_linear_rn", mutates_args=())
def _small_linear_rn_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                        glu: bool) -> torch.Tensor:  # fmt: skip
    return _launch(x, weight, bias, None, glu=glu, rn_eps=eps)


@_small_linear_rn_op.register_fake
def _(x, weight, bias, eps, glu):
    return x.new_empty(x.shape[0], weight.shape[0] // 2 if glu else weight.shape[0])


def _on_cpu(x: torch.Tensor) -> bool:
    """Whether the torch references run instead of the kernel: no Triton, or off CUDA unless
    ``TRITON_INTERPRET=1``."""
    return triton is None or (x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1")


def small_linear_rn_reference(x, weight, bias=None, eps: float = 1e-6, glu: bool = False) -> torch.Tensor:
    """:func:`small_linear_rn`'s maths in torch ops: the float32 product scaled by the rows' RMS
    factors, the bias added, rounded to x's dtype (``glu``: then SiLU(gate) * up in float32,
    rounded once)."""
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (F.linear(xf, weight.float()) * r + (bias.float() if bias is not None else 0.0)).to(x.dtype)
    return _silu_times_up(y) if glu else y


def small_linear_rn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    eps: float = 1e-6, glu: bool = False) -> torch.Tensor:
    """``linear(RMSNorm(x), W, bias)`` in one kernel, the norm's weight g folded into the
    projection beforehand (``weight`` = W * g per input column, :func:`fold_norm_weight`): the
    norm's row factor r = rsqrt(mean(x^2) + eps) commutes with the product, so the kernel streams
    the raw rows, takes their sums of squares from the same tiles (the diagonal of x x^T on
    the tensor cores) and scales its float32 accumulator by r before the bias and the rounding;
    the RMSNorm's kernel is gone. Roundings differ from the module's (x * r and g * that are not
    rounded to x's dtype; W * g is, once): about one unit of x's dtype in the last place.
    ``glu``: :func:`small_linear_glu`'s SiLU(gate) * up epilogue.

    Args:
        x: [M, K] (the residual stream, un-normed), unit last stride; M <= :data:`MAX_ROWS`.
        weight: [N, K] (``glu``: [2N, K], gate rows then up rows), the norm's weight folded in;
            bias: [N] (or [2N]) or None.
        eps: the norm's epsilon.
    Returns:
        [M, N] in x's dtype. Off CUDA (or Triton absent and not interpreting)
        :func:`small_linear_rn_reference` runs instead.

    Raises:
        ValueError: shapes that do not fit.
    """
    if glu and weight.shape[0] % 2:
        raise ValueError(f"small_linear: weight {tuple(weight.shape)} does not split into gate and up halves")
    if _on_cpu(x):
        return small_linear_rn_reference(x, weight, bias, eps, glu)
    return _small_linear_rn_op(x, weight, bias, float(eps), glu)


def fold_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """A new [N, K] weight ``weight * norm_weight`` (per input column, in float32, rounded to
    weight's dtype once) for :func:`small_linear_rn`."""
    return (weight.float() * norm_weight.float()[None, :]).to(weight.dtype).contiguous()


def small_linear_glu_reference(x, weight, bias=None) -> torch.Tensor:
    """The unfused maths of :func:`small_linear_glu` in torch ops: the projection rounded to x's
    dtype, then SiLU(gate) * up in float32 rounded once (as Inductor fuses it)."""
    return _silu_times_up(F.linear(x, weight, bias))


def _silu_times_up(y: torch.Tensor) -> torch.Tensor:
    """[M, 2N] projection outputs (gate columns, then up) -> SiLU(gate) * up [M, N], in float32
    rounded once to y's dtype: the references' epilogue."""
    g, u = y.chunk(2, dim=-1)
    return (F.silu(g.float()) * u.float()).to(y.dtype)


def small_linear_glu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A SwiGLU MLP's first half, ``SiLU(x @ gate^T) * (x @ up^T)``, in one kernel: each
    program takes the same output columns of the gate and the up rows, so the activation is an
    epilogue and its kernel (and the [M, 2N] intermediate) is gone.

    Args:
        x: [M, K], unit last stride; M <= :data:`MAX_ROWS`.
        weight: [2N, K], the gate rows then the up rows (a fused gate+up projection); bias: [2N]
            or None.
    Returns:
        [M, N] in x's dtype. Off CUDA (or Triton absent and not interpreting)
        :func:`small_linear_glu_reference` runs instead.

    Raises:
        ValueError: x does not fit the weight, or the weight has an odd number of rows.
    """
    if weight.shape[0] % 2:
        raise ValueError(f"small_linear: weight {tuple(weight.shape)} does not split into gate and up halves")
    if _on_cpu(x):
        return small_linear_glu_reference(x, weight, bias)
    return _small_linear_glu_op(x, weight, bias)


def small_linear_reference(x, weight, bias=None, residual=None) -> torch.Tensor:
    """The unfused maths (linear, then the residual add) in torch ops; args as :func:`small_linear`."""
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``residual + linear(x, weight, bias)`` in one kernel.

    Args:
        x: [M, K], unit last stride; M <= :data:`MAX_ROWS`.
        weight: [N, K] row-major (an ``nn.Linear`` weight); bias: [N] or None.
        residual: [M, N] added to the result, or None.
    Returns:
        [M, N] in x's dtype. Off CUDA (or Triton absent and not interpreting)
        :func:`small_linear_reference` runs instead.
    """
    if _on_cpu(x):
        return small_linear_reference(x, weight, bias, residual)
    return _small_linear_op(x, weight, bias, residual)
