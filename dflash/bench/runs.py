"""Running ``dflash benchmark`` once the options are checked: one configuration on every rank
(:func:`run`), a sweep over block sizes with one loaded pipeline (:func:`sweep`), and the
Ctrl-C note (:func:`interrupted`). The pipeline loader is passed in (the command's
``_load_pipeline``, which the tests replace with a fake). No torch import here.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from dflash.bench import harness, report
from dflash.bench.metrics import ResponseRecord, summarize
from dflash.data.datasets import PromptItem, load_prompts, select


def run(
    dist: harness.DistInfo,
    load: Callable[..., Any],
    load_args: tuple,
    selected: dict[str, list[PromptItem]],
    config: harness.BenchConfig,
    output: Path | None,
    resume: bool,
    pipeline: Any = None,
) -> dict[str, list[ResponseRecord]] | None:
    """Load, run this rank's shard with a progress bar, gather on rank 0 and merge its files.

    Args:
        load: the pipeline loader (``dflash.bench.command._load_pipeline``, the tests' seam).
        load_args: (backend, model, draft, device, dtype, cuda_graphs, compile, uniform_width,
            kernels, recalibrate, draft_bits, draft_window) for ``load``.

        pipeline: an already loaded pipeline (a sweep loads once), else loaded here.

    Returns:
        Records per dataset on rank 0, None on other ranks.
    """
    (
        backend,
        model,
        draft,
        device,
        dtype,
        cuda_graphs,
        compile,
        uniform_width,
        kernels,
        recalibrate,
        draft_bits,
        draft_window,
    ) = load_args
    device = harness.rank_device(dist, device)
    log = harness.ResultsLog(output, resume=resume, rank=dist.rank, world=dist.world)
    log.check_settings(config)  # before loading: a mismatch must not cost a model load
    results, failure = None, None
    gguf = model is None or str(model).endswith(".gguf")  # the demo target is a .gguf too
    if pipeline is None and dist.world > 1 and backend == "transformers" and gguf:
        from dflash.models.target_torch import resolve_target

        harness.once_per_machine(dist, lambda: resolve_target(model))  # converted once, cached
    try:
        if pipeline is None:
            pipeline = load(backend, model, draft, device, dtype, cuda_graphs, compile, uniform_width,
                            kernels, recalibrate, draft_bits=draft_bits, draft_window=draft_window)  # fmt: skip
        shards = {name: harness.shard(items, dist) for name, items in selected.items()}
        with report.BenchProgress(enabled=dist.rank == 0) as progress:
            results = harness.run_benchmark(pipeline, shards, config, log=log,
                                            on_record=progress.update, on_dataset=progress.start)  # fmt: skip
    except Exception as e:  # under torchrun: report to rank 0 instead of leaving it waiting
        if dist.world == 1:
            raise
        failure = e
    error = None if failure is None else getattr(failure, "message", None) or \
        f"{type(failure).__name__}: {str(failure).splitlines()[0] if str(failure) else ''}"  # fmt: skip
    try:
        gathered = harness.gather_records(results, dist, error)
    except harness.RankFailure as err:
        if dist.rank == 0:  # report before any rank exits: torchrun then stops the others
            from dflash.errors import report_error

            report_error(err)
        harness.barrier(dist)
        raise failure if failure is not None and dist.rank else typer.Exit(1) from None
    if gathered is not None:
        gathered = harness.in_prompt_order(gathered, selected)
        log.write_merged([r for recs in gathered.values() for r in recs])
    return gathered


def interrupted(output: Path | list[Path] | None, rank: int) -> None:
    """On Ctrl-C: where the finished responses are (one file, or a sweep's files) and how to
    continue (rank 0, stderr)."""
    files = [output] if isinstance(output, Path) else list(output or [])
    if rank == 0 and files:
        where = (
            str(files[0])
            if len(files) == 1
            else ", ".join(map(str, files[:-1])) + f" and {files[-1]}"
        )
        print(f"interrupted: the finished responses are in {where}; run the same command with --resume "
              "to continue.", file=sys.stderr)  # fmt: skip


def sweep(
    load: Callable[..., Any],
    block_sizes: list[int | str | None],
    load_args: tuple,
    names: list[str],
    data: tuple[Path | None, bool],
    max_samples: int | None,
    base_config: harness.BenchConfig,
    output: Path | None,
    resume: bool = False,
    plot: Path | None = None,
) -> None:
    """Benchmark every block size in turn on the same prompts with one pipeline, loaded by
    ``load`` from ``load_args`` (as :func:`run`).

    Each value gets its own baseline runs (paired per response, so drift of the machine's
    speed cancels in the speedup) and, with ``--output a.jsonl``, its own ``a.bs<L>.jsonl``
    (``--resume`` continues each; every file is checked before anything loads) and with
    ``--plot p.png`` its own ``p.bs<L>.png``. Prints one table per dataset with a row per
    value, then one JSON line.

    Raises:
        InputError: a value's results file exists without ``--resume``, or holds records made
            with other settings.
    """
    from dataclasses import replace

    def per_value(path: Path | None, bs: int | str | None) -> Path | None:
        return None if path is None else path.with_name(f"{path.stem}.bs{bs}{path.suffix}")

    selected = {
        name: select(load_prompts(name, *data), max_samples) for name in names
    }  # data: dir, offline
    dist = harness.init_distributed(load_args[3])  # load_args[3]: --device
    rows: list[tuple[int | str | None, dict[str, dict[str, Any]]]] = []
    pipeline = None
    started: list[int | str | None] = []  # the values whose files may hold responses
    try:
        for bs in block_sizes:  # every value's file, before a model loads or a value runs
            log = harness.ResultsLog(
                per_value(output, bs), resume=resume, rank=dist.rank, world=dist.world
            )
            log.check_settings(replace(base_config, block_size=bs))
        *first, draft_bits, draft_window = load_args
        pipeline = load(*first, draft_bits=draft_bits, draft_window=draft_window)
        for bs in block_sizes:
            started.append(bs)
            config = replace(base_config, block_size=bs)
            gathered = run(
                dist,
                load,
                load_args,
                selected,
                config,
                per_value(output, bs),
                resume,
                pipeline=pipeline,
            )
            if gathered is not None:
                rows.append((bs, {n: summarize(r) for n, r in gathered.items()}))
    except KeyboardInterrupt:
        interrupted(
            [per_value(output, bs) for bs in started or block_sizes] if output else None, dist.rank
        )
        raise
    finally:
        harness.finish_distributed(dist)
    if dist.rank != 0:
        return
    console = Console(highlight=False, soft_wrap=True)
    for name in names:
        console.print(report.sweep_table(name, [(bs, sums[name]) for bs, sums in rows]))
    for bs, sums in rows if plot is not None else []:
        console.print(f"plot written to {report.save_plot(per_value(plot, bs), sums)}")
    print(json.dumps({"config": base_config.record_config(None),  # type: ignore[arg-type]
                      "sweep": [{"block_size": bs, "datasets": sums} for bs, sums in rows]},
                     ensure_ascii=False))  # fmt: skip
