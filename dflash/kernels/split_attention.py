"""Attention of a few query rows over a position-indexed KV cache, reading only the filled rows.

The static path keeps K/V in buffers of a fixed capacity S (rows indexed by position) so that
CUDA graphs have fixed shapes. ``F.scaled_dot_product_attention`` with a position mask then
reads all S rows every layer, and on the H200 the demo pair spent about half of a 16-wide
verify in attention: a cuDNN kernel with one thread block per head walking all S keys, plus
building the [T, S] mask bias. This module is a split-KV ("flash-decoding") kernel instead:

- grid (KV heads x G / GP, S / ``split``): each program takes the GP*T query rows of GP of the
  G query heads that share one KV head (GQA; T query positions; :func:`heads_per_program`: one
  head for a 16-row block, the whole group for a 1-row step) and one slice of ``split`` keys
  (the ``attn_split`` setting: 256), walked 128 keys at a time; while the filled length is short
  (:func:`~dflash.kernels.settings.one_slice`: up to 640 keys for head dims <= 64, 448 above) the first program
  takes all of it alone and the others return, since merging slices costs more than it saves;
- the filled length is read on the device (the last query position + 1), so programs whose
  slice starts past it return at once and the others stop at it: cost follows the filled
  length, not the capacity, with no host sync and one graph for every length;
- causal by position: query row t sees keys at positions <= pos[t] (with a sliding ``window`` W
  only those > pos[t] - W, and the key blocks wholly older than the first row's window are
  skipped; a slice left with no key publishes an empty partial); online softmax per slice
  (base 2); when the filled length spans several slices, each program publishes its partial
  output and log-sum-exp and the last one of its heads to finish (an atomic counter) merges
  them, so one launch does the whole attention: no merge kernels (which, fused by Inductor
  with the next layer's ops, cost up to 9.5 us per layer on the H200).

Same maths as SDPA with the mask (softmax(q k^T * scale) v over keys at positions <= pos[t]),
summed in another order: results agree to float rounding (float32 runs use exact fp32 dots).
The ``attention`` setting ``sdpa`` goes back to SDPA. Needs CUDA and Triton;
:func:`split_attention_reference` is the same algorithm in torch (CPU tests), and
``TRITON_INTERPRET=1`` runs the kernel on CPU.
"""

from __future__ import annotations

import math
import os

import torch

from dflash.kernels.pdl import default_launch, pdl_supported
from dflash.kernels.settings import Launch, one_slice

SPLIT_MAX_ROWS = 32  # query rows (T) the kernel takes; prefill and longer forwards use SDPA
BLOCK_N = 64  # granularity of the split sizes (keys)
ITER_KEYS = 128  # keys per inner iteration (default)

try:  # Triton ships with CUDA builds of torch; CPU installs usually lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available() -> bool:
    """Whether the Triton kernel can run (Triton importable)."""
    return triton is not None


def attention_mode(mode: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """Which attention the static forwards use, from the ``attention`` setting ``mode``.

    - ``auto`` (default): the split kernel for every forward of up to ``SPLIT_MAX_ROWS`` query
      rows, block 1 included (longer prefills use SDPA), with bf16/fp16 weights; exact SDPA with
      float32 weights. The kernel's exact fp32 dots (no tensor cores) took 600-740 us per 16-row
      call on the H200, so float32 runs, the parity reference, use SDPA.
    - ``split``: the kernel at those widths whatever the dtype (float32 checks of the kernel).
    - ``sdpa``: never the kernel.

    Without CUDA or Triton it is always ``sdpa``. On the H200 (random demo-shaped pair, one run
    side by side) the kernel at width 1 took 0.921 ms per block-1 step against 0.993 ms with
    cuDNN's SDPA, which needs a mask and a reduction kernel per layer.
    """
    if device.type != "cuda" or not available() or (mode == "auto" and dtype == torch.float32):
        return "sdpa"
    return mode


def split_size(capacity: int, split: int) -> int:
    """Keys per program for a cache of ``capacity`` rows (a multiple of 64) when ``split`` (the
    ``attn_split`` setting, 256 by default) is asked for: one slice when ``split`` >= capacity
    (then no merge is needed), else the greatest common divisor of the two, so the slices tile
    the cache. 256 was the fastest split at 512, 1,500 and 3,500 keys for the demo's and
    Qwen3-8B's layouts on the H200 (``scripts/attn_sweep.py``)."""
    return capacity if split >= capacity else math.gcd(split, capacity)


def heads_per_program(groups: int, rows: int) -> int:
    """Query heads of one KV head that each program takes: the largest divisor of the group
    size ``groups`` whose ``rows`` query rows fit one 16-row tensor-core tile, at least one.
    So a 16-row verify or draft block runs one program per query head (16 rows each, instead
    of the G*16 rows of a whole group padded to a power of two) and a 1-row decode step one
    per KV head. H200, the demo's layout at 300 keys in one slice, 128 keys per iteration:
    4.49 against 5.41 us for the draft's block.
    """
    best = 1
    for gp in range(1, groups + 1):
        if groups % gp == 0 and gp * rows <= max(16, rows):
            best = gp
    return best


def uses_kernel(mode: str, rows: int) -> bool:
    """Whether a static forward of ``rows`` query rows runs the split kernel under ``mode``
    (:func:`attention_mode`): every forward of up to ``SPLIT_MAX_ROWS`` rows unless ``sdpa``."""
    return rows <= SPLIT_MAX_ROWS and mode != "sdpa"


if triton is not None:

    @triton.jit
    def _store_rows(OUT, x, head, t, d, live, s_oh, s_ot):
        """Store the final rows x [ROWS, D] (row r: query head ``head[r]`` at position ``t[r]``)
        in OUT's dtype; the pointers are made here, after the key loop, not held through it."""
        tl.store(OUT + head[:, None] * s_oh + t[:, None] * s_ot + d[None, :], x.to(OUT.dtype.element_ty),
                 mask=live[:, None])  # fmt: skip

    @triton.jit
    def _finish(acc, l_i, m_i, sink, SINKS: tl.constexpr):
        """acc / l for one slice holding every key (rows with no key: 0); with ``SINKS`` the
        denominator also counts exp2(sink - m) (both rescaled by the larger of m and the sink)."""
        if SINKS:
            top = tl.maximum(m_i, sink)
            keep = tl.exp2(m_i - top)  # 0 where the row saw no key (m = -inf)
            den = l_i * keep + tl.exp2(sink - top)
            return acc * (keep / den)[:, None]
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        return acc / l_safe[:, None]

    @triton.jit
    def _split_kernel(Q, K, V, POS, OUT, PO, PL, CNT, SINK, scale_log2, cap, s_pos, window,
                      s_qh, s_qt, s_kh, s_ks, s_vh, s_vs, s_oh, s_ot, s_ph, s_ps, s_pr, s_lh, s_ls,
                      T: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                      ROWS: tl.constexpr, SPLIT_N: tl.constexpr, BLOCK: tl.constexpr,
                      IEEE: tl.constexpr, MERGE: tl.constexpr, PDL: tl.constexpr,
                      ONE: tl.constexpr, EARLY: tl.constexpr = False, WINDOW: tl.constexpr = False,
                      SINKS: tl.constexpr = False):  # fmt: skip
        if PDL and not EARLY:  # programmatic dependent launch: wait for the previous kernel first
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        unit = tl.program_id(0)  # GP query heads of one KV head: G // GP units per KV head
        kvh = unit // (G // GP)
        sp = tl.program_id(1)
        r = tl.arange(0, ROWS)
        live = r < GP * T
        g = (unit % (G // GP)) * GP + r // T  # query head within the KV head's group
        t = r % T
        d = tl.arange(0, D)
        qpos = tl.load(POS + t * s_pos, mask=live, other=-1)  # [ROWS] position of each query row
        # keys at positions < filled exist; clamped so that a position past the cache can never
        # leave a slice counter unreset (every slice counted then exists)
        filled = tl.minimum(tl.load(POS + (T - 1) * s_pos) + 1, cap)
        if ONE > SPLIT_N:  # up to ONE filled keys the first program takes them all (no merge)
            span = tl.where(filled <= ONE, ONE, SPLIT_N)
        else:
            span = SPLIT_N
        slices = (filled + span - 1) // span  # slices holding keys; later programs idle
        lo = sp * span
        first = lo  # the first key this program reads
        if WINDOW:  # keys older than the first row's window: no row sees them (rows ascend)
            oldest = tl.maximum(tl.load(POS) - window + 1, 0)
            first = tl.maximum(lo, (oldest // BLOCK) * BLOCK)
        if PDL and EARLY:  # what the kernel before writes (q, this forward's K/V rows) from here on
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if lo < filled:
            m_i = tl.full([ROWS], float("-inf"), tl.float32)
            l_i = tl.zeros([ROWS], tl.float32)
            acc = tl.zeros([ROWS, D], tl.float32)
            q = tl.load(Q + (kvh * G + g)[:, None] * s_qh + t[:, None] * s_qt + d[None, :],
                        mask=live[:, None], other=0.0)  # fmt: skip
            hi = tl.minimum(lo + span, filled)
            for start in range(first, hi, BLOCK):  # none when the window starts past this slice
                n = start + tl.arange(0, BLOCK)
                inside = n < filled  # rows past the filled length are never read
                k = tl.load(K + kvh * s_kh + n[None, :] * s_ks + d[:, None], mask=inside[None, :],
                            other=0.0)  # [D, BLOCK]  # fmt: skip
                if IEEE:
                    s = tl.dot(q, k, input_precision="ieee")
                else:
                    s = tl.dot(q, k)
                seen = n[None, :] <= qpos[:, None]
                if WINDOW:
                    seen = seen & (n[None, :] > qpos[:, None] - window)
                s = tl.where(seen, s * scale_log2, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(s - m_safe[:, None])
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V + kvh * s_vh + n[:, None] * s_vs + d[None, :], mask=inside[:, None],
                            other=0.0)  # [BLOCK, D]  # fmt: skip
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            if SINKS:  # the head's sink logit joins the denominator (base 2, scaled on the host)
                sink = tl.load(SINK + kvh * G + g, mask=live, other=0.0)
            else:
                sink = tl.zeros([ROWS], tl.float32)
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            if MERGE:  # the capacity holds several slices (a constexpr: no merge code otherwise)
                if slices == 1:  # one slice holds every key: the result is final
                    _store_rows(OUT, _finish(acc, l_i, m_i, sink, SINKS), kvh * G + g, t, d, live, s_oh, s_ot)
                else:  # publish this slice; the last slice of this unit to finish merges
                    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
                    tl.store(PO + unit * s_ph + sp * s_ps + r[:, None] * s_pr + d[None, :],
                             acc / l_safe[:, None])  # fmt: skip
                    tl.store(PL + unit * s_lh + sp * s_ls + r, lse)
                    tl.debug_barrier()  # every thread's stores precede the release below
                    done = tl.atomic_add(CNT + unit, 1, sem="acq_rel")
                    if done == slices - 1:
                        m = tl.full([ROWS], float("-inf"), tl.float32)
                        for j in range(0, slices):
                            m = tl.maximum(m, tl.load(PL + unit * s_lh + j * s_ls + r, cache_modifier=".cg"))
                        m = tl.where(m == float("-inf"), 0.0, m)
                        num = tl.zeros([ROWS, D], tl.float32)
                        den = tl.zeros([ROWS], tl.float32)
                        for j in range(0, slices):  # L2 reads (.cg): other SMs wrote these rows
                            w = tl.exp2(tl.load(PL + unit * s_lh + j * s_ls + r, cache_modifier=".cg") - m)
                            o = tl.load(PO + unit * s_ph + j * s_ps + r[:, None] * s_pr + d[None, :],
                                        cache_modifier=".cg")  # fmt: skip
                            num += o * w[:, None]
                            den += w
                        if SINKS:  # den counts exp2(lse_j - m): the sink adds exp2(sink - m)
                            den += tl.exp2(sink - m)
                        den = tl.where(den == 0.0, 1.0, den)
                        _store_rows(OUT, num / den[:, None], kvh * G + g, t, d, live, s_oh, s_ot)
                        tl.atomic_xchg(CNT + unit, 0)  # ready for the next launch (and graph replay)
            else:
                _store_rows(OUT, _finish(acc, l_i, m_i, sink, SINKS), kvh * G + g, t, d, live, s_oh, s_ot)


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
                           warps: int = 0, stages: int = 0, one_slice: int = 0, early: bool = False,
                           pdl: bool | None = None, window: int = 0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
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
        early: under PDL, the positions (and so the filled length) load before waiting for
            the kernel just before (the ``attn_early`` setting): only where they were written
            before that kernel.
        pdl: launch with programmatic dependent launch; None = where the device supports it.
        window: a sliding window W > 0: row t sees only keys at positions > pos[t] - W (0: all).
        sinks: [H] float32 per-head sink logits already scaled by log2(e) (gpt-oss's attention
            sinks: a logit in the softmax's denominator with no value), or None.
    Returns:
        [1, H, T, D] in q's dtype (memory laid out as [1, T, H, D]).

    Raises:
        ValueError: ``pos`` is neither [T] nor [1]; ``split`` does not divide S.

    Launches on one device must not touch the counters at the same time: true of one stream and
    of graphs replayed on one stream. With PDL a launch may start while the
    kernel before it finishes, but it waits for that kernel before any memory access.
    """
    _, h, t, dim = q.shape
    hkv, cap = k.shape[1], k.shape[2]
    if split <= 0 or cap % split:
        raise ValueError(f"split_attention: {split} keys per program do not tile a capacity of {cap}")
    groups, nsplit = h // hkv, cap // split
    gp = math.gcd(heads_per_program, groups) if heads_per_program > 0 else groups  # 0: all G
    units, rows = hkv * (groups // gp), _rows(gp, t)  # programs per slice, rows per program
    if pos.dim() != 1 or pos.shape[0] not in (1, t):
        raise ValueError(f"split_attention: positions {tuple(pos.shape)} for {t} query rows (want [{t}] or [1])")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k, v = k.contiguous(), v.contiguous()  # no-ops for the caches
    s_pos = 0 if pos.shape[0] == 1 else pos.stride(0)  # [1]: every row reads the one position
    out = _out_like(q)
    pdl = pdl_supported(q.device) if pdl is None else pdl
    po = torch.empty(units, nsplit, rows, dim, dtype=torch.float32, device=q.device)
    pl = torch.empty(units, nsplit, rows, dtype=torch.float32, device=q.device)
    tune = {k: v for k, v in (("num_warps", warps), ("num_stages", stages)) if v}
    # a power of two (tl.arange); at most 16,384 / D keys per iteration: K and V tiles of a head
    # dim of 256 at 128 keys asked the H100 for 274 KB of shared memory (its limit: 227 KB)
    blk = 1 << (min(block or ITER_KEYS, split, max(16, 16384 // dim)).bit_length() - 1)
    while split % blk:  # the iterations must tile each slice (a multiple of 64)
        blk //= 2
    _split_kernel[(units, nsplit)](
        q, k, v, pos, out, po, pl, _counters(q.device, units), pl if sinks is None else sinks,
        scale * math.log2(math.e), cap, s_pos, max(window, 0),
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        out.stride(1), out.stride(2), po.stride(0), po.stride(1), po.stride(2),
        pl.stride(0), pl.stride(1),
        T=t, G=groups, GP=gp, D=dim, ROWS=rows, SPLIT_N=split, BLOCK=blk,
        IEEE=q.dtype == torch.float32, MERGE=nsplit > 1, PDL=pdl, ONE=one_slice if nsplit > 1 else 0, EARLY=early,
        WINDOW=window > 0, SINKS=sinks is not None,
        **({"launch_pdl": True} if pdl else {}),
        **tune,
    )  # fmt: skip
    return out


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
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, scale: float,
                  split: int, heads: int, block: int, one: int, early: bool, pdl: bool, window: int,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    return split_attention_kernel(q, k, v, pos, scale, split, heads, block, one_slice=one, early=early, pdl=pdl,
                                  window=window, sinks=sinks)  # fmt: skip


@_attention_op.register_fake
def _(q, k, v, pos, scale, split, heads, block, one, early, pdl, window, sinks=None):
    return _out_like(q)


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                    scale: float | None, early: bool = False, launch: Launch | None = None,
                    window: int | None = None, sinks: torch.Tensor | None = None,
                    sinks_log2: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """softmax(q k^T * scale) v over the keys at positions <= pos[t] (and > pos[t] - ``window``
    for a sliding-window layer), per query row t.

    Args:
        q: [1, H, T, D]; k, v: [1, Hkv, S, D] caches indexed by position (S a multiple of
        the split size, :func:`split_size`); pos: [T] int64 positions of the query rows
        (ascending; the last is the largest: keys at positions > pos[-1] are never read);
        scale: None = 1/sqrt(D). Non-causal rows (a draft block that sees all of itself):
        give every row the block's last position, e.g. as a [1] view (``pos[-1:]``).
        early: ``pos`` was written before the kernel that runs just before this one; under PDL
            it then loads before waiting for that kernel (when the ``attn_early`` setting says
            so). The static
            forwards pass it past their first layer (the draft: its first RoPE-kernel layer),
            where every position buffer made in the graph has been read once already, so it
            was written before an earlier layer's kernels (Inductor places a buffer's kernel
            just before its first reader, and makes a per-call copy of an unrealised tensor
            just before each: the forwards realise theirs, see
            :func:`dflash.backends.static.fused.realized`).
        launch: the settings (``attn_split``, ``attn_one_slice``, ``attn_block``,
            ``attn_early``) and PDL; None = :func:`~dflash.kernels.pdl.default_launch`.
        window: a sliding-window layer's window W (tokens, > 0; the key at pos[t] counts), as
            transformers' sliding masks (key > query - W); None = full causal attention.
        sinks: [H] per-head attention-sink logits (gpt-oss: each head's softmax denominator
            also counts exp(sink), a logit with no value), or None.
        sinks_log2: the same already as float32 times log2(e) (made once by the caller: no
            per-call conversion kernels), in place of ``sinks``.
    Returns:
        [1, H, T, D] in q's dtype.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    launch = default_launch(q.device) if launch is None else launch
    cfg, dim = launch.settings, q.shape[-1]
    split, one = split_size(k.shape[2], cfg.attn_split), one_slice(cfg, dim)
    if triton is None or (q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        # no kernel here (CPU, Triton absent or not interpreting): the same algorithm in torch
        if sinks is None and sinks_log2 is not None:
            sinks = sinks_log2 / math.log2(math.e)
        if sinks is None:
            return split_attention_reference(q, k, v, pos, scale, split, one, window or 0)
        return split_attention_reference(q, k, v, pos, scale, split, one, window or 0, sinks)
    groups, rows = q.shape[1] // k.shape[1], q.shape[2]
    sinks2 = sinks_log2 if sinks is None else sinks.float() * math.log2(math.e)  # base 2, as the kernel's logits
    return _attention_op(q, k, v, pos, float(scale), split, heads_per_program(groups, rows), cfg.attn_block,
                         one, early and cfg.attn_early, launch.pdl, window or 0, sinks2)  # fmt: skip


def split_attention_reference(q, k, v, pos, scale, split: int = 256, one_slice: int = 0,
                              window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The kernel's algorithm in torch (slices, per-slice softmax, log-sum-exp merge): [1, H, T, D].

    For tests on machines without Triton; arguments as :func:`split_attention`, ``split``,
    ``one_slice`` and ``window`` (0: none) as :func:`split_attention_kernel`'s; ``sinks`` [H]
    (natural-log logits) as :func:`split_attention`'s."""
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
        hidden = keys[None, None, :] > qpos[None, :, None]
        if window > 0:  # older than the window
            hidden = hidden | (keys[None, None, :] <= qpos[None, :, None] - window)
        s = s.masked_fill(hidden, float("-inf"))
        m = s.amax(-1, keepdim=True)
        p = torch.exp2(s - torch.where(m == float("-inf"), 0.0, m))  # 0 for rows with no key
        den = p.sum(-1, keepdim=True)
        o[:, sp, : groups * t] = (p @ v[0, :, lo:hi].float()) / den.clamp(min=1e-30)
        lse[:, sp, : groups * t] = torch.where(den[..., 0] > 0, m[..., 0] + torch.log2(den[..., 0]),
                                               float("-inf"))  # fmt: skip
    if sinks is not None:  # one more partial: no value, log-sum-exp = the head's sink (base 2)
        sink = (sinks.float() * math.log2(math.e)).view(hkv, groups, 1).expand(hkv, groups, t).reshape(hkv, 1, -1)
        lse_s = torch.full((hkv, 1, rows), float("-inf"))
        lse_s[:, :, : groups * t] = sink
        o = torch.cat((o, torch.zeros(hkv, 1, rows, dim)), 1)
        lse = torch.cat((lse, lse_s), 1)  # two partials at least: merge_partials merges
    return merge_partials(o, lse, h, t, q.dtype)
