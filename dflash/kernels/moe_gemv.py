"""Expert GEMV for a few routed rows: out[p] = W[e_p] x_p (+ b[e_p]), reading each chosen
expert's weights in place (no gather copy, no sort), one launch per projection.

For the static path's MoE blocks at decode widths (T rows x top-K experts = P pairs, up to
:data:`MAX_PAIRS`): ``grouped_mm`` needs the pairs sorted by expert (argsort, counts, offsets,
a gather and a scatter back: about ten small kernels per layer) and the ``gather`` route copies
the chosen experts' weights before a batched matmul (three times the weight traffic). This
kernel takes the pairs as they come: program (p, n-block) loads expert e_p's rows
[n-block, :] (any strides: transformers' [E, N, K] ``F.linear`` layout or gpt-oss's [E, K, N])
and dots them with x_p in float32. Pairs that share an expert read its weights once each (the
L2 cache catches some); at block 1 every weight read is one the step needs.

Same maths as ``x @ W[e].T`` (+ bias) in float32 accumulation, rounded to the output dtype:
agrees with cuBLAS to float rounding. Needs CUDA and Triton (``TRITON_INTERPRET=1`` runs it on CPU).
"""

from __future__ import annotations

import torch

MAX_PAIRS = 64  # (row, expert) pairs up to which the MoE blocks use this kernel
BLOCK_N = 32  # output features per program (16 where that leaves fewer than MIN_PROGRAMS)
MIN_PROGRAMS = 264  # two per SM of an H100: fewer programs leave HBM bandwidth unused
BLOCK_K = 128  # input features per iteration

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

_VERIFIED: dict = {}  # device -> whether the kernel ran and matched torch there


if triton is not None:

    @triton.jit
    def _moe_gemv_kernel(X, W, B, E, S, OUT, K, N, s_xp, s_we, s_wn, s_wk, s_be, s_op,
                         HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        p = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(E + p).to(tl.int64)
        n = nb * BN + tl.arange(0, BN)
        live_n = n < N
        acc = tl.zeros([BN], tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            live_k = k < K
            x = tl.load(X + p * s_xp + k, mask=live_k, other=0.0).to(tl.float32)
            w = tl.load(W + e * s_we + n[:, None] * s_wn + k[None, :] * s_wk,
                        mask=live_n[:, None] & live_k[None, :], other=0.0)  # fmt: skip
            acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
        if HAS_BIAS:
            acc += tl.load(B + e * s_be + n, mask=live_n, other=0.0).to(tl.float32)
        if HAS_SCALE:  # the pair's routing weight
            acc = acc * tl.load(S + p).to(tl.float32)
        tl.store(OUT + p * s_op + n, acc.to(OUT.dtype.element_ty), mask=live_n)


if triton is not None:

    @triton.jit
    def _moe_glu_kernel(X, W, B, E, OUT, K, INTER, XDIV, s_xp, s_we, s_wn, s_wk, s_be, s_op, STEP, UP, alpha, limit,
                        HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
        """out[p, j] = act(gate_j) * up_j (gpt-oss: (up + 1) * gate * sigmoid(alpha * gate), both
        clamped) with gate_j, up_j the rows j * STEP and j * STEP + UP of W[e_p] dotted with x_p."""
        p = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(E + p).to(tl.int64)
        j = nb * BN + tl.arange(0, BN)
        live = j < INTER
        rg, ru = j * STEP, j * STEP + UP
        g = tl.zeros([BN], tl.float32)
        u = tl.zeros([BN], tl.float32)
        base = W + e * s_we
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            live_k = k < K
            x = tl.load(X + (p // XDIV) * s_xp + k, mask=live_k, other=0.0).to(tl.float32)[None, :]
            m = live[:, None] & live_k[None, :]
            wg = tl.load(base + rg[:, None] * s_wn + k[None, :] * s_wk, mask=m, other=0.0)
            wu = tl.load(base + ru[:, None] * s_wn + k[None, :] * s_wk, mask=m, other=0.0)
            g += tl.sum(wg.to(tl.float32) * x, 1)
            u += tl.sum(wu.to(tl.float32) * x, 1)
        if HAS_BIAS:
            g += tl.load(B + e * s_be + rg, mask=live, other=0.0).to(tl.float32)
            u += tl.load(B + e * s_be + ru, mask=live, other=0.0).to(tl.float32)
        if ACT == 0:  # SiLU
            a = g * tl.sigmoid(g) * u
        elif ACT == 1:  # GELU, tanh approximation: tanh(z) = 2 sigmoid(2z) - 1
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = 0.5 * g * (2.0 * tl.sigmoid(2.0 * z)) * u
        else:  # gpt-oss's clamped SwiGLU
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            a = (u + 1.0) * (g * tl.sigmoid(g * alpha))
        tl.store(OUT + p * s_op + j, a.to(OUT.dtype.element_ty), mask=live)


if triton is not None:

    @triton.jit
    def _moe_topk_kernel(L, W, IDX, E, s_l, K: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr,
                         SOFTMAX_FIRST: tl.constexpr, NORMALIZE: tl.constexpr):  # fmt: skip
        """One row's router: its K largest logits (descending, the lower expert first on ties)
        and their weights: SOFTMAX_FIRST (Qwen3-MoE) softmax over all E in float32, the K
        probabilities (NORMALIZE: over their sum); else (gpt-oss) a softmax over the K logits."""
        row = tl.program_id(0)
        e = tl.arange(0, BE)
        live = e < E
        x = tl.load(L + row * s_l + e, mask=live, other=float("-inf")).to(tl.float32)
        top = tl.max(x, 0)
        if SOFTMAX_FIRST:
            den = tl.sum(tl.where(live, tl.exp(x - top), 0.0), 0)
        vals = x
        slots = tl.arange(0, BK)
        wv = tl.zeros([BK], tl.float32)
        iv = tl.zeros([BK], tl.int32)
        for j in tl.static_range(K):  # the K largest, one at a time
            m = tl.max(vals, 0)
            pick = tl.min(tl.where(vals == m, e, BE), 0)
            w = tl.exp(m - top)  # the first is the row's max: exp(0) = 1
            if SOFTMAX_FIRST:
                w = w / den
            wv = tl.where(slots == j, w, wv)
            iv = tl.where(slots == j, pick, iv)
            vals = tl.where(e == pick, float("-inf"), vals)
        if not SOFTMAX_FIRST or NORMALIZE:
            wv = wv / tl.sum(wv, 0)
        keep = slots < K
        tl.store(IDX + row * K + slots, iv.to(tl.int64), mask=keep)
        tl.store(W + row * K + slots, wv.to(W.dtype.element_ty), mask=keep)

    @triton.jit
    def _moe_combine_kernel(Y, R, OUT, N, s_y, s_r, s_o, K: tl.constexpr, BN: tl.constexpr):
        """out[t] = r[t] + round(sum_k y[t * K + k]) (float32 sum in slot order, rounded to the
        residual's dtype, then the rounded add of two tensors, as torch's ``x + y.to(dtype)``)."""
        t = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        live = n < N
        acc = tl.zeros([BN], tl.float32)
        for k in tl.static_range(K):
            acc += tl.load(Y + (t * K + k) * s_y + n, mask=live, other=0.0).to(tl.float32)
        dt = OUT.dtype.element_ty
        r = tl.load(R + t * s_r + n, mask=live, other=0.0).to(tl.float32)
        tl.store(OUT + t * s_o + n, (r + acc.to(dt).to(tl.float32)).to(dt), mask=live)


MAX_EXPERTS = 1024  # experts a router row may have for moe_topk (one row per program)


def moe_topk(logits: torch.Tensor, k: int, softmax_first: bool, normalize: bool = True) -> tuple:
    """A router's top-k in one launch: logits [T, E] (E <= :data:`MAX_EXPERTS`) -> (weights
    [T, K] in the logits' dtype, experts [T, K] int64, descending). ``softmax_first`` (Qwen3-MoE):
    torch's ``topk(softmax(logits, float32))``, divided by their sum when ``normalize``; else
    (gpt-oss) ``softmax(topk(logits))``. Same maths as those torch ops; the exponentials and sums
    round in another order (float32)."""
    t, e = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    w = torch.empty(t, k, dtype=logits.dtype, device=logits.device)
    idx = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    _moe_topk_kernel[(t,)](logits, w, idx, e, logits.stride(0), K=k, BK=triton.next_power_of_2(k),
                           BE=max(16, triton.next_power_of_2(e)), SOFTMAX_FIRST=softmax_first,
                           NORMALIZE=normalize)  # fmt: skip
    return w, idx


def moe_topk_reference(
    logits: torch.Tensor, k: int, softmax_first: bool, normalize: bool = True
) -> tuple:
    """:func:`moe_topk` in torch ops (transformers' routers' order)."""
    if softmax_first:
        top, idx = torch.topk(torch.softmax(logits, -1, dtype=torch.float), k, dim=-1)
        if normalize:
            top = top / top.sum(-1, keepdim=True)
        return top.to(logits.dtype), idx
    top, idx = torch.topk(logits, k, dim=-1)
    return torch.softmax(top, dim=1, dtype=top.dtype), idx


def moe_combine(y: torch.Tensor, k: int, residual: torch.Tensor) -> torch.Tensor:
    """residual [T, H] + (y [T*K, H] float32 summed over each row's K slots in slot order,
    rounded to the residual's dtype): one launch for torch's sum, cast and add."""
    t, n = residual.shape
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    bn = 512
    _moe_combine_kernel[(t, triton.cdiv(n, bn))](y, residual, out, n, y.stride(0), residual.stride(0), out.stride(0),
                                                 K=k, BN=bn)  # fmt: skip
    return out


ACTS = {"silu": 0, "gelu_tanh": 1, "gpt_oss": 2}


def _block_n(pairs: int, n: int, block_n: int = 0) -> int:
    """Output features per program: ``block_n`` when given (tuning sweeps), else
    :data:`BLOCK_N`, halved where that gives too few programs."""
    if block_n:
        return block_n
    return BLOCK_N if pairs * triton.cdiv(n, BLOCK_N) >= MIN_PROGRAMS else BLOCK_N // 2


def moe_glu(x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor, bias: torch.Tensor | None, act: str,
            interleaved: bool = False, transposed: bool = False, alpha: float = 1.0,
            limit: float = 0.0, x_div: int = 1, block_n: int = 0, block_k: int = 0) -> torch.Tensor:  # fmt: skip
    """act(gate) * up of each row's expert in one launch: the gate+up projection
    (:func:`moe_gemv`'s layouts) and the gated activation (``act`` of :data:`ACTS`; ``gpt_oss``:
    ``(clamp(up) + 1) * g * sigmoid(alpha * g)``, g = min(gate, limit)) as its epilogue.

    Args:
        x: [P / x_div, K] (pair p reads row p // x_div: a row's K slots share it); w: [E, 2I, K]
            or (``transposed``) [E, K, 2I]; experts: [P]; bias: [E, 2I] or None.
        interleaved: gate and up alternate (gpt-oss: gate 2j, up 2j + 1), else halves (gate j, up I + j).
    Returns:
        [P, I] in w's dtype.
    """
    x = x if x.stride(-1) == 1 else x.contiguous()
    p, k = experts.shape[0], x.shape[1]
    if transposed:
        n2, s_wn, s_wk = w.shape[2], w.stride(2), w.stride(1)
    else:
        n2, s_wn, s_wk = w.shape[1], w.stride(1), w.stride(2)
    inter = n2 // 2
    step, up = (2, 1) if interleaved else (1, inter)
    out = torch.empty(p, inter, dtype=w.dtype, device=x.device)
    b = bias if bias is not None else out
    bn = _block_n(p, inter, block_n)
    _moe_glu_kernel[(p, triton.cdiv(inter, bn))](
        x, w, b, experts, out, k, inter, x_div, x.stride(0), w.stride(0), s_wn, s_wk,
        b.stride(0) if bias is not None else 0, out.stride(0), step, up, float(alpha), float(limit),
        HAS_BIAS=bias is not None, ACT=ACTS[act], BN=bn, BK=block_k or BLOCK_K,
    )  # fmt: skip
    return out


def moe_glu_reference(x, w, experts, bias, act: str, interleaved: bool = False, transposed: bool = False,
                      alpha: float = 1.0, limit: float = 0.0) -> torch.Tensor:  # fmt: skip
    """:func:`moe_glu` in torch (float32)."""
    gu = moe_gemv_reference(
        x, w.float(), experts, None if bias is None else bias.float(), transposed
    )
    g, u = (gu[:, ::2], gu[:, 1::2]) if interleaved else gu.chunk(2, dim=-1)
    if act == "silu":
        a = torch.nn.functional.silu(g) * u
    elif act == "gelu_tanh":
        a = torch.nn.functional.gelu(g, approximate="tanh") * u
    else:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        a = (u + 1) * (g * torch.sigmoid(g * alpha))
    return a.to(w.dtype)


def moe_gemv(x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor, bias: torch.Tensor | None = None,
             transposed: bool = False, scale: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None, block_n: int = 0, block_k: int = 0) -> torch.Tensor:  # fmt: skip
    """out[p] = (x[p] @ W[experts[p]]^T (+ bias[experts[p]])) (* scale[p]).

    Args:
        x: [P, K] rows (unit last stride).
        w: [E, N, K] (``F.linear`` layout) or, with ``transposed``, [E, K, N] (``x @ W``).
        experts: [P] int64 expert of each row.
        bias: [E, N] or None.
        scale: [P] a factor per row (the routing weights), or None.
        out_dtype: the output's dtype (None: w's).
        block_n, block_k: the tile (output features per program, input features per iteration;
            0: :data:`BLOCK_N` by :func:`_block_n`, :data:`BLOCK_K`), for tuning sweeps.
    Returns:
        [P, N] in ``out_dtype``.
    """
    x = x if x.stride(-1) == 1 else x.contiguous()
    p, k = x.shape
    if transposed:
        n, s_wn, s_wk = w.shape[2], w.stride(2), w.stride(1)
    else:
        n, s_wn, s_wk = w.shape[1], w.stride(1), w.stride(2)
    out = torch.empty(p, n, dtype=out_dtype or w.dtype, device=x.device)
    b = bias if bias is not None else out
    bn = _block_n(p, n, block_n)
    _moe_gemv_kernel[(p, triton.cdiv(n, bn))](
        x, w, b, experts, out if scale is None else scale, out, k, n, x.stride(0), w.stride(0), s_wn, s_wk,
        b.stride(0) if bias is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, BN=bn, BK=block_k or BLOCK_K,
    )  # fmt: skip
    return out


def moe_gemv_reference(x, w, experts, bias=None, transposed: bool = False) -> torch.Tensor:
    """:func:`moe_gemv` in torch (float32 accumulation), for checks."""
    ws = w[experts].float()  # [P, N, K] or [P, K, N]
    out = (
        (ws @ x.float()[:, :, None])[..., 0]
        if not transposed
        else (x.float()[:, None, :] @ ws)[:, 0]
    )
    if bias is not None:
        out = out + bias[experts].float()
    return out.to(w.dtype)


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel runs and matches torch on ``device`` for ``dtype`` weights (checked
    once per device and dtype on small random inputs, outside any graph capture): CUDA with
    Triton only. A failure (compile error, resources, mismatch) means the caller keeps its
    other route."""
    if triton is None or device.type != "cuda":
        return False
    key = (str(device), dtype)
    if key not in _VERIFIED:
        try:
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(5, 200, generator=g, device=device, dtype=dtype)
            ok = True
            for transposed in (False, True):
                w = torch.randn(7, 96, 200, generator=g, device=device, dtype=dtype)
                w = w.transpose(1, 2).contiguous() if transposed else w
                b = torch.randn(7, 96, generator=g, device=device, dtype=dtype)
                e = torch.tensor([3, 0, 6, 3, 1], device=device)
                got = moe_gemv(x, w, e, b, transposed).float()
                want = moe_gemv_reference(x, w, e, b, transposed).float()
                ok &= bool(((got - want).abs().max() <= 2e-2 * want.abs().max() + 1e-3).item())
                for act, inter in (("silu", False), ("gelu_tanh", False), ("gpt_oss", True)):
                    got = moe_glu(x, w, e, b, act, inter, transposed, 1.702, 7.0).float()
                    want = moe_glu_reference(x, w, e, b, act, inter, transposed, 1.702, 7.0).float()
                    ok &= bool(((got - want).abs().max() <= 2e-2 * want.abs().max() + 1e-3).item())
            logits = torch.randn(5, 40, generator=g, device=device, dtype=dtype)
            for first in (True, False):
                w, i = moe_topk(logits, 4, first)
                w_ref, i_ref = moe_topk_reference(logits, 4, first)
                ok &= bool(torch.equal(i, i_ref)) and bool(((w - w_ref).abs().max() <= 1e-2).item())
            y = torch.randn(10, 96, generator=g, device=device)
            r = torch.randn(5, 96, generator=g, device=device, dtype=dtype)
            want = r + y.view(5, 2, 96).sum(1).to(dtype)
            ok &= bool(((moe_combine(y, 2, r).float() - want.float()).abs().max() <= 2e-2).item())
            _VERIFIED[key] = ok
        except Exception:  # noqa: BLE001 - Triton raises many types
            _VERIFIED[key] = False
    return _VERIFIED[key]
