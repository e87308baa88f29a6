"""Batching training sequences: samples cut to ``--max-len`` (:func:`prepare`), grouped into
length-sorted batches of a token budget (:func:`make_batches`) and right-padded into tensors
(:func:`collate`). :mod:`dflash.train.data` re-exports every name here.
"""

from __future__ import annotations

import random

from dflash.train.shards import Sample


def prepare(samples: list[Sample], max_len: int) -> list[tuple[list[int], int]]:
    """Samples -> (token ids, response start) cut to ``max_len``; too-short ones are dropped.

    A sequence keeps its prompt and as much response as fits; it needs two response tokens
    (one anchor and one label) to be useful.
    """
    out = []
    for s in samples:
        ids = (s.prompt_ids + s.response_ids)[:max_len]
        if len(ids) - len(s.prompt_ids) >= 2:
            out.append((ids, len(s.prompt_ids)))
    return out


def make_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Group sequence indices into batches of at most ``batch_tokens`` padded tokens.

    Indices are shuffled with ``Random(seed, epoch)``, sorted by length inside windows of 64
    batches' worth (little padding), and the batches are shuffled again. Deterministic.
    """
    rng = random.Random(seed * 10_007 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = max(1, 64 * batch_tokens // max(1, max(lengths, default=1)))
    batches: list[list[int]] = []
    for lo in range(0, len(order), window):
        chunk = sorted(order[lo : lo + window], key=lambda i: lengths[i])
        cur: list[int] = []
        for i in chunk:
            if cur and (len(cur) + 1) * lengths[i] > batch_tokens:  # chunk is ascending
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(seqs: list[tuple[list[int], int]], pad_id: int, multiple: int = 1):
    """Right-pad sequences into tensors.

    Args:
        seqs: (token ids, response start) pairs.
        pad_id: id written into padding (never attended, never a label).
        multiple: round the width up to a multiple of this (shape bucketing).

    Returns:
        input_ids [B, S] int64, attention_mask [B, S] int64, loss_mask [B, S] bool (True at
        response positions).
    """
    import torch

    width = max(len(ids) for ids, _ in seqs)
    width = -(-width // multiple) * multiple
    b = len(seqs)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    att = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width), dtype=torch.bool)
    for r, (ids, start) in enumerate(seqs):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        att[r, : len(ids)] = 1
        loss_mask[r, start : len(ids)] = True
    return input_ids, att, loss_mask
