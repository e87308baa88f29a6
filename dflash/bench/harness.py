"""Run a benchmark through any pipeline that has ``chat_prompt``/``generate``/``block_size``.

For every response (a prompt turn) the baseline (block size 1, same backend code) runs first,
then DFlash; both are timed inside ``Pipeline.generate`` (TTFT apart from decode, CUDA-synced).
Each finished response is appended to the results JSONL at once, so a killed run loses nothing
and ``resume`` skips what is done. Under torchrun, rank r takes samples r::world and rank 0
gathers the records.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dflash.bench.metrics import ResponseRecord, RunStats, first_mismatch, prompt_fingerprint
from dflash.data.datasets import PromptItem
from dflash.errors import BackendError, DatasetError, InputError
from dflash.types import GenerationResult, SamplingParams

WARMUP_TOKENS = 64
Key = tuple[str, str, int]


class BenchPipeline(Protocol):
    """What the harness needs from ``dflash.api.Pipeline`` (any backend, or a test fake)."""

    block_size: int

    def chat_prompt(
        self, messages: list[dict], *, system: str | None = None, reasoning: str | None = None
    ) -> list[int]: ...

    def generate(
        self,
        prompt_ids: list[int],
        *,
        block_size: int | None = None,
        max_new_tokens: int = 2048,
        sampling: SamplingParams = ...,
        stop_ids: list[int] | None = None,
    ) -> GenerationResult: ...


@dataclass
class BenchConfig:
    """Settings of one benchmark run.

    Attributes:
        block_size: DFlash block size L, "auto", or None for the draft's trained block size.
        max_new_tokens: generation budget per response, tokens.
        sampling: sampling settings used by both the baseline and DFlash.
        reasoning: ``--reasoning`` value passed to the chat template (None: template default).
        check_parity: compare baseline and DFlash token ids per response.
        warmup: run one untimed warm-up generation (both block sizes) before measuring.
        run_info: extra settings stored in every record and checked on resume (model, draft...).
    """

    block_size: int | str | None = None
    max_new_tokens: int = 2048
    sampling: SamplingParams = field(default_factory=SamplingParams)
    reasoning: str | None = None
    check_parity: bool = False
    warmup: bool = True
    run_info: dict[str, Any] = field(default_factory=dict)

    def record_config(self, block_size: int | str) -> dict[str, Any]:
        """Settings that must match for records of two runs to be pooled."""
        s = self.sampling
        return {
            **self.run_info,
            "block_size": block_size,
            "max_new_tokens": self.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "seed": s.seed,
            "reasoning": self.reasoning,
        }


# ---------------------------------------------------------------------------------------------
# results JSONL


class ResultsLog:
    """Append-only JSONL of :class:`ResponseRecord` lines, one flushed line per response.

    Under a multi-process run each rank appends to ``<stem>.rank<r><suffix>`` next to ``path``;
    rank 0 writes the merged file at the end. Resuming reads the main file and all rank files.

    Args:
        path: the ``--output`` file; None keeps records in memory only.
        resume: continue an existing file; without it an existing non-empty file is an error.
        rank, world: this process's rank and the number of processes.

    Raises:
        InputError: the file exists and ``resume`` is off, or it cannot be written.
        DatasetError: a line in the middle of a file is not a valid record.
    """

    def __init__(
        self, path: str | Path | None, *, resume: bool = False, rank: int = 0, world: int = 1
    ):
        self.path = Path(path) if path is not None else None
        self.world = world
        self.done: dict[Key, ResponseRecord] = {}
        if self.path is None:
            self.write_path = None
            return
        self.write_path = (
            self.path
            if world == 1
            else self.path.with_name(f"{self.path.stem}.rank{rank}{self.path.suffix}")
        )
        existing = [p for p in self._all_files() if p.is_file() and p.stat().st_size > 0]
        if existing and not resume:
            raise InputError(
                f"{existing[0]} already holds results.",
                hint="pass --resume to continue that run, or choose another --output",
            )
        for p in existing:
            for record in read_records(p, repair=(p == self.write_path)):
                self.done.setdefault(record.key, record)
        try:  # find out now, not after loading the models and measuring the first response
            self.write_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.write_path, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise InputError(f"--output {self.write_path} cannot be written: {e.strerror}.",
                             hint="choose a writable --output file") from e  # fmt: skip

    def check_settings(self, config: BenchConfig) -> None:
        """Refuse to resume records made with other settings, before anything is loaded.

        The draft's block size is only known once it loads, so without ``--block-size`` that
        one key is compared per record later (in :func:`run_item`).

        Raises:
            InputError: a finished record differs in model, draft, budget, sampling...
        """
        for record in self.done.values():
            want = config.record_config(config.block_size or record.block_size)
            # Only what is known before loading: None means "resolved at load" (auto device,
            # dtype, graphs...); check_resumable compares everything once the models are up.
            want = {k: v for k, v in want.items() if v is not None}
            have = {k: record.config.get(k) for k in want}
            if have != want:
                raise InputError(
                    f"The results file holds {record.id} turn {record.turn} made with other "
                    f"settings ({_config_diff(have, want)}).",
                    hint="resume with the same options, or choose another --output",
                )

    def _all_files(self) -> list[Path]:
        assert self.path is not None
        ranks = sorted(self.path.parent.glob(f"{self.path.stem}.rank*{self.path.suffix}"))
        return [self.path, *ranks]

    def append(self, record: ResponseRecord) -> None:
        """Write one record as a line and flush it, so a killed process keeps it."""
        self.done[record.key] = record
        if self.write_path is None:
            return
        with open(self.write_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record.to_dict(), ensure_ascii=False) + "\n")
            f.flush()

    def write_merged(self, records: list[ResponseRecord]) -> None:
        """Rank 0 after gathering: write every record, in the given order, to the main file
        (atomic); :func:`in_prompt_order` gives the order one process writes."""
        if self.path is None or self.world == 1:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r.to_dict(), ensure_ascii=False) + "\n" for r in records)
        os.replace(tmp, self.path)


def read_records(path: str | Path, *, repair: bool = False) -> list[ResponseRecord]:
    """Read a results JSONL file; a torn last line (process killed mid-write) is dropped.

    Args:
        path: the JSONL file.
        repair: also fix the file's tail so appends start on a fresh line: a torn last line is
            cut, a complete last record without its newline gets one.

    Raises:
        DatasetError: a complete line (one ending in a newline) is not a valid record.
    """
    path = Path(path)
    raw = path.read_bytes()
    *body, tail = raw.split(b"\n")  # tail is b"" when the file ends with a newline
    records: list[ResponseRecord] = []
    for i, line in enumerate(body):
        if line.strip():
            record = _parse_record(line)
            if record is None:
                raise DatasetError(f"{path}:{i + 1} is not a valid results record.")
            records.append(record)
    last = _parse_record(tail) if tail.strip() else None
    if last is not None:
        records.append(last)
    if repair and tail:
        with open(path, "r+b") as f:
            if last is not None:
                f.seek(0, os.SEEK_END)
                f.write(b"\n")
            else:
                f.truncate(len(raw) - len(tail))
    return records


def _parse_record(line: bytes) -> ResponseRecord | None:
    try:
        return ResponseRecord.from_dict(json.loads(line))
    except (json.JSONDecodeError, UnicodeDecodeError, DatasetError):
        return None
    except (TypeError, AttributeError):  # valid JSON that is not an object
        return None


# ---------------------------------------------------------------------------------------------
# measuring


def measure(
    pipeline: BenchPipeline, prompt_ids: list[int], block_size: int | str, config: BenchConfig
) -> tuple[GenerationResult | None, GenerationResult]:
    """Generate one response with the baseline (block size 1) and then with DFlash."""
    kwargs = {"max_new_tokens": config.max_new_tokens, "sampling": config.sampling}
    base = pipeline.generate(prompt_ids, block_size=1, **kwargs)
    fast = pipeline.generate(prompt_ids, block_size=block_size, **kwargs)
    return base, fast


def measure_reference(pipeline: BenchPipeline, prompt_ids: list[int], config: BenchConfig):
    """The backend's own generator on the same prompt (mlx: mlx_lm.stream_generate), or None."""
    reference = getattr(pipeline, "reference_generate", None)
    if reference is None:
        return None
    return reference(prompt_ids, max_new_tokens=config.max_new_tokens, sampling=config.sampling)


def make_record(
    dataset: str,
    item_id: str,
    turn: int,
    prompt_ids: list[int],
    base: GenerationResult | None,
    fast: GenerationResult,
    config: BenchConfig,
    block_size: int | str,
    fingerprint: str | None = None,
) -> ResponseRecord:
    """Turn two generation results into the record written to JSONL (``fingerprint``: the
    prompt's :func:`~dflash.bench.metrics.prompt_fingerprint`)."""

    def stats(g: GenerationResult) -> RunStats:
        return RunStats(len(g.token_ids), float(g.ttft_s), float(g.decode_s), g.finish_reason)

    parity = mismatch = None
    if config.check_parity and base is not None:
        mismatch = first_mismatch(list(base.token_ids), list(fast.token_ids))
        parity = mismatch is None
    return ResponseRecord(
        dataset=dataset,
        id=item_id,
        turn=turn,
        prompt_tokens=len(prompt_ids),
        block_size=block_size if isinstance(block_size, int) else 1 + max(fast.proposed, default=0),
        dflash=stats(fast),
        baseline=stats(base) if base is not None else None,
        acceptance_lengths=[int(a) for a in fast.acceptance_lengths],
        proposed=[int(p) for p in fast.proposed],
        parity=parity,
        first_mismatch=mismatch,
        text=fast.text,
        config=config.record_config(block_size),
        prompt_sha1=fingerprint,
    )


def run_item(
    pipeline: BenchPipeline,
    dataset: str,
    item: PromptItem,
    config: BenchConfig,
    block_size: int | str,
    done: dict[Key, ResponseRecord],
) -> Iterator[tuple[ResponseRecord, bool]]:
    """Run every turn of one prompt; yields (record, measured_now).

    Turns are fed cumulatively: the DFlash answer of turn t is appended as the assistant message
    before turn t+1. A turn already in ``done`` is not measured again; its stored text is
    reused, after its messages are checked against the record's fingerprint (where stored).

    Raises:
        InputError: a stored turn was made with other settings or from another prompt.
    """
    messages: list[dict] = item.start_messages()
    for turn, text in enumerate(item.turns):
        messages.append({"role": "user", "content": text})
        record = done.get((dataset, item.id, turn))
        fresh = record is None
        fingerprint = prompt_fingerprint(messages, config.reasoning)
        if record is None:
            prompt_ids = pipeline.chat_prompt(messages, reasoning=config.reasoning)
            ref = measure_reference(pipeline, prompt_ids, config)
            base, fast = measure(pipeline, prompt_ids, block_size, config)
            record = make_record(dataset, item.id, turn, prompt_ids, base, fast, config, block_size, fingerprint)
            if record.parity is False and base is not None:
                from dflash.bench.parity import classify_mismatch

                classify_mismatch(pipeline, record, prompt_ids, base, fast, config.sampling,
                                  config.run_info.get("dtype"))  # fmt: skip
            if ref is not None:
                record.reference = RunStats(len(ref.token_ids), float(ref.ttft_s),
                                            float(ref.decode_s), ref.finish_reason)  # fmt: skip
                if record.parity is not None:  # parity also holds against the backend's own output
                    mismatch = first_mismatch(list(ref.token_ids), list(fast.token_ids))
                    if mismatch is not None and record.parity:
                        record.parity, record.first_mismatch = False, mismatch
        elif record.config != config.record_config(block_size):
            raise InputError(
                f"The results file holds {item.id} turn {turn} made with other settings "
                f"({_config_diff(record.config, config.record_config(block_size))}).",
                hint="resume with the same options, or choose another --output",
            )
        elif record.prompt_sha1 is not None and record.prompt_sha1 != fingerprint:
            raise InputError(
                f"The results file holds {item.id} turn {turn} made from other messages: the "
                "prompt or its system message changed.",
                hint="resume with the same prompts, or choose another --output",
            )
        yield record, fresh
        messages.append({"role": "assistant", "content": record.text})


def producer_info(pipeline: Any) -> dict[str, Any]:
    """What produces the tokens (backend impl, device, dtype, graphs, compile, versions), from
    ``pipeline.describe()`` when the pipeline has one; stored in every record's config."""
    describe = getattr(pipeline, "describe", None)
    return dict(describe()) if callable(describe) else {}


def check_resumable(records: Any, expected: dict[str, Any]) -> None:
    """Refuse to extend a results file whose records were made under another configuration.

    Args:
        records: the records already in the file (``ResultsLog.done.values()``).
        expected: ``BenchConfig.record_config(block_size)`` of this run.

    Raises:
        InputError: naming the first differing record and every differing setting.
    """
    for record in records:
        if record.config != expected:
            raise InputError(
                f"The results file was made under another configuration "
                f"({_config_diff(record.config, expected)}).",
                hint="resume with the same options and setup, or choose another --output",
            )


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _config_diff(old: dict, new: dict) -> str:
    """``key: old then new`` for every differing setting (nested dicts as ``a.b``)."""
    old, new = _flat(old), _flat(new)
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {old.get(k)!r} then {new.get(k)!r}" for k in keys)


def warm_up(pipeline: BenchPipeline, item: PromptItem, config: BenchConfig, block_size: int | str):
    """Untimed warm-up on the first prompt: min(64, budget) tokens at block 1 and at L, no stops."""
    ids = pipeline.chat_prompt(item.first_messages(), reasoning=config.reasoning)
    n = min(WARMUP_TOKENS, config.max_new_tokens)
    reference = getattr(pipeline, "reference_generate", None)
    if reference is not None:
        reference(ids, max_new_tokens=n, sampling=config.sampling)
    for bs in (1, block_size):
        pipeline.generate(
            ids, block_size=bs, max_new_tokens=n, sampling=config.sampling, stop_ids=[]
        )


def run_benchmark(
    pipeline: BenchPipeline,
    datasets: dict[str, list[PromptItem]],
    config: BenchConfig,
    *,
    log: ResultsLog | None = None,
    on_record: Callable[[ResponseRecord], None] | None = None,
    on_dataset: Callable[[str, int], None] | None = None,
) -> dict[str, list[ResponseRecord]]:
    """Benchmark every item of every dataset; returns the records per dataset.

    Args:
        pipeline: a loaded pipeline (``dflash.api.Pipeline`` or anything alike).
        datasets: dataset name -> the items this process runs (already selected and sharded).
        config: run settings.
        log: results file; its ``done`` records are reused instead of measured again.
        on_record: called with each record as it is ready (resumed ones included), for progress.
        on_dataset: called with (name, number of responses) when a dataset starts.

    Returns:
        name -> records of that dataset's items, in run order.
    """
    log = log or ResultsLog(None)
    block_size = config.block_size or pipeline.block_size
    config.run_info.update(producer_info(pipeline))  # every record says what produced it
    check_resumable(log.done.values(), config.record_config(block_size))
    todo = [
        (name, item)
        for name, items in datasets.items()
        for item in items
        if any((name, item.id, t) not in log.done for t in range(len(item.turns)))
    ]
    if config.warmup and todo:
        warm_up(pipeline, todo[0][1], config, block_size)
    results: dict[str, list[ResponseRecord]] = {}
    for name, items in datasets.items():
        if on_dataset:
            on_dataset(name, sum(len(item.turns) for item in items))
        results[name] = []
        for item in items:
            for record, fresh in run_item(pipeline, name, item, config, block_size, log.done):
                if fresh:
                    log.append(record)
                results[name].append(record)
                if on_record:
                    on_record(record)
    return results


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


def check_dataset_names(names: list[str]) -> list[str]:
    """Split and de-duplicate a ``--dataset a,b`` value.

    Raises:
        DatasetError: nothing left after splitting.
    """
    out = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    if not out:
        raise DatasetError("--dataset is empty.", hint="e.g. --dataset gsm8k or --dataset a.jsonl")
    return out
