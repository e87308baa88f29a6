"""Progress bars on stderr for the slow steps of a first run: the GGUF conversion of a target
and the cost calibration of ``--block-size auto`` (each a minute or more on a small CPU, once).

On a terminal the bar moves; on a pipe or file (logs, tests) rich draws it once, finished, when
the step ends. stdout is never touched: the generated text and ``--json`` stay clean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def step_progress(description: str, total: int | None) -> Iterator[Callable[..., None]]:
    """A bar for one step with ``total`` units (None: a spinner with the elapsed time).

    Yields:
        ``advance(n=1, description=None, total=None)``: count ``n`` units done; a new
        ``description`` replaces the bar's label (e.g. the phase of a conversion), a ``total``
        sets the units once they are known.
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        columns += [BarColumn(), MofNCompleteColumn()]
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True, highlight=False)) as bar:
        task = bar.add_task(description, total=total)

        def advance(n: int = 1, description: str | None = None, total: int | None = None) -> None:
            extra = {"description": description} if description else {}
            if total is not None:  # the units became known (a spinner turns into a bar)
                extra["total"] = total
                if not any(isinstance(c, BarColumn) for c in bar.columns):
                    bar.columns = (*bar.columns[:2], BarColumn(), MofNCompleteColumn(), *bar.columns[2:])
            bar.update(task, advance=n, **extra)

        yield advance
