"""torchrun placement for ``dflash benchmark`` and ``dflash train``: rank r takes r::world.

Reading ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``, the process group (NCCL on CUDA, gloo on CPU)
and its timeout, per-rank devices, barriers, and rank 0 gathering the benchmark records in the
order one process would write them. Re-exported by :mod:`dflash.bench.harness`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash.bench.metrics import ResponseRecord
from dflash.data.datasets import PromptItem
from dflash.errors import BackendError, InputError

# ---------------------------------------------------------------------------------------------
# torchrun: rank r takes r::world; rank 0 gathers


@dataclass(frozen=True)
class DistInfo:
    """Process placement read from torchrun's environment (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0


DIST_TIMEOUT_S = 1800.0  # a collective that waits longer than this fails (``DFLASH_DIST_TIMEOUT``)


def dist_timeout_s() -> float:
    """Seconds a collective may wait for the other ranks (env ``DFLASH_DIST_TIMEOUT``, else 1800).

    Raises:
        InputError: the variable is not a positive number.
    """
    raw = os.environ.get("DFLASH_DIST_TIMEOUT")
    if raw is None:
        return DIST_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise InputError(f"DFLASH_DIST_TIMEOUT must be a number of seconds > 0, got {raw!r}.")
    return value


def init_distributed(device: str = "auto") -> DistInfo:
    """Read ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; init a process group only when RANK is set.

    The group is NCCL when the run uses CUDA (each rank on ``cuda:LOCAL_RANK``) and gloo on CPU
    (``device == "cpu"`` or no CUDA), with a :func:`dist_timeout_s` timeout so that a rank that
    died or hangs ends the run instead of blocking the others forever.

    Args:
        device: the ``--device`` option (auto, cuda, cuda:N or cpu).

    Raises:
        InputError: ``--device cuda:N`` under torchrun (each rank takes cuda:LOCAL_RANK), or more
            processes on this machine than visible GPUs.
        BackendError: ``--device cuda`` without CUDA.
    """
    if "RANK" not in os.environ:
        return DistInfo()
    info = DistInfo(
        int(os.environ["RANK"]),
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )
    if info.world > 1:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        if device.startswith("cuda:"):
            raise InputError(f"--device {device} under torchrun: each rank uses cuda:LOCAL_RANK.",
                             hint="pass --device cuda (or auto); choose GPUs with CUDA_VISIBLE_DEVICES")  # fmt: skip
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise BackendError("--device cuda under torchrun, but no CUDA device is available.",
                               hint="use --device cpu (gloo) or auto")  # fmt: skip
        cuda = device != "cpu" and torch.cuda.is_available()
        if cuda:
            if info.local_rank >= torch.cuda.device_count():
                raise InputError(f"torchrun started local rank {info.local_rank} but only "
                                 f"{torch.cuda.device_count()} GPU(s) are visible.",
                                 hint="pass --nproc-per-node <= the number of GPUs")  # fmt: skip
            torch.cuda.set_device(info.local_rank)
        if not dist.is_initialized():
            bound = {"device_id": torch.device("cuda", info.local_rank)} if cuda else {}
            dist.init_process_group("nccl" if cuda else "gloo", init_method="env://",
                                    timeout=timedelta(seconds=dist_timeout_s()), **bound)  # fmt: skip
    return info


def finish_distributed(info: DistInfo, failed: bool = False) -> None:
    """Tear down the process group made by :func:`init_distributed` (no-op for one process).

    With ``failed`` (this rank is leaving on an exception) the group is left alone: a clean
    teardown could wait on ranks that still sit in a collective; torchrun ends them once this
    process exits non-zero.
    """
    if info.world > 1 and not failed:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def rank_device(info: DistInfo, device: str) -> str:
    """The device this rank runs on: ``cuda:LOCAL_RANK`` under torchrun unless the run is on
    the CPU (``--device cpu`` or no CUDA); ``device`` unchanged for one process."""
    if info.world == 1 or device == "cpu":
        return device
    import torch

    return f"cuda:{info.local_rank}" if torch.cuda.is_available() else "cpu"


def barrier(info: DistInfo) -> None:
    """Wait for every rank (no-op for one process)."""
    if info.world > 1:
        import torch.distributed as dist

        dist.barrier()


def once_per_machine(info: DistInfo, fn: Callable[[], Any]) -> None:
    """Run ``fn`` on local rank 0 while the other ranks wait (e.g. converting a .gguf into the
    shared cache, which concurrent ranks would race on); just ``fn()`` for one process."""
    if info.world == 1:
        fn()
        return
    if info.local_rank == 0:
        fn()
    barrier(info)


def shard(items: list[PromptItem], info: DistInfo) -> list[PromptItem]:
    """The items of this rank: ``items[rank::world]``."""
    return items[info.rank :: info.world]


class RankFailure(BackendError):
    """A rank of a torchrun benchmark failed; every rank raises it after the gather."""


def gather_records(
    results: dict[str, list[ResponseRecord]] | None, info: DistInfo, error: str | None = None
) -> dict[str, list[ResponseRecord]] | None:
    """Gather every rank's records on rank 0 (None on other ranks); a no-op for one process.

    Args:
        results: this rank's records per dataset (None when it failed).
        error: this rank's failure, one line (None when it succeeded). A failed rank still joins
            the gather, so the others never wait for it.

    Raises:
        RankFailure: on every rank, when any rank reported an error (rank 0 broadcasts the
            message ``rank r failed: ...``, one part per failed rank).
    """
    if info.world == 1:
        return results
    import torch.distributed as dist

    payload = {
        "records": {name: [r.to_dict() for r in recs] for name, recs in (results or {}).items()},
        "error": error,
    }
    gathered: list[Any] | None = [None] * info.world if info.rank == 0 else None
    dist.gather_object(payload, gathered, dst=0)
    failed = [(r, p["error"]) for r, p in enumerate(gathered or []) if p["error"]]
    box = ["; ".join(f"rank {r} failed: {e}" for r, e in failed)]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise RankFailure(box[0], hint="the records done so far stay in the rank files; fix the "
                                       "cause and rerun with --resume")  # fmt: skip
    if info.rank != 0:
        return None
    merged: dict[str, list[ResponseRecord]] = {name: [] for name in results or {}}
    for part in gathered or []:
        for name, recs in part["records"].items():
            merged.setdefault(name, []).extend(ResponseRecord.from_dict(r) for r in recs)
    return merged


def in_prompt_order(
    gathered: dict[str, list[ResponseRecord]], selected: dict[str, list[PromptItem]]
) -> dict[str, list[ResponseRecord]]:
    """The gathered records in the order one process runs them: datasets as selected, then
    prompts as selected, then turns (ranks return ``items[r::world]`` each, one after the other).
    """
    out: dict[str, list[ResponseRecord]] = {}
    for name in [*selected, *(n for n in gathered if n not in selected)]:
        if name not in gathered:
            continue
        index = {item.id: i for i, item in enumerate(selected.get(name, []))}
        out[name] = sorted(gathered[name], key=lambda r: (index.get(r.id, len(index)), r.id, r.turn))
    return out
