"""Attention of a few query rows over a position-indexed KV cache, reading only the filled rows.

The static path keeps K/V in buffers of a fixed capacity S (rows indexed by position) so that
CUDA graphs have fixed shapes. ``F.scaled_dot_product_attention`` with a position mask then
reads all S rows every layer, and on the H200 the demo pair spent about half of a 16-wide
verify in attention: a cuDNN kernel with one thread block per head walking all S keys, plus
building the [T, S] mask bias. This module is a split-KV ("flash-decoding") kernel instead:

- grid (KV heads, S / ``split``): each program takes the G*T query rows that share one KV head
  (GQA: G query heads per KV head, T query positions) and one slice of ``split`` keys;
- the filled length is read on the device (the last query position + 1), so programs whose
  slice starts past it return at once and the others stop at it: cost follows the filled
  length, not the capacity, with no host sync and one graph for every length;
- causal by position: query row t sees keys at positions <= pos[t]; online softmax per slice
  (base 2), then the slices are merged by their log-sum-exp in plain torch ops (fused by
  Inductor under ``torch.compile``).

Same maths as SDPA with the mask (softmax(q k^T * scale) v over keys at positions <= pos[t]),
summed in another order: results agree to float rounding (float32 runs use exact fp32 dots).
``DFLASH_ATTN=sdpa`` goes back to SDPA. Needs CUDA and Triton; :func:`split_attention_reference`
is the same algorithm in torch (CPU tests), and ``TRITON_INTERPRET=1`` runs the kernel on CPU.
"""

from __future__ import annotations

import math
import os

import torch

ATTN_ENV = "DFLASH_ATTN"
SPLIT_ENV = "DFLASH_ATTN_SPLIT"
SPLIT = 256  # keys per program (default; 128 measured 3% slower on the demo pair, H200)
SPLIT_MAX_ROWS = 32  # query rows (T) the kernel takes; prefill and longer forwards use SDPA
BLOCK_N = 64  # keys per inner iteration

try:  # Triton ships with CUDA builds of torch; CPU installs usually lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available() -> bool:
    """Whether the Triton kernel can run (Triton importable)."""
    return triton is not None


def attention_mode(device: torch.device) -> str:
    """Which attention the static target forward uses (``DFLASH_ATTN``): ``auto`` (default: the
    split kernel for forwards of 2+ query rows, SDPA for 1 row, where cuDNN's decode kernel is
    as fast and needs no merge), ``split`` (every width) or ``sdpa`` (never). Without CUDA or
    Triton it is always ``sdpa``.

    Raises:
        InputError: another value.
    """
    from dflash.errors import InputError

    raw = os.environ.get(ATTN_ENV, "").strip().lower() or "auto"
    if raw not in ("auto", "split", "sdpa"):
        raise InputError(f"{ATTN_ENV} must be auto, split or sdpa, got {raw!r}.",
                         hint="unset it for the default (auto)")  # fmt: skip
    return raw if device.type == "cuda" and available() else "sdpa"


def split_size(capacity: int) -> int:
    """Keys per program (``DFLASH_ATTN_SPLIT``, default 256; one slice when >= capacity, then
    no merge is needed); the greatest common divisor of the setting and ``capacity`` (a multiple
    of 64), so the slices tile the cache.

    Raises:
        InputError: not a positive multiple of 64.
    """
    from dflash.errors import InputError

    raw = os.environ.get(SPLIT_ENV, "").strip()
    value = int(raw) if raw.isdigit() else (SPLIT if not raw else -1)
    if value <= 0 or value % BLOCK_N:
        raise InputError(f"{SPLIT_ENV} must be a positive multiple of {BLOCK_N}, got {raw!r}.",
                         hint=f"unset it for the default of {SPLIT}")  # fmt: skip
    return math.gcd(value, capacity)  # slices tile the capacity (a multiple of 64)


if triton is not None:

    @triton.jit
    def _split_kernel(Q, K, V, POS, OUT, LSE, scale_log2,
                      s_qh, s_qt, s_kh, s_ks, s_vh, s_vs, s_oh, s_os, s_or, s_lh, s_ls,
                      T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                      SPLIT_N: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
        kvh = tl.program_id(0)
        sp = tl.program_id(1)
        r = tl.arange(0, ROWS)
        live = r < G * T
        g = r // T
        t = r % T
        d = tl.arange(0, D)
        qpos = tl.load(POS + t, mask=live, other=-1)  # [ROWS] position of each query row
        filled = tl.load(POS + T - 1) + 1  # keys at positions < filled exist
        lo = sp * SPLIT_N
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        if lo < filled:
            q = tl.load(Q + (kvh * G + g)[:, None] * s_qh + t[:, None] * s_qt + d[None, :],
                        mask=live[:, None], other=0.0)  # fmt: skip
            hi = tl.minimum(lo + SPLIT_N, filled)
            for start in range(lo, hi, BLOCK):
                n = start + tl.arange(0, BLOCK)
                k = tl.load(K + kvh * s_kh + n[None, :] * s_ks + d[:, None])  # [D, BLOCK]
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
                v = tl.load(V + kvh * s_vh + n[:, None] * s_vs + d[None, :])  # [BLOCK, D]
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(OUT + kvh * s_oh + sp * s_os + r[:, None] * s_or + d[None, :], acc / l_safe[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(LSE + kvh * s_lh + sp * s_ls + r, lse)


def _rows(groups: int, t: int) -> int:
    return max(16, triton.next_power_of_2(groups * t)) if triton is not None else max(16, groups * t)


def split_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                   scale: float, split: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Run the kernel: per KV head and key slice, the normalised partial output and its
    log2-sum-exp.

    Args:
        q: [1, H, T, D] queries (any strides with a unit last stride).
        k, v: [1, Hkv, S, D] contiguous caches; S a multiple of ``split``.
        split: keys per program (a multiple of 64).
        pos: [T] int64 positions of the query rows, ascending (the last is the largest); row t
            sees keys at positions <= pos[t].
        scale: softmax scale (e.g. 1/sqrt(D)).
    Returns:
        o [Hkv, S/split, R, D] float32 and lse [Hkv, S/split, R] float32 (R >= G*T rows:
        row g*T + t is query head kvh*G + g at position t; -inf where a slice saw no key).
    """
    _, h, t, dim = q.shape
    hkv, cap = k.shape[1], k.shape[2]
    groups, nsplit, rows = h // hkv, cap // split, _rows(h // hkv, t)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k, v, pos = k.contiguous(), v.contiguous(), pos.contiguous()  # no-ops for the caches
    o = torch.empty(hkv, nsplit, rows, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(hkv, nsplit, rows, dtype=torch.float32, device=q.device)
    _split_kernel[(hkv, nsplit)](
        q, k, v, pos, o, lse, scale * math.log2(math.e),
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        T=t, G=groups, D=dim, ROWS=rows, SPLIT_N=split, BLOCK=min(BLOCK_N, split),
        IEEE=q.dtype == torch.float32,
    )  # fmt: skip
    return o, lse


def merge_partials(o: torch.Tensor, lse: torch.Tensor, heads: int, t: int, dtype) -> torch.Tensor:
    """Merge per-slice partials (:func:`split_partials`) into [1, H, T, D] in ``dtype``."""
    hkv, nsplit, _, dim = o.shape
    groups = heads // hkv
    if nsplit == 1:  # one slice: already normalised
        return o[:, 0, : groups * t].reshape(1, heads, t, dim).to(dtype)
    m = lse.amax(1, keepdim=True)  # [Hkv, 1, R]
    w = torch.exp2(lse - m)  # [Hkv, NS, R]; 0 for empty slices
    out = (o * w[..., None]).sum(1) / w.sum(1)[..., None]  # [Hkv, R, D]
    return out[:, : groups * t].reshape(1, heads, t, dim).to(dtype)


@torch.library.custom_op("dflash::split_attention_partials", mutates_args=())
def _partials_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                 scale: float, split: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return split_partials(q, k, v, pos, scale, split)


@_partials_op.register_fake
def _(q, k, v, pos, scale, split):
    _, h, t, dim = q.shape
    hkv, cap = k.shape[1], k.shape[2]
    rows = _rows(h // hkv, t)
    return (q.new_empty(hkv, cap // split, rows, dim, dtype=torch.float32),
            q.new_empty(hkv, cap // split, rows, dtype=torch.float32))  # fmt: skip


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                    scale: float | None) -> torch.Tensor:  # fmt: skip
    """softmax(q k^T * scale) v over the keys at positions <= pos[t], per query row t.

    Args:
        q: [1, H, T, D]; k, v: [1, Hkv, S, D] caches indexed by position (S a multiple of
        the split size, :func:`split_size`); pos: [T] int64 positions of the query rows
        (ascending; the last is the largest: keys at positions > pos[-1] are never read);
        scale: None = 1/sqrt(D). Non-causal rows (a draft block that sees all of itself):
        give every row the block's last position.
    Returns:
        [1, H, T, D] in q's dtype.

    Raises:
        InputError: a bad ``DFLASH_ATTN_SPLIT``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if triton is None or (q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        # no kernel here (CPU, Triton absent or not interpreting): the same algorithm in torch
        return split_attention_reference(q, k, v, pos, scale, split_size(k.shape[2]))
    o, lse = _partials_op(q, k, v, pos, float(scale), split_size(k.shape[2]))
    return merge_partials(o, lse, q.shape[1], q.shape[2], q.dtype)


def split_attention_reference(q, k, v, pos, scale, split: int = SPLIT) -> torch.Tensor:
    """The kernel's algorithm in torch (slices, per-slice softmax, log-sum-exp merge): [1, H, T, D].

    For tests on machines without Triton; same arguments as :func:`split_attention`."""
    _, h, t, dim = q.shape
    hkv, cap = k.shape[1], k.shape[2]
    groups, filled, split = h // hkv, int(pos[-1]) + 1, math.gcd(split, cap)
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
