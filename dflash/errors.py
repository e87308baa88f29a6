"""One error type tree for dflash; every message is one sentence plus an optional hint.

The CLI (``dflash/cli.py``) catches :class:`DflashError` and prints ``error: <message>`` and
``hint: <hint>`` to stderr with exit code 1; ``DFLASH_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations


class DflashError(Exception):
    """Base class of every error dflash reports to a user.

    Args:
        message: one sentence saying what is wrong.
        hint: optional one sentence saying what to do about it.
    """

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class ConfigError(DflashError):
    """A draft or target configuration is malformed, or the two do not fit together."""


class CheckpointError(DflashError):
    """A checkpoint file or folder is missing, unreadable or corrupt."""


class InputError(DflashError):
    """A user-supplied option or prompt is invalid (range, combination, length)."""


class BackendError(DflashError):
    """A backend is unknown, not installed, or its device is unavailable."""


class DatasetError(DflashError):
    """A benchmark or training dataset is unknown or cannot be read."""


class ServerError(DflashError):
    """An OpenAI-compatible server could not be reached or answered with an error."""


def report_error(err: DflashError) -> None:
    """Print a :class:`DflashError` as one red ``error:`` line (+ dim ``hint:``) on stderr;
    under torchrun the line names the rank (``error: rank 1: ...``)."""
    import os

    from rich.console import Console
    from rich.text import Text

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not err.message.startswith("rank ")
    rank = f"rank {os.environ.get('RANK', '?')}: " if multi else ""
    console.print(Text.assemble(("error: ", "bold red"), rank + err.message))
    if err.hint:
        console.print(Text("hint: " + err.hint, style="dim"))
