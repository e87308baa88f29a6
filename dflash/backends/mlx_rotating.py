"""Exact rollback of mlx-lm's rotating (sliding-window) KV caches.

mlx-lm gives the sliding-window layers of gemma3_text, gemma4_text and gpt_oss targets (and the
multimodal wrappers around them) a ``RotatingKVCache`` of ``max_size`` = the window: one-token
decoding writes each token's K/V row into a ring buffer of ``max_size`` rows, over the oldest
row. A verify of W tokens goes through the cache's multi-token path instead: it puts the rows in
temporal order, keeps the newest ``max_size - 1`` and appends the W new rows (a new array; the
buffer it read is left as it was). mlx-lm's own ``trim`` only moves the offsets, which leaves
the rejected rows inside the buffer, where a later one-token step can attend to them.

Here a verify keeps the cache's pre-verify state (the buffer arrays, offset and write index:
references, no copy, :func:`snapshot`), and the rollback to ``count`` committed tokens puts that
state back and writes the first ``count`` of the verify's new K/V rows one at a time exactly as
one-token decoding writes them (:func:`restore`): mlx-lm's ``_update_in_place``, or the same
ring slots in at most two slice updates once the ring has its full size. The result is the state
one-by-one decoding of the committed tokens leaves (buffer, offset, write index), which the
tests check array for array. Nothing is lost to eviction: the pre-verify buffer is the one the
verify's multi-token path did not modify.
"""

from __future__ import annotations

from typing import Any

ROTATING = "RotatingKVCache"


def is_rotating(cache: Any) -> bool:
    """Whether ``cache`` is mlx-lm's (single-sequence) ``RotatingKVCache``."""
    from mlx_lm.models.cache import RotatingKVCache

    return type(cache) is RotatingKVCache


def snapshot(cache: Any) -> tuple:
    """The state of a rotating cache before a verify: (keys [B, Hkv, S, D] | None, values,
    offset, write index). References only: the multi-token update builds new arrays and leaves
    these as they are."""
    return cache.keys, cache.values, cache.offset, cache._idx


def _slots(idx: int, n: int, max_size: int, keep: int) -> list[tuple[int, int, int]]:
    """Ring writes of n rows from write index ``idx`` as one-token decoding makes them, grouped
    into contiguous runs: (first slot, first row, rows) each; the index wraps from ``max_size``
    to ``keep``."""
    runs: list[tuple[int, int, int]] = []
    row = 0
    while row < n:
        if idx == max_size:
            idx = keep
        take = min(n - row, max_size - idx)
        runs.append((idx, row, take))
        idx += take
        row += take
    return runs


def restore(cache: Any, state: tuple, steps: int, count: int) -> None:
    """Set a rotating cache to the state after the first ``count`` of the ``steps`` tokens of
    the verify it just ran, as one-token decoding of those tokens would leave it.

    Args:
        cache: the rotating cache after a verify of ``steps`` > 1 tokens (its last ``steps``
            rows in temporal order are the verify's new K/V, [B, Hkv, steps, D]).
        state: :func:`snapshot` taken before that verify.
        steps: tokens of the verify; count: tokens kept (1 <= count <= steps).
    """
    new_k = cache.keys[..., -steps:, :]
    new_v = cache.values[..., -steps:, :]
    cache.keys, cache.values, cache.offset, cache._idx = state
    if count <= 0:
        return
    k0 = cache.keys
    if k0 is not None and k0.shape[2] == cache.max_size:
        # a full-size ring: one-token decoding neither grows nor trims it, only rotates the index
        runs = _slots(cache._idx, count, cache.max_size, cache.keep)
        for slot, row, n in runs:
            cache.keys[..., slot : slot + n, :] = new_k[..., row : row + n, :]
            cache.values[..., slot : slot + n, :] = new_v[..., row : row + n, :]
        cache._idx = runs[-1][0] + runs[-1][2]
        cache.offset += count
        return
    for i in range(count):  # growing (prompt shorter than the window): mlx-lm's own one-token write
        cache._update_in_place(new_k[..., i : i + 1, :], new_v[..., i : i + 1, :])
