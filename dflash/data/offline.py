"""The benchmark prompts shipped inside the package, for runs without the hub.

``dflash/assets/datasets/<name>.jsonl.gz`` holds, for each benchmark set (gsm8k, math500,
humaneval, mbpp, mt-bench), the rows of its test split that ``dflash benchmark`` picks first from
the full set (the ``random.Random(42)`` order of :func:`dflash.data.datasets.select`), in that
order, each with ``_index``, its row index in the split (the prompt id). So ``--max-samples N``
gives the same prompts, ids and order as the hub copy for N up to the shipped count (128; all 80
of MT-Bench). The licences are in ``dflash/assets/datasets/NOTICE.md``; the files are written by
``scripts/make_offline_datasets.py``.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from dflash.errors import DatasetError

OFFLINE_DIR = Path(__file__).resolve().parent.parent / "assets" / "datasets"


class ShippedPrompts(list):
    """Prompt items already in the benchmark's selection order (a prefix of it):
    :func:`dflash.data.datasets.select` takes the first N instead of shuffling.

    Attributes:
        total: how many prompts the full split has.
    """

    preselected = True

    def __init__(self, items: list, total: int):
        super().__init__(items)
        self.total = total


def shipped_index() -> dict[str, dict]:
    """name -> {"file", "rows", "of"} of the shipped sets ({} when the folder is missing)."""
    try:
        return json.loads((OFFLINE_DIR / "index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def shipped_rows(name: str) -> tuple[list[dict], int]:
    """The shipped rows of benchmark set ``name`` in selection order, and the full split's size.

    Raises:
        DatasetError: ``name`` is not shipped or its file cannot be read.
    """
    entry = shipped_index().get(name)
    if entry is None:
        raise DatasetError(f"Dataset '{name}' is not shipped with dflash.")
    path = OFFLINE_DIR / entry["file"]
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError, EOFError) as err:
        raise DatasetError(f"Could not read the shipped copy {path}: {err}.",
                           hint="reinstall dflash, or pass --data-dir DIR") from None  # fmt: skip
    return rows, int(entry["of"])


def announce(name: str, why: str, rows: int, total: int) -> None:
    """One stderr line: which prompts of ``name`` are used and why (``why``: ``--offline`` or
    the hub's reason)."""
    part = "all of them" if rows >= total else \
        f"the first {rows:,} of {total:,} in benchmark order; --data-dir DIR reads a full copy"  # fmt: skip
    print(f"dflash: {name}: {why}; using the {rows:,} test prompts shipped with dflash ({part})",
          file=sys.stderr, flush=True)  # fmt: skip
