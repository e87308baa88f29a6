"""Linear layers over a few rows (decode and verify, M <= 32) with their neighbours fused in.

A block-1 step of the demo target on the H200 ran about 13 kernels per layer, and a cuBLAS GEMV
over a 1 MB weight took ~3.8 us while the weight itself streams in ~0.3 us: at these sizes every
step is a chain of kernel latencies. This Triton kernel computes

    y = residual + (prologue(x) @ W^T + bias)

in one launch, where the prologue is nothing or the RMSNorm that precedes the projection, and
with a fused gate+up weight the epilogue is the SwiGLU product ``silu(gate) * up`` (the program
that owns output column j computes gate row j and up row j). A decoder layer's four projections
then absorb its two RMSNorms, the SwiGLU product and both residual adds, and the final norm goes
into the LM head. Each program owns ``BN`` output columns and streams their weight rows along K
(row major, coalesced); the few input rows are padded to a 16-row tensor-core tile.

The RMSNorm is applied as a row scale after the dot, ``((x * g) @ W^T) * rstd``, with the sum of
squares taken in the same pass over x (no second pass before the matmul can start); the module
computes ``(g * (x * rstd).to(dtype)) @ W^T``. In float32 the two agree to rounding; in bf16
they differ by the rounding of the normed input (one bf16 ulp per element), the size of any
kernel change. Everything else (SwiGLU, residual) rounds where torch rounds; float32 inputs use
exact fp32 dots (no TF32).

``DFLASH_LINEAR=torch`` turns it off (cuBLAS plus Inductor's fused elementwise kernels);
``auto`` (default) uses it for forwards of at most :data:`MAX_ROWS` rows on CUDA with Triton.
:func:`small_linear_reference` is the same maths in torch (CPU, tests); ``TRITON_INTERPRET=1``
runs the kernel on CPU.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

LINEAR_ENV = "DFLASH_LINEAR"
CONFIG_ENV = "DFLASH_LINEAR_CONFIG"  # "BN,BK,warps,stages" for every shape (benchmark sweeps)
MAX_ROWS = 32  # rows (M) the kernel takes; longer forwards (prefill) use torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def linear_mode(device: torch.device) -> str:
    """``DFLASH_LINEAR``: ``auto`` (default; the kernel for forwards of <= MAX_ROWS rows) or
    ``torch`` (never). Without CUDA or Triton it is always ``torch``.

    Raises:
        InputError: another value.
    """
    from dflash.errors import InputError

    raw = os.environ.get(LINEAR_ENV, "").strip().lower() or "auto"
    if raw not in ("auto", "torch"):
        raise InputError(f"{LINEAR_ENV} must be auto or torch, got {raw!r}.",
                         hint="unset it for the default (auto)")  # fmt: skip
    return raw if device.type == "cuda" and triton is not None else "torch"


def kernel_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) for an [m, k] x [n, k]^T product (n output columns).

    From a sweep on the H200 (``scripts/small_linear_sweep.py``): 16 columns per program up to
    1,024 columns, 32 up to 4,096, 64 beyond; ``DFLASH_LINEAR_CONFIG="BN,BK,warps,stages"``
    overrides all but BM.

    Raises:
        InputError: a malformed ``DFLASH_LINEAR_CONFIG``.
    """
    bm = 16 if m <= 16 else 32
    raw = os.environ.get(CONFIG_ENV, "").strip()
    if raw:
        from dflash.errors import InputError

        parts = raw.split(",")
        if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
            raise InputError(f"{CONFIG_ENV} must be BN,BK,warps,stages, got {raw!r}.",
                             hint="e.g. 32,256,4,3; unset it for the built-in choice")  # fmt: skip
        bn, bk, warps, stages = (int(p) for p in parts)
        return bm, bn, bk, warps, stages
    bn = 16 if n <= 1024 else 32 if n <= 4096 else 64  # best in the H200 sweep (2026-12-01)
    bk = 128 if k <= 1024 else 256
    warps, stages = (8, 3) if bn == 64 else (4, 4)
    return bm, bn, bk, warps, stages


if triton is not None:

    @triton.jit
    def _small_linear_kernel(X, W, B, NW, RES, Y, M, N, K, HALF, eps, s_xm, s_wn, s_rm, s_ym,
                             HAS_NORM: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr,
                             HAS_RES: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        rn = tl.program_id(0) * BN + tl.arange(0, BN)  # output columns of this program
        rm = tl.arange(0, BM)
        m_ok = rm < M
        n_ok = rn < N
        dtype = Y.dtype.element_ty
        ss = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            k_ok = rk < K
            x = tl.load(X + rm[:, None] * s_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if HAS_NORM:  # RMSNorm as a row scale after the dot: (x * g) @ W^T * rstd
                xf = x.to(tl.float32)
                ss += tl.sum(xf * xf, 1)
                x = (xf * tl.load(NW + rk, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(dtype)
            wm = n_ok[:, None] & k_ok[None, :]
            w = tl.load(W + rn[:, None] * s_wn + rk[None, :], mask=wm, other=0.0)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
            if GLU:  # the up rows sit HALF rows below the gate rows
                wu = tl.load(W + (HALF + rn)[:, None] * s_wn + rk[None, :], mask=wm, other=0.0)
                if IEEE:
                    acc_u += tl.dot(x, tl.trans(wu), input_precision="ieee")
                else:
                    acc_u += tl.dot(x, tl.trans(wu))
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt(ss / K + eps)
            acc = acc * rstd[:, None]
            acc_u = acc_u * rstd[:, None]
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GLU:
                acc_u += tl.load(B + HALF + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = acc.to(dtype)
        if GLU:  # torch rounds gate, up, silu(gate) and the product
            gf = y.to(tl.float32)
            a = (gf / (1.0 + tl.exp(-gf))).to(dtype).to(tl.float32)
            y = (a * acc_u.to(dtype).to(tl.float32)).to(dtype)
        ym = m_ok[:, None] & n_ok[None, :]
        if HAS_RES:  # torch: residual + linear(...) adds two rounded tensors
            r = tl.load(RES + rm[:, None] * s_rm + rn[None, :], mask=ym, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(dtype)
        tl.store(Y + rm[:, None] * s_ym + rn[None, :], y, mask=ym)


def _launch(x, weight, bias, norm_weight, residual, eps: float, glu: bool) -> torch.Tensor:
    m = x.shape[0]
    rows, k = weight.shape
    n = rows // 2 if glu else rows  # output columns
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = kernel_config(m, n, k)
    dummy = y  # never read when its flag is off
    _small_linear_kernel[(triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else dummy, norm_weight if norm_weight is not None else dummy,
        residual if residual is not None else dummy, y, m, n, k, n, eps,
        x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
        HAS_NORM=norm_weight is not None, GLU=glu, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, IEEE=x.dtype == torch.float32, BM=bm, BN=bn, BK=bk,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


@torch.library.custom_op("dflash::small_linear", mutates_args=())
def _small_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     norm_weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float,
                     glu: bool) -> torch.Tensor:  # fmt: skip
    return _launch(x, weight, bias, norm_weight, residual, eps, glu)


@_small_linear_op.register_fake
def _(x, weight, bias, norm_weight, residual, eps, glu):
    return x.new_empty(x.shape[0], weight.shape[0] // 2 if glu else weight.shape[0])


def small_linear_reference(x, weight, bias=None, norm_weight=None, residual=None, eps: float = 1e-6,
                           glu: bool = False) -> torch.Tensor:  # fmt: skip
    """The unfused modules' maths (norm module, linear, SwiGLU, residual add) in torch ops; args
    as :func:`small_linear`."""
    if norm_weight is not None:
        xf = x.float()
        x = norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = F.linear(x, weight, bias)
    if glu:
        g, u = y.chunk(2, dim=-1)
        y = F.silu(g) * u
    return y if residual is None else residual + y


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 eps: float = 1e-6, glu: bool = False) -> torch.Tensor:  # fmt: skip
    """``residual + glu(linear(rms_norm(x), weight, bias))`` in one kernel.

    Args:
        x: [M, K], unit last stride; M <= :data:`MAX_ROWS`.
        weight: [N, K] row-major (an ``nn.Linear`` weight); bias: [N] or None.
        norm_weight: [K] RMSNorm weight applied to x first (epsilon ``eps``), or None.
        residual: [M, N'] added to the result, or None.
        glu: ``weight`` stacks gate rows over up rows (a fused gate+up projection, N = 2I); the
            result is ``silu(gate) * up`` [M, I].
    Returns:
        [M, N'] in x's dtype (N' = N, or N/2 with ``glu``). Off CUDA (or Triton absent and not
        interpreting) :func:`small_linear_reference` runs instead.
    """
    if triton is None or (x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        return small_linear_reference(x, weight, bias, norm_weight, residual, eps, glu)
    return _small_linear_op(x, weight, bias, norm_weight, residual, float(eps), glu)
