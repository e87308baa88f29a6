"""The ``dflash`` command line: parse, dispatch, print.

    dflash generate transformers "Write a Python function that returns the square of a number."
    dflash benchmark transformers --dataset gsm8k --max-samples 8
    dflash init-draft --target M --out DIR
    dflash serve                # port 30000; then: dflash generate openai "Hi"
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Annotated

import typer

from dflash.errors import DflashError, report_error  # noqa: F401 - report_error re-exported

app = typer.Typer(
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    add_completion=False,
    help="Lossless speculative decoding with block-diffusion (DFlash) drafts.",
)

# Commands live beside the code they drive; each module imports heavy libraries lazily.
from dflash.commands import generate, init_draft  # noqa: E402

app.command("generate")(generate)
app.command("init-draft")(init_draft)

from dflash.bench.command import benchmark  # noqa: E402
from dflash.train.command import data_app, train  # noqa: E402

app.command("benchmark")(benchmark)

from dflash.serve.command import serve  # noqa: E402  (fastapi/uvicorn are imported when it runs)

app.command("serve")(serve)
app.command("train")(train)
app.add_typer(data_app, name="data")

from dflash.doctor import doctor  # noqa: E402
from dflash.registry import models  # noqa: E402

app.command("models")(models)
app.command("doctor")(doctor)


def version_line() -> str:
    """What ``dflash --version`` prints: this project's version and the distribution that
    installed it, kept apart from the DFlash authors' PyPI package of the same import name."""
    from importlib import metadata

    from dflash import __version__

    dists = metadata.packages_distributions().get("dflash") or []
    where = f"distribution {dists[0]}" if dists else "a source tree"
    return (f"dflash {__version__} (this project, from its repository: {where}; the PyPI package "
            "'dflash' is the DFlash authors' reference code, not this)")  # fmt: skip


def _version(value: bool) -> None:
    if value:
        print(version_line())
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Lossless speculative decoding with block-diffusion (DFlash) drafts."""


def main() -> None:
    """Entry point of the ``dflash`` console script; turns DflashError into exit code 1."""
    try:
        app(standalone_mode=True)
    except DflashError as err:
        if os.environ.get("DFLASH_DEBUG"):
            raise
        report_error(err)
        sys.exit(1)
    except OSError as err:  # a path that is a file where a folder is needed, and the like
        if os.environ.get("DFLASH_DEBUG"):
            raise
        from dflash.paths import file_in_the_way

        name = getattr(err, "filename", None)
        blocker = file_in_the_way(name) if name and err.errno in (errno.EEXIST, errno.ENOTDIR) else None
        if blocker is not None:  # mkdir -p through a file: "File exists: <the folder to make>"
            report_error(DflashError(f"{name} cannot be made: {blocker} is a file, not a folder.",
                                     hint=f"choose another path, or move the file {blocker} away"))  # fmt: skip
        else:
            where = f": {name}" if name else ""
            report_error(DflashError(f"{err.strerror or err}{where}.", hint="check the path"))
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
