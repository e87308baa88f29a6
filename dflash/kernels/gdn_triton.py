"""The gated delta rule over a verify block in one Triton kernel (static path, CUDA graphs).

:func:`dflash.kernels.gdn.prepare` + :func:`~dflash.kernels.gdn.recurrent_verify` run ~20 torch
ops for the inputs and ~8 per token of the block (about 150 kernels per layer at 16 tokens, each
reading and writing the whole state). Here one program holds a [Dk, BV] slice of one value
head's float32 state in registers and, for each of the T tokens: reads its q, k, v rows from the
conv output, L2-normalizes q and k, computes the decay ``g`` and rate ``beta`` from the layer's
gates, updates the state, and writes the state after the token into its slot (what the rollback
gathers) and the token's output. One kernel per layer, the state read once.

Same operations as the torch reference (transformers' order: ``beta`` rounded to the gates'
dtype, q divided by sqrt(Dk)), each state element updated by the same float32 arithmetic; the
reductions over Dk (the norms, S^T k, S^T q) sum in another order and ``softplus`` is
``log(1 + exp(x))`` (``exp(x)`` below -10, ``x`` above 20), so results agree to float32 rounding
(checked against the reference in tests/kernels, under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

MAX_DK = 256  # a value head's [Dk, BV] state slice in registers


def available() -> bool:
    """Whether the kernel can run (Triton importable)."""
    return triton is not None


def fits(dk: int, dv: int, device: torch.device) -> bool:
    """Whether the kernel takes heads of ``dk`` x ``dv`` on ``device`` (CUDA, or the Triton
    interpreter): powers of two, Dk at most :data:`MAX_DK`, Dv at least 16."""
    import os

    on = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    pow2 = dk & (dk - 1) == 0 and dv & (dv - 1) == 0
    return available() and on and pow2 and 16 <= dk <= MAX_DK and dv >= 16


if triton is not None:

    @triton.jit
    def _gdn_verify_kernel(X, A, B, ALOG, DTB, S, OUT, s_xt, s_xc, s_a, s_b, scale,
                           H: tl.constexpr, REP: tl.constexpr, KEY: tl.constexpr, T: tl.constexpr,
                           DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):  # fmt: skip
        head = tl.program_id(0)
        kh = head // REP  # the q/k head this value head reads
        col = tl.program_id(1) * BV + tl.arange(0, BV)  # [BV] value columns of this program
        row = tl.arange(0, DK)  # [DK]
        slot = DK * DV * H  # elements per state slot
        off = head * DK * DV + row[:, None] * DV + col[None, :]  # [DK, BV] within a slot
        s = tl.load(S + off)  # the committed state (slot 0)
        decay = -tl.exp(tl.load(ALOG + head).to(tl.float32))
        dtb = tl.load(DTB + head).to(tl.float32)
        for t in tl.static_range(T):
            x = X + t * s_xt
            q = tl.load(x + (kh * DK + row) * s_xc).to(tl.float32)
            k = tl.load(x + (KEY + kh * DK + row) * s_xc).to(tl.float32)
            v = tl.load(x + (2 * KEY + head * DV + col) * s_xc).to(tl.float32)
            q = q * tl.math.rsqrt(tl.sum(q * q, 0) + 1e-6) / scale
            k = k * tl.math.rsqrt(tl.sum(k * k, 0) + 1e-6)
            a = tl.load(A + t * s_a + head).to(tl.float32) + dtb
            ea = tl.exp(a)
            soft = tl.where(a > 20.0, a, tl.where(a < -10.0, ea, tl.log(1.0 + ea)))
            b = tl.load(B + t * s_b + head)
            beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)
            s = s * tl.exp(decay * soft)
            kv = tl.sum(s * k[:, None], 0)  # [BV]
            delta = (v - kv) * beta
            s = s + k[:, None] * delta[None, :]
            o = tl.sum(s * q[:, None], 0)
            tl.store(S + (t + 1) * slot + off, s)
            tl.store(OUT + (t * H + head) * DV + col, o)


def _launch(x, a, b, a_log, dt_bias, states, heads_k: int, key_dim: int) -> torch.Tensor:
    t = x.shape[0]
    h, dk, dv = states.shape[1:]
    if (t >= states.shape[0] or not states.is_contiguous() or a.shape != (t, h) or b.shape != (t, h)
            or key_dim != heads_k * dk or x.shape[1] != 2 * key_dim + h * dv or h % heads_k):  # fmt: skip
        raise ValueError(f"gdn verify: rows {tuple(x.shape)}, gates {tuple(a.shape)}, {heads_k} key heads "
                         f"for states {tuple(states.shape)}")  # fmt: skip
    a, b = (g if g.stride(1) == 1 else g.contiguous() for g in (a, b))
    out = torch.empty(t, h, dv, dtype=torch.float32, device=x.device)
    bv = min(dv, 32 if dk <= 128 else 16)
    _gdn_verify_kernel[(h, dv // bv)](x, a, b, a_log, dt_bias, states, out, x.stride(0), x.stride(1), a.stride(0),
                                      b.stride(0), float(dk**0.5), H=h, REP=h // heads_k, KEY=key_dim, T=t, DK=dk,
                                      DV=dv, BV=bv, num_warps=4)  # fmt: skip
    return out


@torch.library.custom_op("dflash::gdn_verify", mutates_args=("states",))
def _gdn_verify_op(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                   states: torch.Tensor, heads_k: int, key_dim: int) -> torch.Tensor:  # fmt: skip
    return _launch(x, a, b, a_log, dt_bias, states, heads_k, key_dim)


@_gdn_verify_op.register_fake
def _(x, a, b, a_log, dt_bias, states, heads_k, key_dim):
    return x.new_empty(x.shape[0], states.shape[2], states.shape[4], dtype=torch.float32)


def gdn_verify(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
               states: torch.Tensor, heads_k: int) -> torch.Tensor:  # fmt: skip
    """:func:`dflash.kernels.gdn.prepare` then :func:`~dflash.kernels.gdn.recurrent_verify` in
    one kernel launch.

    Args:
        x: [T, C] the conv's output (q | k | v rows, C = 2*Hk*Dk + Hv*Dv; any strides).
        a, b: [T, Hv] the decay and rate projections; a_log, dt_bias: [Hv] the layer's parameters.
        states: [W + 1, Hv, Dk, Dv] float32 contiguous, T <= W: slot 0 read, slots 1..T written.
        heads_k: Hk.

    Returns:
        o [T, Hv, Dv] float32.

    Raises:
        ValueError: shapes that do not fit (:func:`fits` checks the head sizes).
    """
    return _gdn_verify_op(x, a, b, a_log, dt_bias, states, heads_k, heads_k * states.shape[2])
