"""The statistical check of the sampling tests and one torch thread for a block of code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np


def tv(counts: np.ndarray, p: np.ndarray) -> float:
    """Total-variation distance between the empirical distribution of ``counts`` (V,) or
    (..., V) and ``p`` (same shape): half the L1 distance, summed over all entries."""
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """One torch thread inside the block, the previous count restored after: tiny models run
    5-20x faster on one thread when other processes share two CPU cores, and float32 sums then
    add in the same order as a CLI subprocess run with ``OMP_NUM_THREADS=1``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
