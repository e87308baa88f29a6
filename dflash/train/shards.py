"""The shards of a training-data folder: :class:`Sample` (one sequence), :class:`ShardWriter`
(appends records to ``shard-NNNNN.jsonl`` and keeps the atomic resume cursor
``progress.json``) and :func:`read_shards` (reads them back). :mod:`dflash.train.data`
re-exports every name here.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

from dflash.errors import DatasetError, InputError

RECORDS_PER_SHARD = 4000


def _short(value, width: int = 60) -> str:
    """``repr`` of a setting for an error line, cut to ``width`` characters."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


@dataclass
class Sample:
    """One training sequence: a chat-templated prompt and the target's response (token ids)."""

    id: str
    prompt_ids: list[int]
    response_ids: list[int]


class ShardWriter:
    """Appends records to JSONL shards and keeps an atomic resume cursor (``progress.json``).

    The cursor names the finished jobs by their place in generation order: ``done`` (every
    place below it is finished) plus ``extra`` (finished places above it; continuous batching
    finishes jobs out of order). Records are fsynced before the cursor moves, and a resume cuts
    the current shard back to the cursor's byte offset, so an interruption at any point loses
    and duplicates nothing.

    Args:
        folder: the data folder (created).
        meta: settings written to ``meta.json``; a resume must find the same settings.

    Raises:
        InputError: the folder holds data made with other settings.
    """

    def __init__(self, folder: str | Path, meta: dict):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        meta_path = self.folder / "meta.json"
        if not ShardWriter.check(self.folder, meta):
            meta_path.write_text(json.dumps(meta, indent=2) + "\n")
        prog = self.folder / "progress.json"
        self.state = json.loads(prog.read_text()) if prog.is_file() else {
            "done": 0, "shard": 0, "offset": 0, "records": 0, "finished": False}  # fmt: skip
        self.state.setdefault("extra", [])
        path = self.shard_path
        if path.exists() and path.stat().st_size > self.state["offset"]:
            with path.open("r+b") as f:  # drop anything written after the last cursor update
                f.truncate(self.state["offset"])

    @staticmethod
    def check(folder: str | Path, meta: dict) -> bool:
        """Whether ``folder`` already holds data with these settings (nothing is written).

        Raises:
            InputError: it holds data made with other settings.
        """
        meta_path = Path(folder) / "meta.json"
        if not meta_path.is_file():
            return False
        old = json.loads(meta_path.read_text())
        if old != meta:
            diff = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
            said = ", ".join(f"{k} {_short(old.get(k))} -> {_short(meta.get(k))}" for k in diff)
            raise InputError(f"{folder} holds data made with other settings ({said}).",
                             hint="use a new --out folder or the same settings to resume")  # fmt: skip
        return True

    @staticmethod
    def finished_count(folder: str | Path) -> int | None:
        """The number of responses of a folder whose run finished, else None."""
        prog = Path(folder) / "progress.json"
        if not prog.is_file():
            return None
        state = json.loads(prog.read_text())
        return int(state["done"]) + len(state.get("extra", [])) if state.get("finished") else None

    @property
    def shard_path(self) -> Path:
        return self.folder / f"shard-{self.state['shard']:05d}.jsonl"

    @property
    def done(self) -> int:
        """Number of jobs finished (in generation order: a prefix plus out-of-order ones)."""
        return int(self.state["done"]) + len(self.state["extra"])

    def completed(self) -> set[int]:
        """Places (in generation order) of every finished job."""
        return set(range(int(self.state["done"]))) | set(self.state["extra"])

    def append(self, records: list[dict], finished: int | list[int]) -> None:
        """Write records, flush them to disk, then move the cursor.

        Args:
            records: the records to append.
            finished: the new prefix count (int), or the generation-order places these records
                complete (list).
        """
        if self.state["records"] >= RECORDS_PER_SHARD:
            self.state.update(shard=self.state["shard"] + 1, offset=0, records=0)
        with self.shard_path.open("ab") as f:
            for r in records:
                f.write((json.dumps(r, separators=(",", ":")) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
            offset = f.tell()
        if isinstance(finished, int):
            prefix, extra = finished, {x for x in self.state["extra"] if x >= finished}
        else:
            prefix, extra = int(self.state["done"]), set(self.state["extra"]) | set(finished)
        while prefix in extra:  # fold the out-of-order places into the prefix
            extra.discard(prefix)
            prefix += 1
        self.state.update(done=prefix, extra=sorted(extra), offset=offset,
                          records=self.state["records"] + len(records))  # fmt: skip
        self._save()

    def finish(self) -> None:
        """Mark the folder complete (all prompts answered)."""
        self.state["finished"] = True
        self._save()

    def _save(self) -> None:
        tmp = self.folder / "progress.json.tmp"
        tmp.write_text(json.dumps(self.state))
        tmp.replace(self.folder / "progress.json")


def read_shards(folder: str | Path) -> list[Sample]:
    """Read every ``*.jsonl`` / ``*.jsonl.gz`` shard of a data folder, in name order.

    A final line cut off mid-write (no newline) is skipped; any other bad line is an error.

    Raises:
        DatasetError: no folder, no shards, or a malformed record.
    """
    folder = Path(folder)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise DatasetError(f"Data folder {folder} {what}.",
                           hint="pass the folder 'dflash data regenerate --out DIR' wrote")  # fmt: skip
    files = sorted(p for p in folder.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))
    if not files:
        raise DatasetError(f"Data folder {folder} holds no .jsonl shards.",
                           hint="create them with 'dflash data regenerate --out DIR'")  # fmt: skip
    samples: list[Sample] = []
    for path in files:
        opener = gzip.open if path.name.endswith(".gz") else open
        try:
            with opener(path, "rt", encoding="utf-8") as f:
                lines = f.read().split("\n")
        except (OSError, EOFError, UnicodeDecodeError) as e:  # a bad or truncated gzip, not UTF-8
            raise DatasetError(f"Cannot read shard {path}: {type(e).__name__} {e}.",
                               hint="regenerate the shard with 'dflash data regenerate'") from e  # fmt: skip
        last = len(lines) - 1  # the text after the final newline ('' when complete)
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids = row["prompt_ids"], row["response_ids"]
                if not all(isinstance(x, list) and all(type(t) is int for t in x) for x in ids):
                    raise TypeError("token ids must be lists of integers")
                samples.append(Sample(str(row["id"]), list(ids[0]), list(ids[1])))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                if n == last:  # cut off by an interrupted write
                    continue
                raise DatasetError(f"{path}:{n + 1} is not a training record ({type(e).__name__}).",
                                   hint="regenerate the shard with 'dflash data regenerate'") from e  # fmt: skip
    if not samples:
        raise DatasetError(f"Data folder {folder} holds no records.",
                           hint="regenerate it with 'dflash data regenerate'")  # fmt: skip
    return samples
