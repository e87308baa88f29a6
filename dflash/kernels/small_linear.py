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
(:func:`small_linear_glu`, the ``glu`` setting): each program takes the same output columns of
the gate rows and of the up rows in one [2 BN, BK] weight tile, so the activation needs no
kernel of its own. H200, one machine, against the activation as its own kernel: demo loop steps
at prompt 300 0.880 -> 0.831 ms (block 16) and 0.691 -> 0.649 ms (block 1), the draft graph
0.154 -> 0.147 ms; Qwen3-8B's block 1 4.319 -> 4.240 ms.

The RMSNorm in front of an in-projection runs inside it where the ``fuse_norm`` setting says so
(:func:`small_linear_rn`: the norm's weight folded into the projection's, the row factor on the
accumulator; see :func:`fuse_norm_auto` for the measurements).

Fusing more was tried and removed: an RMSNorm prologue (two-pass, or one pass with the norm as
a row scale) made qkv and gate+up 1.5-2.5x slower than cuBLAS plus Inductor's fused norm
kernel; SiLU(gate) * up computed while loading the down projection's input made the demo-shaped
loop steps 2.2x slower; a wider first weight tile loaded before the PDL wait made the demo loop
steps 0.880 -> 0.952 ms (block 16).

Rounding is the unfused ops': the product rounded to the input dtype, then added to the residual
(float32 inputs use exact fp32 dots, no TF32). On by default on CUDA with Triton for forwards
of at most :data:`MAX_ROWS` rows (the ``linear`` setting ``auto``, which also takes the fused
qkv and gate+up projections, see :func:`linear_mode`); ``torch`` keeps cuBLAS. Whole steps of a
random demo-shaped pair (``scripts/bench_big.py --shape smollm2``, H200, three runs side by
side): block 1 0.987 ms against 1.007 / 1.010 ms, block 16 1.271 ms against 1.298 / 1.294 ms.
:func:`small_linear_reference` is the same maths in torch (CPU, tests); ``TRITON_INTERPRET=1``
runs the kernel on CPU. The tiles are :func:`kernel_config`'s.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from dflash.kernels.pdl import default_launch
from dflash.kernels.settings import Launch, config_override

MAX_ROWS = 32  # rows (M) the kernel takes; longer forwards (prefill) use torch
GLU_ACTS = {
    "silu": 1,
    "gelu_tanh": 2,
}  # small_linear_glu's activations (the kernel's GLU constexpr)
SMEM_BUDGET = 200 * 1024  # bytes of shared memory the pipelined tiles may take
FUSE_NORM_AUTO_MAX_K = 1024  # fuse_norm unset: on for hidden sizes up to this (bf16/fp16)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def linear_mode(mode: str, device: torch.device) -> str:
    """Which projections of forwards of <= MAX_ROWS rows run this kernel, from the ``linear``
    setting ``mode``:

    - ``auto`` (default) or ``all``: every one, o_proj and down_proj (with their residual adds)
      and the fused qkv and gate+up projections, at every width up to :data:`MAX_ROWS` rows;
    - ``triton``: o_proj and down_proj only;
    - ``torch``: cuBLAS for all.

    Without CUDA or Triton it is always ``torch``. H200, real demo pair (qkv 1.1 MB, gate+up
    3.5 MB), gsm8k 64, one machine: ``all`` 4,615.0 / 1,426.4 tok/s (DFlash / block-1
    baseline) against 4,366.2 / 1,316.6 with ``triton``. Qwen3-8B's shape
    (``scripts/bench_big.py``): a 16-row step 5.370 / 5.382 ms against 5.539 ms when
    in-projections over 8 MiB ran this kernel in 1-row steps only.
    """
    return mode if device.type == "cuda" and triton is not None else "torch"


def fuse_norm_auto(hidden: int, dtype: torch.dtype) -> bool:
    """The ``fuse_norm`` setting's default (None) for a model of this hidden size (the
    projections' K) and dtype: on up to :data:`FUSE_NORM_AUTO_MAX_K` in bf16/fp16, off in
    float32 (the reference dtype keeps the modules' roundings). The static backend also asks
    that the in-projections run this kernel at every width (``linear`` ``auto`` or ``all``).

    H200 (``benchmarks/results/h200-v18``): the demo's verify-1 graph 0.646 -> 0.592 ms,
    block-16 loop step 0.831 -> 0.795 ms, draft graph 0.147 -> 0.144 ms; real demo pair (gsm8k
    64, one machine) DFlash 4,948.8 -> 5,164.8 tok/s, greedy parity 53 + 11 near-ties -> 64/64
    identical (the same per-row maths at every width, so block-1 decoding and verify agree bit
    for bit in bf16). Qwen3-8B's block-1 step 4.230 -> 4.709 ms: the x x^T products cost more
    than the saved kernels over a K of 4,096 (sizes in between unmeasured)."""
    return hidden <= FUSE_NORM_AUTO_MAX_K and dtype in (torch.bfloat16, torch.float16)


# (weight rows, K) -> (BN, BK, warps, stages) up to 16 rows: Qwen3-8B's projections, from a sweep
# with the weights cycled past the L2 cache as a decode step reads them
# (``scripts/small_linear_sweep.py --cold``, H200, ``benchmarks/results/h200-v24``). One call,
# cold, 1 row, us (rule -> this): o_proj 11.26 -> 10.62, down 25.90 -> 25.86, qkv 15.13 -> 14.42,
# gate+up 48.11 -> 47.83. One config for 1 and 16 rows, so that block-1 decoding and a verify
# sum in one order.
TUNED = {
    (4096, 4096): (32, 256, 4, 6),  # o_proj
    (4096, 12288): (32, 256, 4, 6),  # down_proj
    (6144, 4096): (32, 256, 2, 4),  # fused qkv (32 + 2 x 8 heads of 128)
    (24576, 4096): (64, 128, 2, 4),  # fused gate+up (its SwiGLU epilogue)
}


def kernel_config(
    m: int, n: int, k: int, elem: int = 2, override: str = ""
) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) for an [m, k] x [n, k]^T product (n output columns)
    of ``elem``-byte elements.

    From sweeps on the H200 (``scripts/small_linear_sweep.py``): 16 columns per program up to
    1,024 columns, 32 up to 8,192, 64 beyond; K tiles of 128 up to K = 1,024, 512 beyond 4,096,
    and in between as many as keep a tile at 8,192 weights (one row: Qwen3-8B's o_proj 7.49
    against 7.83 us with 512, its fused qkv 12.92 against 17.73 us and gate+up 46.97 against
    56.80 us, cuBLAS 14.57 and 47.45 us). Shapes in :data:`TUNED` (Qwen3-8B's, timed with cold
    weights) take their own up to 16 rows in 2-byte dtypes (their deeper pipelines would not
    fit shared memory in float32). ``override``: the ``linear_config`` setting
    (:func:`~dflash.kernels.settings.config_override`), all but BM for the shapes it names.
    """
    bm = 16 if m <= 16 else 32
    picked = config_override(override, m, n, k)
    if picked is not None:
        return (bm, *picked)
    tuned = TUNED.get((n, k))
    if tuned is not None and m <= 16 and elem == 2:
        return (bm, *tuned)
    bn = 16 if n <= 1024 else (32 if n <= 8192 else 64)  # best in the H200 sweeps
    bk = 128 if k <= 1024 else (512 if k > 4096 else max(128, min(512, 8192 // bn)))
    # pipelined stages of the x and weight tiles must fit shared memory (~227 KiB on Hopper):
    # 32 rows x 512 of K would take 256 KiB at 4 stages
    stages = max(2, min(4, SMEM_BUDGET // ((bm + bn) * bk * 2)))
    return bm, bn, bk, 4, stages


if triton is not None:

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
    def _rows_times_weight(X, W, rm, rn, m_ok, n_ok, K, s_xm, s_wn, IEEE: tl.constexpr, BM: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, RN: tl.constexpr = False,
                           EPS=0.0):  # fmt: skip
        """x[rm, :] @ W[rn, :]^T in float32 ([BM, BN]), streaming the weight rows along K; with
        PDL the first weight tile is loaded before waiting for the previous kernel (shared by this
        module's kernel and :mod:`dflash.kernels.qkv_rope`). ``RN``: the product scaled by each x
        row's RMS factor rsqrt(mean(x^2) + ``EPS``), the sums of squares taken from the tiles as
        they pass (the diagonal of x x^T on the tensor cores)."""
        acc = tl.zeros([BM, BN], tl.float32)
        sq = tl.zeros([BM, BM], tl.float32)  # RN: x x^T, its diagonal the rows' sums of squares
        k_first = 0
        if PDL:  # the first weight tile does not depend on the previous kernel: load it first
            rk0 = tl.arange(0, BK)  # own names: the loop's values are not carried from here
            k_ok0 = rk0 < K
            w0 = tl.load(
                W + rn[:, None] * s_wn + rk0[None, :],
                mask=n_ok[:, None] & k_ok0[None, :],
                other=0.0,
            )
            tl.extra.cuda.gdc_wait()  # the previous kernel is done: x (and a residual) are ready
            tl.extra.cuda.gdc_launch_dependents()
            x0 = tl.load(
                X + rm[:, None] * s_xm + rk0[None, :],
                mask=m_ok[:, None] & k_ok0[None, :],
                other=0.0,
            )
            if IEEE:
                acc += tl.dot(x0, tl.trans(w0), input_precision="ieee")
            else:
                acc += tl.dot(x0, tl.trans(w0))
            sq = _add_squares(sq, x0, IEEE, RN)
            k_first = BK
        for k0 in range(k_first, K, BK):
            rk = k0 + tl.arange(0, BK)
            k_ok = rk < K
            x = tl.load(
                X + rm[:, None] * s_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
            )
            w = tl.load(
                W + rn[:, None] * s_wn + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
            )
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
            sq = _add_squares(sq, x, IEEE, RN)
        if RN:
            eye = tl.arange(0, BM)[:, None] == tl.arange(0, BM)[None, :]
            ssq = tl.sum(tl.where(eye, sq, 0.0), 1)
            acc = acc * tl.rsqrt(ssq / K + EPS)[:, None]
        return acc

    @triton.jit
    def _small_linear_kernel(X, W, B, RES, Y, M, N, K, s_xm, s_wn, s_rm, s_ym, HAS_BIAS: tl.constexpr,
                             HAS_RES: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
                             GLU: tl.constexpr, RN: tl.constexpr, EPS):  # fmt: skip
        rm = tl.arange(0, BM)
        m_ok = rm < M
        if GLU:  # W holds [gate; up] (2N rows): this program's N columns of each, side by side
            r = tl.arange(0, 2 * BN)
            rn = tl.program_id(0) * BN + r % BN  # output column of each weight row taken
            n_ok2 = rn < N
            wrow = tl.where(r < BN, rn, rn + N)
            acc2 = _rows_times_weight(X, W, rm, wrow, m_ok, n_ok2, K, s_xm, s_wn, IEEE, BM, 2 * BN, BK, PDL,
                                      RN, EPS)  # [BM, 2 BN]: gate, then up  # fmt: skip
            if HAS_BIAS:
                acc2 += tl.load(B + wrow, mask=n_ok2, other=0.0).to(tl.float32)[None, :]
            # the projection's outputs rounded as F.linear's, then SiLU(gate) * up in float32
            # rounded once (as Inductor's fused kernel)
            g, u = tl.split(tl.permute(tl.reshape(acc2.to(Y.dtype.element_ty).to(tl.float32), [BM, 2, BN]),
                                       [0, 2, 1]))  # fmt: skip
            if GLU == 2:  # GELU, tanh approximation (Gemma): tanh(z) = 2 sigmoid(2z) - 1
                z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
                acc = g * tl.sigmoid(2.0 * z) * u
            else:  # SiLU
                acc = g * tl.sigmoid(g) * u
            rn = tl.program_id(0) * BN + tl.arange(0, BN)
            n_ok = rn < N
        else:
            rn = tl.program_id(0) * BN + tl.arange(0, BN)  # output columns of this program
            n_ok = rn < N
            acc = _rows_times_weight(
                X, W, rm, rn, m_ok, n_ok, K, s_xm, s_wn, IEEE, BM, BN, BK, PDL, RN, EPS
            )
            if HAS_BIAS:
                acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = acc.to(Y.dtype.element_ty)
        ym = m_ok[:, None] & n_ok[None, :]
        if HAS_RES:  # torch: residual + linear(...) adds two rounded tensors
            r = tl.load(RES + rm[:, None] * s_rm + rn[None, :], mask=ym, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(Y.dtype.element_ty)
        tl.store(Y + rm[:, None] * s_ym + rn[None, :], y, mask=ym)


def _launch(x, weight, bias, residual, glu: int = 0, rn_eps: float | None = None, pdl: bool = False,
            config: str = ""):  # fmt: skip
    """One kernel launch: y [M, N]; ``glu``: 0 none, 1 (or True) SiLU(gate) * up, 2
    GELU-tanh(gate) * up (:data:`GLU_ACTS`); ``rn_eps``: the product scaled by x's rows' RMS factors
    rsqrt(mean(x^2) + rn_eps) (see :func:`small_linear_rn`); ``pdl``: with programmatic
    dependent launch; ``config``: the ``linear_config`` setting (:func:`kernel_config`)."""
    m = x.shape[0]
    rows, k = weight.shape
    if m > MAX_ROWS:  # one tile of rows per program
        raise ValueError(f"small_linear: {m} rows, at most {MAX_ROWS}")
    if x.shape[1] != k or x.stride(1) != 1 or (glu and rows % 2):
        raise ValueError(f"small_linear: input {tuple(x.shape)} (strides {x.stride()}) does not fit "
                         f"weight {tuple(weight.shape)}{' (gate and up halves)' if glu else ''}")  # fmt: skip
    n = rows // 2 if glu else rows  # output columns
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = kernel_config(
        m, rows, k, weight.element_size(), config
    )  # tiles by the weight read
    if glu:  # each program takes bn weight rows: bn // 2 columns of gate and of up
        bn //= 2
    _small_linear_kernel[(triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else y, residual if residual is not None else y, y, m, n, k,
        x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, IEEE=x.dtype == torch.float32,
        BM=bm, BN=bn, BK=bk, PDL=pdl, GLU=int(glu), RN=rn_eps is not None, EPS=float(rn_eps or 0.0),
        num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return y


@torch.library.custom_op("dflash::small_linear", mutates_args=())
def _small_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     residual: torch.Tensor | None, pdl: bool, config: str) -> torch.Tensor:  # fmt: skip
    return _launch(x, weight, bias, residual, pdl=pdl, config=config)


@_small_linear_op.register_fake
def _(x, weight, bias, residual, pdl, config):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("dflash::small_linear_glu", mutates_args=())
def _small_linear_glu_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pdl: bool,
                         config: str) -> torch.Tensor:  # fmt: skip
    return _launch(x, weight, bias, None, glu=True, pdl=pdl, config=config)


@_small_linear_glu_op.register_fake
def _(x, weight, bias, pdl, config):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


@torch.library.custom_op("dflash::small_linear_geglu", mutates_args=())
def _small_linear_geglu_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pdl: bool,
                           config: str) -> torch.Tensor:  # fmt: skip
    return _launch(x, weight, bias, None, glu=GLU_ACTS["gelu_tanh"], pdl=pdl, config=config)


@_small_linear_geglu_op.register_fake
def _(x, weight, bias, pdl, config):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


@torch.library.custom_op("dflash::small_linear_rn", mutates_args=())
def _small_linear_rn_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                        glu: bool, pdl: bool, config: str) -> torch.Tensor:  # fmt: skip
    return _launch(x, weight, bias, None, glu=glu, rn_eps=eps, pdl=pdl, config=config)


@_small_linear_rn_op.register_fake
def _(x, weight, bias, eps, glu, pdl, config):
    return x.new_empty(x.shape[0], weight.shape[0] // 2 if glu else weight.shape[0])


def _on_cpu(x: torch.Tensor) -> bool:
    """Whether the torch references run instead of the kernel: no Triton, or off CUDA unless
    ``TRITON_INTERPRET=1``."""
    return triton is None or (x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1")


def _launch_args(x: torch.Tensor, launch: Launch | None) -> tuple[bool, str]:
    """(PDL, the ``linear_config`` setting) of a call: ``launch``'s, or
    :func:`~dflash.kernels.pdl.default_launch`'s."""
    launch = default_launch(x.device) if launch is None else launch
    return launch.pdl, launch.settings.linear_config


def small_linear_rn_reference(
    x, weight, bias=None, eps: float = 1e-6, glu: bool = False
) -> torch.Tensor:
    """:func:`small_linear_rn`'s maths in torch ops: the float32 product scaled by the rows' RMS
    factors, the bias added, rounded to x's dtype (``glu``: then SiLU(gate) * up in float32,
    rounded once)."""
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (F.linear(xf, weight.float()) * r + (bias.float() if bias is not None else 0.0)).to(x.dtype)
    return _silu_times_up(y) if glu else y


def small_linear_rn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    glu: bool = False,
    launch: Launch | None = None,
) -> torch.Tensor:
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
        launch: the settings and PDL (None: :func:`~dflash.kernels.pdl.default_launch`).
    Returns:
        [M, N] in x's dtype. Off CUDA (or Triton absent and not interpreting)
        :func:`small_linear_rn_reference` runs instead.

    Raises:
        ValueError: shapes that do not fit.
    """
    if glu and weight.shape[0] % 2:
        raise ValueError(
            f"small_linear: weight {tuple(weight.shape)} does not split into gate and up halves"
        )
    if _on_cpu(x):
        return small_linear_rn_reference(x, weight, bias, eps, glu)
    return _small_linear_rn_op(x, weight, bias, float(eps), glu, *_launch_args(x, launch))


def fold_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """A new [N, K] weight ``weight * norm_weight`` (per input column, in float32, rounded to
    weight's dtype once) for :func:`small_linear_rn`."""
    return (weight.float() * norm_weight.float()[None, :]).to(weight.dtype).contiguous()


def small_linear_glu_reference(x, weight, bias=None, act: str = "silu") -> torch.Tensor:
    """The unfused maths of :func:`small_linear_glu` in torch ops: the projection rounded to x's
    dtype, then act(gate) * up in float32 rounded once (as Inductor fuses it)."""
    y = F.linear(x, weight, bias)
    if GLU_ACTS[act] == 1:
        return _silu_times_up(y)
    g, u = y.chunk(2, dim=-1)
    return (F.gelu(g.float(), approximate="tanh") * u.float()).to(y.dtype)


def _silu_times_up(y: torch.Tensor) -> torch.Tensor:
    """[M, 2N] projection outputs (gate columns, then up) -> SiLU(gate) * up [M, N], in float32
    rounded once to y's dtype: the references' epilogue."""
    g, u = y.chunk(2, dim=-1)
    return (F.silu(g.float()) * u.float()).to(y.dtype)


def small_linear_glu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     launch: Launch | None = None, act: str = "silu") -> torch.Tensor:  # fmt: skip
    """A gated MLP's first half, ``act(x @ gate^T) * (x @ up^T)``, in one kernel: each
    program takes the same output columns of the gate and the up rows, so the activation is an
    epilogue and its kernel (and the [M, 2N] intermediate) is gone.

    Args:
        x: [M, K], unit last stride; M <= :data:`MAX_ROWS`.
        weight: [2N, K], the gate rows then the up rows (a fused gate+up projection); bias: [2N]
            or None.
        launch: the settings and PDL (None: :func:`~dflash.kernels.pdl.default_launch`).
        act: ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU, Gemma's ``gelu_pytorch_tanh``), a key of
            :data:`GLU_ACTS`.
    Returns:
        [M, N] in x's dtype. Off CUDA (or Triton absent and not interpreting)
        :func:`small_linear_glu_reference` runs instead.

    Raises:
        ValueError: x does not fit the weight, or the weight has an odd number of rows.
    """
    if weight.shape[0] % 2:
        raise ValueError(
            f"small_linear: weight {tuple(weight.shape)} does not split into gate and up halves"
        )
    if _on_cpu(x):
        return small_linear_glu_reference(x, weight, bias, act)
    op = _small_linear_glu_op if GLU_ACTS[act] == 1 else _small_linear_geglu_op
    return op(x, weight, bias, *_launch_args(x, launch))


def small_linear_reference(x, weight, bias=None, residual=None) -> torch.Tensor:
    """The unfused maths (linear, then the residual add) in torch ops; args as :func:`small_linear`."""
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, launch: Launch | None = None) -> torch.Tensor:  # fmt: skip
    """``residual + linear(x, weight, bias)`` in one kernel.

    Args:
        x: [M, K], unit last stride; M <= :data:`MAX_ROWS`.
        weight: [N, K] row-major (an ``nn.Linear`` weight); bias: [N] or None.
        residual: [M, N] added to the result, or None.
        launch: the settings and PDL (None: :func:`~dflash.kernels.pdl.default_launch`).
    Returns:
        [M, N] in x's dtype. Off CUDA (or Triton absent and not interpreting)
        :func:`small_linear_reference` runs instead.
    """
    if _on_cpu(x):
        return small_linear_reference(x, weight, bias, residual)
    return _small_linear_op(x, weight, bias, residual, *_launch_args(x, launch))
