"""A prompt of a dataset, and the text-file reader that every prompt source shares."""

from __future__ import annotations

import gzip
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from dflash.errors import DatasetError


@dataclass
class PromptItem:
    """One prompt of a dataset.

    Attributes:
        id: stable identifier, unique within its dataset (used to resume benchmark runs).
        turns: user turns in order; one for single-turn prompts, two for MT-Bench.
        system: an optional system message sent before the first user turn (prompt files only).
        reference: what ``dflash benchmark --score`` checks a response against: ``answer``
            (gsm8k, math500), ``prompt``/``test``/``entry_point`` (humaneval),
            ``test_list``/``test_imports`` (mbpp); None for other sets.
    """

    id: str
    turns: list[str] = field(default_factory=list)
    system: str | None = None
    reference: dict | None = field(default=None, compare=False, repr=False)

    def start_messages(self) -> list[dict]:
        """The chat messages before the first user turn: the system message, if any."""
        return [{"role": "system", "content": self.system}] if self.system else []

    def first_messages(self) -> list[dict]:
        """The system message (if any) and the first user turn, as chat messages."""
        return [*self.start_messages(), {"role": "user", "content": self.turns[0]}]


def open_text(path: Path) -> Iterable[str]:
    """The lines of a UTF-8 text file (gzipped when it ends in .gz).

    Raises:
        DatasetError: a line is not valid UTF-8 (naming the file and line).
    """
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DatasetError(f"{path}:{lineno} is not valid UTF-8 (byte 0x{raw[err.start]:02x}).",
                                   hint="convert the file to UTF-8, e.g. with iconv -t UTF-8") from None  # fmt: skip
