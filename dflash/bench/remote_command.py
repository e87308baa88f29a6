"""``dflash benchmark openai`` entry point and its report (tables on stdout, progress on stderr,
one JSON line last, ``--output`` JSONL and ``--plot`` like the local backends)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from dflash.backends.openai import RetryPolicy, api_root, chat_error_hint
from dflash.bench import report
from dflash.bench.harness import check_dataset_names
from dflash.bench.remote import (
    Endpoint,
    JsonlWriter,
    RemoteConfig,
    RemoteRecord,
    dataset_summary,
    run_side,
    take_prompts,
)
from dflash.data.datasets import PromptItem, load_prompts, select
from dflash.errors import InputError, ServerError
from dflash.paths import refuse_folder
from dflash.types import SamplingParams

NOT_REPORTED = "not reported by server"


def _bounds(concurrency: int, num_prompts: int | None, max_new_tokens: int,
           max_retries: int) -> tuple[tuple[str, int | None, int, str], ...]:  # fmt: skip
    """(option, value, least value, hint) of the integer options, checked before any request."""
    return (
        ("--concurrency", concurrency, 1, "it is how many requests are in flight at once: use 1 (the default, "
         "one after another) or more, e.g. --concurrency 8"),
        ("--num-prompts", num_prompts, 1, "drop it to use every prompt"),
        ("--max-new-tokens", max_new_tokens, 1, "e.g. --max-new-tokens 256"),
        ("--max-retries", max_retries, 0, "use 0 to send each request once, or more to retry a failed one (default 3)"),
    )  # fmt: skip


def benchmark_openai(*, dataset: str, base_url: str, model: str | None, api_key: str | None,
                     baseline_url: str | None, baseline_model: str | None, num_prompts: int | None,
                     concurrency: int, max_new_tokens: int, sampling: SamplingParams,
                     reasoning: str | None, timeout_s: float, max_retries: int,
                     data_dir: Path | None, output: Path | None, plot: Path | None,
                     warmup: bool = True, offline: bool = False) -> dict[str, Any]:  # fmt: skip
    """Run the benchmark, print the report, return the final JSON object.

    Raises:
        InputError: bad option values (before any request is sent).
        DatasetError: unknown or unreadable dataset.
        ServerError: a server cannot be reached, or every request failed.
    """
    for flag, value, lo, hint in _bounds(concurrency, num_prompts, max_new_tokens, max_retries):
        if value is not None and value < lo:
            raise InputError(f"{flag} must be >= {lo}, got {value}.", hint=hint)
    if not timeout_s > 0:
        raise InputError(f"--timeout-s must be > 0, got {timeout_s}.", hint="it is the seconds to wait for one request, e.g. --timeout-s 600")
    if output is not None:
        refuse_folder(output, "--output", "results.jsonl")
    if plot is not None:
        report.check_plot(plot)
    endpoints = [Endpoint("dflash", base_url, model)]
    api_root(base_url)
    if baseline_url:
        api_root(baseline_url, "--baseline-url")
        endpoints.insert(0, Endpoint("baseline", baseline_url, baseline_model))
    names = check_dataset_names(dataset.split(","))
    datasets: dict[str, list[PromptItem]] = {}
    warm: list[PromptItem] = []
    for name in names:
        datasets[name], extra = take_prompts(select(load_prompts(name, data_dir, offline), None),
                                             num_prompts, concurrency)  # fmt: skip
        warm = warm or extra
    cfg = RemoteConfig(max_new_tokens=max_new_tokens, sampling=sampling, reasoning=reasoning,
                       concurrency=concurrency, timeout_s=timeout_s,
                       retry=RetryPolicy(max_retries=max_retries), warmup=warmup)  # fmt: skip
    writer = JsonlWriter(output)
    runs = asyncio.run(_run_all(endpoints, datasets, warm, cfg, api_key, writer))
    summaries = {name: dataset_summary(runs["dflash"][name],
                                       runs["baseline"][name] if baseline_url else None)
                 for name in datasets}  # fmt: skip
    console = Console(highlight=False, soft_wrap=True)
    for name, summary in summaries.items():
        print_report(console, name, summary, endpoints, cfg, runs["dflash"][name]["records"]
                     + (runs["baseline"][name]["records"] if baseline_url else []))  # fmt: skip
    if plot is not None:
        if any(s["histogram"] or s["per_position_acceptance"] for s in summaries.values()):
            console.print(f"plot written to {report.save_plot(plot, summaries)}")
        else:
            console.print(f"no plot: acceptance {NOT_REPORTED}")
    final = {"config": {**cfg.record_config(endpoints[-1]), "side": None,
                        "baseline_url": baseline_url, "baseline_model": endpoints[0].model
                        if baseline_url else None, "num_prompts": num_prompts},
             "datasets": summaries}  # fmt: skip
    print(json.dumps(final, ensure_ascii=False))
    if all(s["dflash"]["ok"] == 0 for s in summaries.values()):
        first = next((r for recs in runs["dflash"].values() for r in recs["records"]), None)
        why = first.error if first is not None else "no requests"
        hint = chat_error_hint(first.status, first.error or "", one_prompt=False) if first is not None else None
        raise ServerError(f"Every request to {base_url} failed (first: {why}).", hint=hint)
    return final


async def _run_all(endpoints: list[Endpoint], datasets: dict[str, list[PromptItem]],
                   warm: list[PromptItem], cfg: RemoteConfig, api_key: str | None,
                   writer: JsonlWriter) -> dict[str, Any]:  # fmt: skip
    total = sum(len(i.turns) for items in datasets.values() for i in items)
    limits = httpx.Limits(
        max_connections=cfg.concurrency + 2, max_keepalive_connections=cfg.concurrency + 2
    )
    runs: dict[str, Any] = {}
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[errors]} errors"), TimeElapsedColumn(),
                        console=Console(stderr=True))  # fmt: skip
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:
        with progress:
            for ep in endpoints:
                task = progress.add_task(f"{ep.side} {ep.base_url}", total=total, errors=0)
                errors = 0

                def tick(record: RemoteRecord, task: Any = task) -> None:
                    nonlocal errors
                    errors += not record.ok
                    progress.update(task, advance=1, errors=errors)

                runs[ep.side] = await run_side(
                    client, ep, datasets, warm, cfg, api_key, writer, tick
                )
    return runs


def _fmt(value: float | None, spec: str = ".2f", scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if value is None else f"{value * scale:{spec}}{unit}"


def _dist(p: dict[str, float | None], scale: float, unit: str) -> str:
    return " / ".join(_fmt(p[k], ".1f", scale) for k in ("mean", "p50", "p90", "p99")) + unit


def summary_table(name: str, summary: dict[str, Any], endpoints: list[Endpoint]) -> Table:
    """Rows of speed and acceptance; one column per server."""
    sides = [(ep, summary[ep.side]) for ep in reversed(endpoints)]
    table = Table(title=f"dflash benchmark openai: {name}", title_justify="left")
    table.add_column("metric")
    for ep, _ in sides:
        table.add_column(f"{ep.side} ({ep.model})", justify="right")

    def row(label: str, fn: Any) -> None:
        table.add_row(label, *(fn(s) for _, s in sides))

    row("requests ok / errors", lambda s: f"{s['ok']} / {s['errors']}")
    row(
        "output tokens",
        lambda s: (
            str(s["output_tokens"]) + ("" if s["usage_reported"] in (True, None) else " (deltas)")
        ),
    )
    row("wall time", lambda s: _fmt(s["wall_s"], ".1f", unit=" s"))
    row("output tok/s (all requests)", lambda s: _fmt(s["output_tok_s"]))
    row("requests/s", lambda s: _fmt(s["requests_per_s"], ".3f"))
    row("decode tok/s (1 / mean TPOT)", lambda s: _fmt(s["decode_tok_s"]))
    row("TTFT mean/p50/p90/p99", lambda s: _dist(s["ttft_s"], 1000, " ms"))
    row("TPOT mean/p50/p90/p99", lambda s: _dist(s["tpot_s"], 1000, " ms"))
    row("E2E mean/p50/p90/p99", lambda s: _dist(s["e2e_s"], 1, " s"))
    row(
        "τ (meta_info, mean of responses)",
        lambda s: (
            _fmt(s["tau_mean_of_responses"], ".3f")
            if s["tau_mean_of_responses"] is not None
            else NOT_REPORTED
        ),
    )
    row("τ (meta_info, step-weighted)", lambda s: _fmt(s["tau_step_weighted"], ".3f"))
    row(
        "τ (/metrics: 1 + accepted/drafts)",
        lambda s: (
            _fmt(s["metrics_counters"]["tau"], ".3f") if s["metrics_counters"] else NOT_REPORTED
        ),
    )
    row(
        "draft acceptance rate (/metrics)",
        lambda s: (
            _fmt(s["metrics_counters"]["acceptance_rate"], ".1%")
            if s["metrics_counters"]
            else NOT_REPORTED
        ),
    )
    return table


def print_report(console: Console, name: str, summary: dict[str, Any], endpoints: list[Endpoint],
                 cfg: RemoteConfig, records: list[RemoteRecord]) -> None:  # fmt: skip
    """Table, speedup line, acceptance histogram, error list and the upstream-style block."""
    console.print(summary_table(name, summary, endpoints))
    speed = summary["speedup"]
    if speed is None:
        console.print("no speedup can be computed: no baseline server was measured (pass "
                      "--baseline-url URL of the same model served without speculation)")  # fmt: skip
    else:
        console.print(f"speedup vs baseline: decode (mean TPOT) {_fmt(speed['decode'])}x, "
                      f"output tok/s {_fmt(speed['output_tok_s'])}x, "
                      f"end-to-end latency {_fmt(speed['e2e'])}x")  # fmt: skip
    fast = summary["dflash"]
    if fast["histogram"]:
        for line in report.histogram_lines(summary):
            console.print(line)
    elif fast["per_position_acceptance"]:
        cells = " ".join(_fmt(r, ".0f", 100) for r in fast["per_position_acceptance"])
        console.print(f"per-position acceptance % (from /metrics): {cells}")
    if fast["acceptance_source"] is None:
        console.print(f"acceptance statistics: {NOT_REPORTED}")
    failed = [r for r in records if not r.ok]
    if failed:
        console.print(
            Text(f"{len(failed)} failed requests (left out of every figure):", style="bold red")
        )
        for r in failed[:20]:
            console.print(f"  {r.side} {r.dataset} {r.id} turn {r.turn}: {r.error_kind}: "
                          f"{r.error} ({r.attempts} attempts)")  # fmt: skip
        if len(failed) > 20:
            console.print(f"  ... and {len(failed) - 20} more (see --output)")
    line = "=" * 50
    prompts = fast["prompts"]
    lines = [line, "Backend: openai", f"Dataset: {name}", f"Num prompts: {prompts}"]
    if prompts != fast["requests"]:  # multi-turn prompts: one request per turn
        lines.append(f"Num requests: {fast['requests']}")
    lines += [f"Concurrency: {cfg.concurrency}", f"Latency: {fast['wall_s']:.1f}s",
             f"Output tokens: {fast['output_tokens']}",
             f"Throughput: {_fmt(fast['output_tok_s'], ',.2f')} tok/s"]  # fmt: skip
    if fast["tau_mean_of_responses"] is not None:
        lines.append(f"Accept length: {fast['tau_mean_of_responses']:.3f}")
    if fast["verify_steps"]:
        lines.append(f"Spec verify ct: {fast['verify_steps']}")
    for text in lines + [line]:
        console.print(text, highlight=False)
    console.print()
