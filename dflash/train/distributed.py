"""Data-parallel training under torchrun (``torchrun --nproc-per-node N -m dflash train ...``).

Each of the W ranks holds the whole draft (wrapped in torch's DistributedDataParallel) and the
whole frozen target, and trains on its part of every global batch:

- global batches are ``make_batches(lengths, batch_tokens * W, ...)``, so ``--batch-tokens``
  is per rank and one process with ``--batch-tokens W*b`` sees the same batches;
- a global batch's sequences (in ascending length order) are cut into W contiguous parts of
  equal count (:func:`rank_part`); a rank whose part is empty (a batch with fewer than W
  sequences) runs a zero-weight copy of the batch's first sequence, so every rank joins every
  gradient all-reduce;
- anchors are drawn per sequence (seed, epoch, sequence index), so they do not depend on how
  the batch was cut or padded;
- every rank's loss is its weighted sum over the global weight sum, times W
  (:func:`global_step_stats`): DDP's gradient average is then the gradient of the global
  batch's weighted mean loss, i.e. the step one process takes on the global batch.

Rank 0 alone evaluates held-out τ (the result is broadcast, so all ranks keep the same log)
and writes checkpoints, logs and the exported draft; the other ranks wait at a barrier.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from dflash.bench.distributed import DistInfo, barrier
from dflash.train.objective import StepOutput

__all__ = ["barrier", "from_rank0", "global_step_stats", "rank_part", "wrap"]


def rank_part(idx: list[int], info: DistInfo) -> tuple[list[int], bool]:
    """This rank's sequences of one global batch.

    Args:
        idx: the global batch's sequence indices, ascending by length (as ``make_batches``
            builds them).
        info: rank and world size.

    Returns:
        (indices, empty): contiguous part ``rank`` of ``world`` parts of equal count (±1);
        with ``empty`` True the part had no sequence and ``idx[:1]`` is returned, to be run
        with zero loss weight.
    """
    n, r, w = len(idx), info.rank, info.world
    part = idx[r * n // w : (r + 1) * n // w]
    return (part, False) if part else (idx[:1], True)


def wrap(draft: torch.nn.Module, info: DistInfo) -> torch.nn.Module:
    """The module that runs the draft's forward: a DDP wrapper when world > 1, else ``draft``.

    Buffers (rotary tables) are constant and not broadcast; every parameter takes part in
    every forward, so unused-parameter detection stays off. DDP broadcasts rank 0's
    parameters at construction.
    """
    if info.world == 1:
        return draft
    from torch.nn.parallel import DistributedDataParallel

    with warnings.catch_warnings():  # torch >= 2.13 deprecates the flag; its replacement syncs
        warnings.filterwarnings("ignore", message=".*broadcast_buffers", category=FutureWarning)
        return DistributedDataParallel(draft, broadcast_buffers=False, find_unused_parameters=False)


def global_step_stats(out: StepOutput, info: DistInfo) -> tuple[torch.Tensor, StepOutput]:
    """All-reduce one step's statistics; return the loss to backpropagate and global statistics.

    Args:
        out: this rank's :func:`~dflash.train.objective.batch_loss` result (weighted mean loss
            over its part; ``weight`` = its slot-weight sum).

    Returns:
        (loss for backward = local mean x local weight / global weight x W, StepOutput with the
        global weighted loss, accuracy and training τ; ``blocks`` stays this rank's count).
    """
    w = out.weight.float()
    blocks = torch.as_tensor(out.blocks, device=w.device).float()
    stats = torch.stack([out.loss.detach().float() * w, out.accuracy.float() * w,
                         (out.accept.float() - 1.0) * blocks, w, blocks])  # fmt: skip
    torch.distributed.all_reduce(stats)
    total = stats[3].clamp(min=1e-12)
    loss = out.loss * (w * info.world / total)
    glob = StepOutput(stats[0] / total, stats[1] / total, 1.0 + stats[2] / stats[4].clamp(min=1),
                      out.blocks, stats[3])  # fmt: skip
    return loss, glob


def from_rank0(value: Any, info: DistInfo) -> Any:
    """Rank 0's ``value`` on every rank (a picklable object; also a barrier)."""
    if info.world == 1:
        return value
    box = [value if info.rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
