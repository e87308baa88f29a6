"""The results JSONL of ``dflash benchmark`` and the checks that make resuming it safe.

:class:`BenchConfig` (the settings a record stores), :class:`ResultsLog` (one flushed line per
response, one file per torchrun rank), :func:`read_records` (a torn last line dropped) and
:func:`check_resumable` (a file extended only under the same configuration). Re-exported by
:mod:`dflash.bench.harness`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.bench.metrics import ResponseRecord
from dflash.errors import DatasetError, InputError
from dflash.paths import make_parent
from dflash.types import SamplingParams

Key = tuple[str, str, int]


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
        # find out now, not after loading the models and measuring the first response
        make_parent(self.write_path, "--output")
        try:
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
