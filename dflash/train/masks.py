"""Training-time block layout: random anchors, block tokens/labels/weights, attention masks.

Paper §4.2 / brief §8.2. A batch row holds one sequence (context: S positions 0..S-1) followed
by N blocks of L slots. Block j opens at anchor a_j: slot 0 is the anchor token, slots 1..L-1 the
mask token; slot k sits at position a_j + k and is trained to predict the token there. A block
query sees context keys c < a_j (the anchor's own feature is not context, as at inference) and
the keys of its own block only (bidirectional; causal and windowed on sliding layers).
Two equivalent masks: a dense bool [B, 1, N*L, S+N*L] (CPU, any device) and a FlexAttention
BlockMask (CUDA).
"""

from __future__ import annotations

import math

import torch

PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
FLEX_TILE = 128  # FlexAttention's query and key tile (BlockMask BLOCK_SIZE)


def default_gamma(block_size: int) -> float:
    """Loss-decay gamma: the paper's 7/5/4 for L = 16/10/8, else L/2 (brief §8.1)."""
    return PAPER_GAMMA.get(block_size, block_size / 2.0)


def slot_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """Per-slot loss weights [L] float32: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1."""
    g = default_gamma(block_size) if gamma is None else gamma
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1).clamp(min=0) / g)
    w[0] = 0.0
    return w


def sample_anchors(
    loss_mask: torch.Tensor,
    max_anchors: int,
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick anchor positions uniformly without replacement, per row.

    A position i is a candidate when it and i+1 are both supervised (response) positions, so every
    block has at least one label. Rows with fewer candidates than the batch width are padded with
    anchor 0 and ``keep`` False.

    Args:
        loss_mask: [B, S] bool, True at response positions.
        max_anchors: cap on blocks per row (the ``--anchors`` option).
        generator: CPU torch generator for reproducible draws (None: global RNG), or one
            generator per row: a row's kept anchors then depend only on its own generator and
            its loss mask (not on the other rows or the padded width), so a sequence gets the
            same anchors in any batch (data-parallel training relies on it).

    Returns:
        anchors: [B, N] int64 ascending per row (padding 0 last), N = min(cap, most candidates).
        keep: [B, N] bool, False for padding blocks.
    """
    b, s = loss_mask.shape
    cand = torch.zeros_like(loss_mask)
    cand[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
    counts = cand.sum(1)
    n = int(min(max_anchors, int(counts.max()) if b else 0))
    if n == 0:
        empty = torch.zeros(b, 0, dtype=torch.long, device=loss_mask.device)
        return empty, empty.bool()
    if isinstance(generator, list):  # keys over the row's own positions (up to its last label)
        ends = (s - loss_mask.flip(1).int().argmax(1)).tolist()
        keys = torch.full((b, s), 2.0)
        for r, (g, end) in enumerate(zip(generator, ends, strict=True)):
            keys[r, :end] = torch.rand(end, generator=g)
        keys = keys.to(loss_mask.device)
    else:
        keys = torch.rand(b, s, generator=generator).to(loss_mask.device)  # random order per row
    keys = torch.where(cand, keys, torch.full_like(keys, 2.0))  # non-candidates last
    picked = keys.argsort(dim=1)[:, :n]  # [B, N]
    keep = torch.arange(n, device=loss_mask.device)[None] < counts[:, None]
    anchors = torch.where(keep, picked, torch.full_like(picked, s))
    anchors, _ = anchors.sort(dim=1)  # padding (= s) sorts last
    anchors = torch.where(keep, anchors, torch.zeros_like(anchors))
    return anchors, keep


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    gamma: float | None = None,
) -> dict[str, torch.Tensor]:
    """Block inputs, positions, labels and loss weights for sampled anchors.

    Args:
        input_ids: [B, S] int64 token ids (right padded).
        loss_mask: [B, S] bool, True at supervised (response) positions.
        anchors: [B, N] int64; keep: [B, N] bool (see :func:`sample_anchors`).
        block_size: L.
        mask_token_id: id fed at slots 1..L-1 (and at every slot of a padding block).
        gamma: loss-decay gamma (None: :func:`default_gamma`).

    Returns:
        dict with ``block_ids`` [B, N*L] int64, ``q_pos`` [B, N*L] int64 absolute positions,
        ``labels`` [B, N*L] int64 (-100 where unsupervised), ``weights`` [B, N*L] float32
        (slot weight where the label is valid, else 0).
    """
    b, s = input_ids.shape
    n, lsz = anchors.shape[1], block_size
    k = torch.arange(lsz, device=input_ids.device)
    pos = anchors[:, :, None] + k  # [B, N, L] absolute position of each slot
    inside = pos < s
    safe = pos.clamp(max=s - 1)
    tok = torch.gather(input_ids, 1, safe.view(b, n * lsz)).view(b, n, lsz)
    sup = torch.gather(loss_mask, 1, safe.view(b, n * lsz)).view(b, n, lsz)
    valid = inside & sup & keep[:, :, None] & (k > 0)  # slot 0 is never a label
    block_ids = torch.full_like(tok, mask_token_id)
    block_ids[:, :, 0] = torch.where(
        keep, tok[:, :, 0], torch.full_like(tok[:, :, 0], mask_token_id)
    )
    w = slot_weights(lsz, gamma).to(input_ids.device)
    return {
        "block_ids": block_ids.view(b, n * lsz),
        "q_pos": pos.view(b, n * lsz),
        "labels": torch.where(valid, tok, torch.full_like(tok, -100)).view(b, n * lsz),
        "weights": (valid.float() * w).view(b, n * lsz),
    }


def _visible(q, kv, anchors_of, seq_len: int, block_size: int, window: int | None, causal: bool):
    """Shared mask rule over broadcastable index tensors; ``anchors_of(j)`` gives a_j."""
    j, k = q // block_size, q % block_size
    a = anchors_of(j)
    is_ctx = kv < seq_len
    ctx_ok = is_ctx & (kv < a)
    kb = kv - seq_len  # slot index among block keys (negative for context keys)
    blk_ok = (~is_ctx) & (torch.div(kb, block_size, rounding_mode="floor") == j)
    kk = torch.remainder(kb, block_size)
    if causal:
        blk_ok = blk_ok & (kk <= k)
    if window is not None:
        ctx_ok = ctx_ok & (kv >= a + k - (window - 1))
        blk_ok = blk_ok & (k - kk < window)
        if not causal:
            blk_ok = blk_ok & (kk - k < window)
    return ctx_ok | blk_ok


def dense_mask(
    anchors: torch.Tensor, seq_len: int, block_size: int, window: int | None = None,
    causal: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Dense attention mask for the training layout (True = may attend).

    Args:
        anchors: [B, N] int64 anchor positions (padding blocks: 0, so they see only themselves).
        seq_len: S, the number of context rows (keys 0..S-1).
        block_size: L.
        window: sliding window W in tokens for sliding layers, else None.
        causal: within-block causality (sliding layers by default, or ``is_causal``).

    Returns:
        [B, 1, N*L, S + N*L] bool; keys ordered [context rows; block rows].
    """
    b, n = anchors.shape
    lq = n * block_size
    dev = anchors.device
    q = torch.arange(lq, device=dev)[None, :, None]  # [1, Lq, 1]
    kv = torch.arange(seq_len + lq, device=dev)[None, None, :]  # [1, 1, Tk]
    a_per_q = anchors.repeat_interleave(block_size, dim=1)[:, :, None]  # [B, Lq, 1]
    ok = _visible(q, kv, lambda j: a_per_q, seq_len, block_size, window, causal)
    return ok[:, None]


def flex_block_mask(
    anchors: torch.Tensor, seq_len: int, block_size: int, window: int | None = None,
    causal: bool = False, tile: int = FLEX_TILE,
):  # fmt: skip
    """FlexAttention BlockMask equal to :func:`dense_mask` (same arguments).

    The tile map is built from the anchors directly (:func:`anchor_tiles`): a few small
    tensors instead of evaluating the rule on every [B, N*L, S+N*L] pair as
    ``create_block_mask`` does. Tiles partly visible keep the exact rule as ``mask_mod``.

    Args:
        tile: query and key tile size of the BlockMask (FlexAttention's default 128).

    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` over [B, 1, N*L, S + N*L].
    """
    from torch.nn.attention.flex_attention import BlockMask

    lq = anchors.shape[1] * block_size

    def mask_mod(bi, hi, qi, kvi):
        return _visible(qi, kvi, lambda j: anchors[bi, j], seq_len, block_size, window, causal)

    for dim in (0, 1):  # the compiled kernel keeps B and N symbolic (no recompile per shape)
        if anchors.shape[dim] >= 2:
            torch._dynamo.mark_dynamic(anchors, dim)
    partial, full = anchor_tiles(anchors, seq_len, block_size, window, tile)
    counts = [m.sum(-1, dtype=torch.int32)[:, None] for m in (partial, full)]  # [B, 1, Qt]
    order = [m.to(torch.int8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)[:, None]
             for m in (partial, full)]  # fmt: skip
    return BlockMask.from_kv_blocks(counts[0], order[0], counts[1], order[1], BLOCK_SIZE=tile,
                                    mask_mod=mask_mod, seq_lengths=(lq, seq_len + lq))  # fmt: skip


def anchor_tiles(
    anchors: torch.Tensor, seq_len: int, block_size: int, window: int | None, tile: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which [tile x tile] pieces of the :func:`dense_mask` layout hold visible pairs.

    A query tile covers blocks j0..j1 with anchors between a_min and a_max. A context key tile
    [c0, c1) is visible when c0 < a_max (windowed: also c1 - 1 >= a_min - (W - 1)), and wholly
    visible (``full``, no ``mask_mod`` needed) when c1 <= a_min without a window. A block key
    tile is visible when its blocks meet j0..j1; it is never full. Visible-but-not-full tiles
    may hold hidden pairs (``partial``: the kernel applies the rule there), so the BlockMask
    equals the dense mask exactly.

    Args:
        anchors: [B, N] int64 (padding blocks: 0); seq_len: S; block_size: L.
        window: sliding window W or None; tile: tile size.

    Returns:
        (partial, full): [B, ceil(N*L / tile), ceil((S + N*L) / tile)] bool, disjoint.
    """
    b, n = anchors.shape
    lq, dev = n * block_size, anchors.device
    tk = seq_len + lq
    nq, nk = -(-lq // tile), -(-tk // tile)
    a_q = anchors.repeat_interleave(block_size, dim=1)  # [B, Lq] anchor of each query
    pad = nq * tile - lq
    a_max = torch.nn.functional.pad(a_q, (0, pad), value=-1).view(b, nq, tile).amax(-1)[..., None]
    a_min = torch.nn.functional.pad(a_q, (0, pad), value=seq_len).view(b, nq, tile).amin(-1)[..., None]
    lo = torch.arange(nk, device=dev) * tile  # first key of each key tile
    hi = (lo + tile).clamp(max=tk)  # one past its last key
    c_hi = hi.clamp(max=seq_len)  # one past its last context key
    has_ctx = lo < seq_len
    ctx = has_ctx & (lo < a_max)  # [B, Nq, Nk]
    if window is not None:
        ctx = ctx & (c_hi - 1 >= a_min - (window - 1))
    full = has_ctx & (hi <= seq_len) & (c_hi <= a_min) if window is None else torch.zeros_like(ctx)
    q0 = torch.arange(nq, device=dev) * tile
    j0 = (q0 // block_size)[:, None]  # [Nq, 1] blocks of each query tile
    j1 = ((q0 + tile).clamp(max=lq) - 1) // block_size
    jb0 = (lo.clamp(min=seq_len) - seq_len) // block_size  # blocks of each key tile
    jb1 = (hi - 1 - seq_len) // block_size
    blk = (hi > seq_len) & (jb0 <= j1[:, None]) & (jb1 >= j0)  # [Nq, Nk]
    full = full & ~blk
    return (ctx | blk) & ~full, full


def layer_masks(cfg, anchors: torch.Tensor, seq_len: int, flex: bool = False) -> dict:
    """Masks for each layer type of a draft config (brief §2.5): {layer type: mask}.

    Full-attention layers are bidirectional in the block unless ``is_causal`` says otherwise;
    sliding layers are causal (unless overridden) and windowed.
    """
    build = flex_block_mask if flex else dense_mask
    out: dict = {}
    for i, kind in enumerate(cfg.layer_types):
        if kind not in out:
            out[kind] = build(anchors, seq_len, cfg.block_size, cfg.layer_window(i),
                              cfg.layer_is_causal(i))  # fmt: skip
    return out


def round_up(x: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= x (shape bucketing for compiled kernels)."""
    return int(math.ceil(x / multiple) * multiple)
