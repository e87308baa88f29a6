"""Presenting benchmark summaries: rich tables, a terminal histogram, a live progress bar, and an
optional matplotlib figure (``--plot hist.png``; matplotlib is an optional dependency).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from dflash.bench.metrics import ResponseRecord, mean_acceptance_length, throughput
from dflash.errors import InputError
from dflash.paths import make_parent, refuse_folder

BAR_WIDTH = 40


def _fmt(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def summary_table(name: str, summary: dict[str, Any], parity_asked: bool = False,
                  requested: Any = None) -> Table:  # fmt: skip
    """One rich table of a dataset's summary (see :func:`dflash.bench.metrics.summarize`);
    ``parity_asked`` (``--check-parity``): the parity row even when no response was checked
    (all resumed from a run without it); ``requested``: the ``--block-size`` asked for, so that
    ``auto`` reads "auto (widest N)" rather than as a fixed N."""
    table = Table(title=f"dflash benchmark: {name}", title_justify="left", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    ms = 1000.0
    parity = summary["parity"]
    rows = [
        ("responses (prompts)", f"{summary['responses']} ({summary['prompts']})"),
        ("block size", f"auto (widest {summary['block_size']})" if requested == "auto" else str(summary["block_size"])),
        ("baseline decode tok/s", _fmt(summary["baseline_tok_s"])),
        ("DFlash decode tok/s", _fmt(summary["dflash_tok_s"])),
        ("decoding speedup", _fmt(summary["speedup"], ".2f", "x")),
        ("τ mean of responses", _fmt(summary["tau_mean_of_responses"], ".3f")),
        ("τ step-weighted", _fmt(summary["tau_step_weighted"], ".3f")),
        ("baseline TTFT", _fmt(_scale(summary["baseline_ttft_s"], ms), ".1f", " ms")),
        ("DFlash TTFT", _fmt(_scale(summary["dflash_ttft_s"], ms), ".1f", " ms")),
        ("tokens baseline / DFlash", f"{summary['baseline_tokens']} / {summary['dflash_tokens']}"),
        ("verify steps", str(summary["verify_steps"])),
    ]
    if "reference_tok_s" in summary:
        rows[5:5] = [("mlx_lm stream_generate tok/s", _fmt(summary["reference_tok_s"])),
                     ("speedup vs mlx_lm", _fmt(summary["speedup_vs_reference"], ".2f", "x"))]  # fmt: skip
    if parity["checked"] or parity_asked:
        rows.append(("greedy parity", parity_text(parity, summary["responses"])))
        if parity["checked"] > parity["matched"]:
            rows.append(("mismatches: near-tie / unexplained",
                         f"{parity.get('near_tie', 0)} / {parity.get('unexplained', 0)}"))  # fmt: skip
    for metric, value in rows:
        table.add_row(metric, value)
    return table


def parity_text(parity: dict[str, Any], responses: int) -> str:
    """``3/3 identical``, or with responses resumed from a run without --check-parity
    ``1/1 identical, 2 of 3 responses not checked``."""
    text = f"{parity['matched']}/{parity['checked']} identical"
    unchecked = responses - parity["checked"]
    if unchecked:
        text += f", {unchecked} of {responses} responses not checked"
    return text


def sweep_table(name: str, rows: list[tuple[Any, dict[str, Any]]]) -> Table:
    """One row per block size of a ``--block-size a,b,c`` sweep (None = the draft's own)."""
    table = Table(title=f"dflash benchmark sweep: {name}", title_justify="left")
    for col in ("block size", "baseline tok/s", "DFlash tok/s", "speedup", "τ", "mean L",
                "verify steps", "parity"):  # fmt: skip
        table.add_column(col, justify="right")
    for bs, s in rows:
        parity = s["parity"]
        table.add_row(
            "draft's" if bs is None else str(bs),
            _fmt(s["baseline_tok_s"], ".1f"),
            _fmt(s["dflash_tok_s"], ".1f"),
            _fmt(s["speedup"], ".2f", "x"),
            _fmt(s["tau_mean_of_responses"], ".2f"),
            _fmt(s.get("mean_block_size"), ".2f"),
            str(s["verify_steps"]),
            f"{parity['matched']}/{parity['checked']}" if parity["checked"] else "-",
        )
    return table


def _scale(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def histogram_lines(summary: dict[str, Any]) -> list[Text]:
    """Terminal bars: fraction of verify steps per acceptance length 1..B, plus per-position rates.

    Bars are scaled to the largest bin so small blocks stay readable; the percentage is exact.
    """
    fractions = summary["histogram_fractions"]
    counts = summary["histogram"]
    top = max(fractions, default=0.0) or 1.0
    lines = [Text("acceptance length histogram (verify steps, τ incl. bonus)", style="bold")]
    for b, (frac, count) in enumerate(zip(fractions, counts, strict=True), start=1):
        bar = "█" * round(BAR_WIDTH * frac / top)
        lines.append(
            Text.assemble(f"{b:>3} ", (bar.ljust(BAR_WIDTH), "cyan"), f" {frac:6.1%} ({count})")
        )
    rates = summary["per_position_acceptance"]
    if rates:
        cells = " ".join(_fmt(None if r is None else 100 * r, ".0f") for r in rates)
        lines.append(Text(f"per-position acceptance % (draft pos 1..{len(rates)}): {cells}"))
    return lines


def upstream_lines(summary: dict[str, Any]) -> list[str]:
    """The five summary lines in the exact format upstream DFlash prints (brief §7.3).

    The histogram there has buckets 0..B (bucket 0 is always 0.0%).
    """
    buckets = ["0.0%"] + [f"{100 * f:.1f}%" for f in summary["histogram_fractions"]]
    tau = summary["tau_mean_of_responses"]
    return [
        f"Baseline throughput: {_fmt(summary['baseline_tok_s'])} tok/s",
        f"DFlash throughput:  {_fmt(summary['dflash_tok_s'])} tok/s",
        f"Decoding speedup: {_fmt(summary['speedup'])}",
        f"Average Acceptance length: {'n/a' if tau is None else f'{tau:.2f}'}",
        f"Acceptance length histogram: {buckets}",
    ]


def print_summary(console: Console, name: str, summary: dict[str, Any], parity_asked: bool = False,
                  requested: Any = None) -> None:  # fmt: skip
    """Table, terminal histogram, parity mismatches and upstream-format lines of one dataset
    (``parity_asked``, ``requested``: see :func:`summary_table`)."""
    console.print(summary_table(name, summary, parity_asked, requested))
    if summary.get("by_prompt_length"):
        console.print(length_table(name, summary["by_prompt_length"]))
    for line in histogram_lines(summary):
        console.print(line)
    for m in summary["parity"]["mismatches"]:
        console.print(
            Text(
                f"parity mismatch: {m['dataset']} {m['id']} turn {m['turn']} "
                f"first differs at new token {m['first_mismatch']}"
                + ("" if m.get("near_tie") is None else
                   f" ({'near-tie' if m['near_tie'] else 'unexplained'}, "
                   f"gap {_fmt(m['tie_gap'], '.3g')} logits)"),  # fmt: skip
                style="bold red",
            )
        )
    for line in upstream_lines(summary):
        console.print(line, highlight=False)
    console.print()


def length_table(name: str, rows: list[dict[str, Any]]) -> Table:
    """τ and speedup by prompt length (:func:`dflash.bench.metrics.by_prompt_length`)."""
    table = Table(title=f"{name}: by prompt length (tokens)", title_justify="left")
    for col in ("prompt", "responses", "mean prompt", "τ", "baseline tok/s", "DFlash tok/s", "speedup"):
        table.add_column(col, justify="left" if col == "prompt" else "right")
    for r in rows:
        table.add_row(r["bucket"], str(r["responses"]), f"{r['prompt_tokens']:,.0f}", _fmt(r["tau"], ".2f"),
                      _fmt(r["baseline_tok_s"], ".1f"), _fmt(r["dflash_tok_s"], ".1f"),
                      _fmt(r["speedup"], ".2f") + ("x" if r["speedup"] else ""))  # fmt: skip
    return table


class BenchProgress:
    """Live progress bar (stderr) with running τ and DFlash tok/s; silent when disabled.

    Use as a context manager; call :meth:`start` per dataset and :meth:`update` per record.
    Redrawn only at those calls (no refresh thread): between records the measured generation
    runs alone in the process, with no 10 Hz redraw taking the interpreter lock from it.
    """

    def __init__(self, enabled: bool = True, console: Console | None = None):
        self.enabled = enabled
        self._records: list[ResponseRecord] = []
        self._task: TaskID | None = None
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("τ {task.fields[tau]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
            disable=not enabled,
            transient=False,
            auto_refresh=False,
        )

    def __enter__(self) -> BenchProgress:
        # The display starts with the first dataset: stopped before it, rich's final render of
        # no bars was an empty line on stderr (not a terminal) before an error such as
        # "--block-size 100 exceeds ..." raised by the warm-up.
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress.live.is_started:
            self._progress.stop()

    def start(self, name: str, total: int) -> None:
        """Begin a dataset of ``total`` responses."""
        self._records = []
        if not self._progress.live.is_started:
            self._progress.start()
        self._task = self._progress.add_task(name, total=total, tau="-", tps="-")
        self._progress.refresh()

    def update(self, record: ResponseRecord) -> None:
        """Advance by one response and refresh the running τ and tok/s."""
        self._records.append(record)
        if self._task is None:
            return
        tau = mean_acceptance_length(self._records)
        tps = throughput(self._records, "dflash")
        self._progress.update(self._task, advance=1, tau=_fmt(tau, ".2f"), tps=_fmt(tps, ".1f"),
                              refresh=True)  # fmt: skip


def check_plot(path: Path) -> None:
    """Raise before any work when ``--plot`` cannot be written: a folder, matplotlib missing, an
    image format matplotlib cannot write (from the suffix), or a folder that cannot hold it
    (created if missing, as ``--output`` does).

    Raises:
        InputError: with the fix in its hint.
    """
    refuse_folder(path, "--plot", "hist.png")
    if importlib.util.find_spec("matplotlib") is None:
        raise InputError(
            "--plot needs matplotlib, which is not installed.", hint="pip install matplotlib"
        )
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()  # {"png": "Portable Network Graphics", ...}
    suffix = path.suffix.lower().lstrip(".")
    if suffix and suffix not in kinds:  # no suffix: PNG (see save_plot)
        raise InputError(f"--plot {path}: matplotlib cannot write .{suffix}.",
                         hint=f"end the name with one of {', '.join('.' + k for k in sorted(kinds))}")  # fmt: skip
    make_parent(path, "--plot")  # now, not after the whole benchmark (and no file: ranks may race)
    target = path if path.exists() else path.parent
    if not os.access(target, os.W_OK):
        raise InputError(f"--plot {path} cannot be written: {target} is not writable.",
                         hint="choose a writable --plot file")  # fmt: skip


def save_plot(path: str | Path, summaries: dict[str, dict[str, Any]]) -> Path:
    """Draw the acceptance histogram and per-position acceptance of each dataset to an image.

    Args:
        path: output image (format from the suffix, e.g. ``.png``, ``.svg``).
        summaries: dataset name -> summary dict.

    Returns:
        The path written.
    """
    import matplotlib

    path = Path(path)
    path = path if path.suffix else path.with_suffix(".png")  # matplotlib's default format
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, (ax_hist, ax_pos) = plt.subplots(1, 2, figsize=(12, 4.5))
    n = max(len(summaries), 1)
    width = 0.8 / n
    for i, (name, s) in enumerate(summaries.items()):
        bins = range(1, len(s["histogram_fractions"]) + 1)
        heights = [100 * f for f in s["histogram_fractions"]]
        ax_hist.bar([b + (i - (n - 1) / 2) * width for b in bins], heights, width, label=name)
        rates = s["per_position_acceptance"]
        pos = [k for k, r in enumerate(rates, start=1) if r is not None]
        ax_pos.plot(pos, [100 * r for r in rates if r is not None], marker="o", label=name)
    ax_hist.set(
        xlabel="acceptance length τ (tokens per verify step, bonus incl.)",
        ylabel="% of verify steps",
        title="Acceptance length histogram",
    )
    ax_pos.set(
        xlabel="draft position k",
        ylabel="% accepted | positions < k accepted",
        title="Per-position acceptance",
        ylim=(0, 105),
    )
    size = max((len(s["histogram"]) for s in summaries.values()), default=1)
    ax_hist.set_xticks(range(1, size + 1))
    ax_pos.set_xticks(range(1, max(size, 2)))
    ax_pos.set_xlim(0.5, max(size, 2) - 0.5)
    for ax in (ax_hist, ax_pos):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
