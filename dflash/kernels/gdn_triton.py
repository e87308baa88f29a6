"""The gated delta rule over a verify block in one Triton kernel (static path, CUDA graphs).

:func:`dflash.kernels.gdn.recurrent_verify` runs ~8 torch ops per token of the block (about 130
kernels per layer at 16 tokens, each reading and writing the whole state). Here one program holds
a [Dk, BV] slice of one value head's float32 state in registers, runs the T tokens of the block
on it and writes the state after each token into its slot (what the rollback gathers) and each
token's output: one kernel per layer, the state read once.

Same operations per token as the torch reference (decay, read-out S^T k, delta, rank-1 update,
S^T q), each state element updated by the same float32 arithmetic; the two reductions over Dk
(S^T k and S^T q) sum in another order than torch's, so results agree to float32 rounding
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
    def _gdn_verify_kernel(Q, K, V, G, B, S, OUT, H: tl.constexpr, T: tl.constexpr, DK: tl.constexpr,
                           DV: tl.constexpr, BV: tl.constexpr):  # fmt: skip
        head = tl.program_id(0)
        col = tl.program_id(1) * BV + tl.arange(0, BV)  # [BV] value columns of this program
        row = tl.arange(0, DK)  # [DK]
        slot = DK * DV * H  # elements per state slot
        off = head * DK * DV + row[:, None] * DV + col[None, :]  # [DK, BV] within a slot
        s = tl.load(S + off)  # the committed state (slot 0)
        for t in tl.static_range(T):
            qk = (t * H + head) * DK
            k = tl.load(K + qk + row)
            q = tl.load(Q + qk + row)
            v = tl.load(V + (t * H + head) * DV + col)
            g = tl.load(G + t * H + head)
            beta = tl.load(B + t * H + head)
            s = s * tl.exp(g)
            kv = tl.sum(s * k[:, None], 0)  # [BV]
            delta = (v - kv) * beta
            s = s + k[:, None] * delta[None, :]
            o = tl.sum(s * q[:, None], 0)
            tl.store(S + (t + 1) * slot + off, s)
            tl.store(OUT + (t * H + head) * DV + col, o)


def recurrent_verify_triton(q, k, v, g, beta, states: torch.Tensor) -> torch.Tensor:
    """:func:`dflash.kernels.gdn.recurrent_verify` in one kernel launch (same arguments and
    result: q, k [T, Hv, Dk], v [T, Hv, Dv], g, beta [T, Hv] float32; states [W + 1, Hv, Dk, Dv]
    float32, slot 0 read, slots 1..T written; returns o [T, Hv, Dv] float32).

    Raises:
        ValueError: shapes the kernel does not take (:func:`fits`) or T > W.
    """
    t, h, dk = q.shape
    dv = v.shape[-1]
    if t >= states.shape[0] or states.shape[1:] != (h, dk, dv) or not states.is_contiguous():
        raise ValueError(
            f"gdn verify: {t} tokens of {h} heads {dk}x{dv} for states {tuple(states.shape)}"
        )
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    out = torch.empty(t, h, dv, dtype=torch.float32, device=q.device)
    bv = min(dv, 32 if dk <= 128 else 16)
    _gdn_verify_kernel[(h, dv // bv)](
        q, k, v, g, beta, states, out, H=h, T=t, DK=dk, DV=dv, BV=bv, num_warps=4
    )
    return out
