"""The split-KV attention's host-side settings: keys per program, the one-slice threshold, keys
per inner iteration and query heads per program (``DFLASH_ATTN_SPLIT``,
``DFLASH_DRAFT_ATTN_SPLIT``, ``DFLASH_ATTN_ONE_SLICE``, ``DFLASH_ATTN_BLOCK``). The kernel and
the ``DFLASH_ATTN`` switch live in :mod:`dflash.kernels.split_attention`, which re-exports
these names.
"""

from __future__ import annotations

import math
import os

SPLIT_ENV = "DFLASH_ATTN_SPLIT"
DRAFT_SPLIT_ENV = "DFLASH_DRAFT_ATTN_SPLIT"  # the draft's own, when set (an experiment)
BLOCK_ENV = "DFLASH_ATTN_BLOCK"
ONE_SLICE_ENV = "DFLASH_ATTN_ONE_SLICE"
SPLIT = 256  # keys per program (H200: the fastest at 512, 1,500 and 3,500 keys, both layouts)
ONE_SLICE = 448  # filled keys up to which one program takes them all, head dims > 64
ONE_SLICE_SMALL_HEADS = 640  # the same for head dims <= 64
SPLIT_MAX_ROWS = 32  # query rows (T) the kernel takes; prefill and longer forwards use SDPA
BLOCK_N = 64  # granularity of the split sizes (keys)
ITER_KEYS = 128  # keys per inner iteration (default; was 64 before the sixteenth session)


def default_split(head_dim: int | None = None) -> int:
    """Keys per program when ``DFLASH_ATTN_SPLIT`` is unset: :data:`SPLIT` (256) for every
    head dim; short filled lengths take one program (:func:`default_one_slice`).

    Measured on the H200 (``scripts/attn_sweep.py``, bf16, 2026-12-02, ``attn_sweep.json`` in
    ``h200-v16`` and ``h200-v17``): 256 keys per program was the fastest split at 1,500 and
    3,500 keys for both layouts (the demo's at 1,500 keys, one row: 6.7 us against 11.0 with
    1,024 and 8.0 with 512; Qwen3-8B's: 8.7 against 15.8 and 10.8) and at 512 keys for
    Qwen3-8B's (7.4 against 7.7 us in one slice). 128 for its 1-row steps (twenty-fourth
    session): block 1 4.098-4.113 against 4.118-4.128 ms at 528 keys, 4.260 against 4.213 at
    2,000; 16-row steps 5.21-5.27 against 5.10-5.12. Not a default.
    """
    return SPLIT


def default_one_slice(head_dim: int | None) -> int:
    """Filled keys up to which one program takes them all when neither ``DFLASH_ATTN_SPLIT``
    nor ``DFLASH_ATTN_ONE_SLICE`` is set: 640 for head dims <= 64, 448 above (None: 448).

    In one launch (H200, ``scripts/attn_sweep.py``, 2026-12-02) merging slices costs about 1.9
    us (the demo's layout) to 2.4 us (Qwen3-8B's), and one more inner iteration of 128 keys
    0.77 us (head dim 64, 3 KV heads) to 1.37 us (128, 8 KV heads): a second slice pays off past
    about 630 keys for head dim 64 (the demo pair: 4.4 us at 300 keys in one slice against 5.8
    us in two of 256) and past about 450 for 128.
    """
    return ONE_SLICE_SMALL_HEADS if head_dim is not None and head_dim <= 64 else ONE_SLICE


def split_setting(draft: bool = False, head_dim: int | None = None) -> int:
    """The keys per program asked for (``DFLASH_ATTN_SPLIT``, or for the draft
    ``DFLASH_DRAFT_ATTN_SPLIT`` when set; default :func:`default_split`, 256), before
    :func:`split_size` fits it to a cache; recorded with benchmark results.

    Raises:
        InputError: not a positive multiple of 64.
    """
    from dflash.errors import InputError

    name = DRAFT_SPLIT_ENV if draft and os.environ.get(DRAFT_SPLIT_ENV, "").strip() else SPLIT_ENV
    raw = os.environ.get(name, "").strip()
    value = int(raw) if raw.isascii() and raw.isdigit() else (default_split(head_dim) if not raw else -1)
    if value <= 0 or value % BLOCK_N:
        raise InputError(f"{name} must be a positive multiple of {BLOCK_N}, got {raw!r}.",
                         hint=f"unset it for the default ({SPLIT})")  # fmt: skip
    return value


def one_slice_setting(draft: bool = False, head_dim: int | None = None) -> int:
    """Filled keys up to which the kernel's first program takes every key alone (no merge),
    past which slices of :func:`split_size` keys share them: ``DFLASH_ATTN_ONE_SLICE`` when
    set (0: off); else 0 when the split asked for (``DFLASH_ATTN_SPLIT``, or for the draft
    ``DFLASH_DRAFT_ATTN_SPLIT``) is set, so that a split given is the split run; else
    :func:`default_one_slice` of ``head_dim``. 0 as well when not above the keys per program
    (:func:`split_setting`), where it would change nothing. Recorded with benchmark results.

    Raises:
        InputError: not a whole number >= 0, or a bad split setting.
    """
    raw = os.environ.get(ONE_SLICE_ENV, "").strip()
    if raw:
        if not (raw.isascii() and raw.isdigit()):
            from dflash.errors import InputError

            raise InputError(f"{ONE_SLICE_ENV} must be a whole number of keys (0 = off), got {raw!r}.",
                             hint="unset it for the default (640 keys for head dims <= 64, 448 above)")  # fmt: skip
        value = int(raw)
    elif os.environ.get(SPLIT_ENV, "").strip() or (draft and os.environ.get(DRAFT_SPLIT_ENV, "").strip()):
        return 0
    else:
        value = default_one_slice(head_dim)
    return value if value > split_setting(draft, head_dim) else 0  # not above the split: nothing to do


def split_size(capacity: int, draft: bool = False, head_dim: int | None = None) -> int:
    """Keys per program (``DFLASH_ATTN_SPLIT``, default :func:`default_split`, 256; one slice
    when >= capacity, then no merge is needed); the greatest common divisor of the setting and
    ``capacity`` (a multiple of 64), so the slices tile the cache. ``draft``: the draft's
    attention, which takes ``DFLASH_DRAFT_ATTN_SPLIT`` when that is set (an experiment) and the
    target's setting otherwise.

    Raises:
        InputError: not a positive multiple of 64.
    """
    value = split_setting(draft, head_dim)
    if value >= capacity:  # one slice
        return capacity
    return math.gcd(value, capacity)  # slices tile the capacity (a multiple of 64)


def iter_keys() -> int:
    """``DFLASH_ATTN_BLOCK``: keys per inner iteration of the kernel (32, 64 or 128; default
    128, lowered to a power of two dividing the split size). H200 (``scripts/attn_sweep.py``):
    128 was the fastest of 32/64/128 in every case timed but one (the demo's draft block at 160
    keys: 3.62 against 3.61 us with 64), e.g. 4.49 against 4.93 us for that block at 300 keys
    in one slice.

    Raises:
        InputError: another value.
    """
    raw = os.environ.get(BLOCK_ENV, "").strip()
    if not raw:
        return ITER_KEYS
    if raw not in ("32", "64", "128"):
        from dflash.errors import InputError

        raise InputError(f"{BLOCK_ENV} must be 32, 64 or 128, got {raw!r}.",
                         hint=f"unset it for the default ({ITER_KEYS})")  # fmt: skip
    return int(raw)


def heads_per_program(groups: int, rows: int) -> int:
    """Query heads of one KV head that each program takes: the largest divisor of the group
    size ``groups`` whose ``rows`` query rows fit one 16-row tensor-core tile, at least one.
    So a 16-row verify or draft block runs one program per query head (16 rows each, instead
    of the G*16 rows of a whole group padded to a power of two) and a 1-row decode step one
    per KV head, as before. H200, the demo's layout at 300 keys in one slice, 128 keys per
    iteration: 4.49 against 5.41 us for the draft's block.
    """
    best = 1
    for gp in range(1, groups + 1):
        if groups % gp == 0 and gp * rows <= max(16, rows):
            best = gp
    return best


EARLY_ENV = "DFLASH_ATTN_EARLY"


def early_setting() -> bool:
    """``DFLASH_ATTN_EARLY`` (``1``, the default, or ``0``): under PDL the split-KV attention
    loads the query positions (and so the filled length), and the RoPE + cache-write kernel its
    cos/sin rows, positions and norm weights, before waiting for the kernel just before them:
    those were written earlier (at the forward's start), so the loads overlap that kernel.
    Results do not change.

    The static forwards ask for it past their first layer (the draft: past its first layer
    through the RoPE kernel), where every buffer made in the graph for these kernels has been
    read once, so it was written before an earlier layer's kernels.

    Measured on the H200 (twenty-fifth session, ``benchmarks/results/h200-v25``, runs
    alternating on each of two machines): Qwen3-8B's block 1 4.099 ms against 4.111 / 4.118
    without, and 4.121 / 4.122 against 4.139 / 4.144; block 16 5.100 against 5.112 / 5.117; on
    the second machine the demo-shaped draft graph 0.144 against 0.149 ms and the block-16 loop
    step 0.752 against 0.764 (those runs let the draft's layers load early from their second
    layer on, before its cache-row positions were made one buffer). Loading each slice's first
    K/V tile (the rows below the forward's first position) before the wait as well was slower:
    4.203 / 4.200 and 5.197 / 5.193 ms, the demo's verify-1 graph 0.582 against 0.569 ms; removed.

    Raises:
        InputError: another value.
    """
    from dflash.errors import env_choice

    return env_choice(EARLY_ENV, ("1", "0")) == "1"
