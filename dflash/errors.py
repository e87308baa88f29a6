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

    # the hint the CLI prints when a raise site gives none ({command}: the dflash command run)
    fallback_hint = "run 'dflash {command} --help' for the options, 'dflash doctor' to check the install"

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"

    def hint_for(self, command: str) -> str:
        """The hint to print: the raise site's, else this error kind's general one."""
        return self.hint or self.fallback_hint.format(command=command or "COMMAND")


class ConfigError(DflashError):
    """A draft or target configuration is malformed, or the two do not fit together."""

    fallback_hint = ("use a draft made for this target ('dflash models' lists the published ones) or "
                     "make one with 'dflash init-draft --target ...'")  # fmt: skip


class CheckpointError(DflashError):
    """A checkpoint file or folder is missing, unreadable or corrupt."""

    fallback_hint = "check the path or hub id; a damaged download or conversion goes away when its folder is deleted"


class InputError(DflashError):
    """A user-supplied option or prompt is invalid (range, combination, length)."""

    fallback_hint = "run 'dflash {command} --help' for the options and their values"


class BackendError(DflashError):
    """A backend is unknown, not installed, or its device is unavailable."""

    fallback_hint = "'dflash doctor' shows which backends, paths and devices are usable here"


class DatasetError(DflashError):
    """A benchmark or training dataset is unknown or cannot be read."""

    fallback_hint = "check the dataset name or file ('dflash benchmark --help' lists both kinds)"


class ServerError(DflashError):
    """An OpenAI-compatible server could not be reached or answered with an error."""

    fallback_hint = "check that the server at --base-url is running and serves the model ('dflash serve' starts one)"


# the subcommands of `dflash` (a hint may name the one that failed)
COMMANDS = ("generate", "benchmark", "serve", "train", "data", "init-draft", "models", "doctor")


def report_error(err: DflashError) -> None:
    """Print a :class:`DflashError` as one red ``error:`` line and a dim ``hint:`` line on
    stderr (the error kind's general hint where the raise site gave none); under torchrun the
    line names the rank (``error: rank 1: ...``)."""
    import os
    import sys

    from rich.console import Console
    from rich.text import Text

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not err.message.startswith("rank ")
    rank = f"rank {os.environ.get('RANK', '?')}: " if multi else ""
    console.print(Text.assemble(("error: ", "bold red"), rank + err.message))
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
    console.print(Text("hint: " + err.hint_for(command if command in COMMANDS else ""), style="dim"))
