"""A prefix cache for the plain transformers path: the target's K/V rows and context features
of earlier requests, reused by a request that starts with the same tokens (the next turn of a
chat, a shared system prompt).

When the backend is reset for a new request it stores what the last one fed the target (token
ids, each layer's K/V rows, and the target features of the rows whose features were kept);
``prefill`` then looks up the longest common prefix among the entries, restores those K/V
rows and runs the target only over the rest of the prompt. The draft gets the same context
features as without the cache (cached rows + new rows), so it recomputes its own context K/V
from them: the draft is small, and its cache is rebuilt every request anyway.

Entries are bounded in bytes (K/V + features) with least-recently-used eviction; an entry
whose tokens are a prefix of a newer one is dropped (the newer one covers it).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class Entry:
    """Cached rows of one earlier request.

    Attributes:
        ids: the token ids of the rows (N).
        layers: per target layer (keys, values), each [1, H_kv, N, D].
        feats: target features [Nf, F] of rows 0..Nf-1 (Nf <= N), or None.
        nbytes: bytes held by the tensors.
    """

    ids: tuple[int, ...]
    layers: list[tuple[Any, Any]]
    feats: Any
    nbytes: int


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """LRU store of :class:`Entry` bounded by ``max_bytes``; counts queries and hits in tokens.

    Args:
        max_bytes: the most bytes the entries may hold together (> 0).
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.nbytes = 0

    def lookup(self, ids: list[int], need_features: bool) -> tuple[Entry | None, int]:
        """(entry, n): the entry sharing the longest prefix with ``ids`` and its length n, at
        most len(ids) - 1 (the last prompt token is always run: its logits start the reply)
        and, when ``need_features``, at most the rows whose features it kept. (None, 0) when
        nothing matches."""
        best, best_n = None, 0
        for entry in self.entries.values():
            n = min(_common(entry.ids, ids), len(ids) - 1)
            if need_features:
                n = min(n, 0 if entry.feats is None else entry.feats.shape[0])
            if n > best_n:
                best, best_n = entry, n
        if best is not None:
            self.entries.move_to_end(best.ids)
        return best, best_n

    def store(self, ids: list[int], layers: list[tuple[Any, Any]], feats: Any) -> None:
        """Keep the rows of ``ids`` (see :class:`Entry`), evicting the least recently used
        entries to stay within ``max_bytes``; an entry larger than that is not kept."""
        key = tuple(ids)
        if not key or any(e[: len(key)] == key for e in self.entries):
            return  # an entry already covers these rows
        size = sum(t.numel() * t.element_size() for kv in layers for t in kv)
        if feats is not None:
            size += feats.numel() * feats.element_size()
        if size > self.max_bytes:
            return
        for old in [e for e in self.entries if key[: len(e)] == e]:  # covered by the new one
            self.nbytes -= self.entries.pop(old).nbytes
        while self.entries and self.nbytes + size > self.max_bytes:
            self.nbytes -= self.entries.popitem(last=False)[1].nbytes
        self.entries[key] = Entry(key, layers, feats, size)
        self.nbytes += size
