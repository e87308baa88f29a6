"""The ``dflash train``, ``dflash data regenerate`` and ``dflash data vocab`` commands (cli.py).

dflash data regenerate --prompts gsm8k:train --prompts mbpp:train --out data/ --max-new-tokens 512
dflash train --data data/ --out my-draft/ --epochs 6
dflash data vocab --data data/ --draft my-draft/ --size 16384
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dflash.errors import InputError
from dflash.models.draft_vocab import DEFAULT_SIZE

TargetOpt = Annotated[str | None, typer.Option("--target", "-m",
                      help="Target: hub id, folder or .gguf (default: demo SmolLM2-135M-Instruct).")]  # fmt: skip

data_app = typer.Typer(no_args_is_help=True, help="Training data for DFlash drafts.")



@data_app.command("vocab")
def vocab(
    draft: Annotated[Path, typer.Option("--draft", help="Draft folder (local) to write draft_vocab.json into.")],
    data: Annotated[Path | None, typer.Option("--data", help="Folder of regenerated JSONL shards (the target's own answers, not --eval-only ones) to count tokens in.")] = None,
    size: Annotated[int, typer.Option(help="Tokens kept (Vd): the most frequent in --data (topped up with the lowest unseen ids when fewer were seen); 0 removes the draft vocabulary.")] = DEFAULT_SIZE,
    eval_data: Annotated[Path | None, typer.Option(help="Held-out shards: also report the coverage there.")] = None,
) -> None:  # fmt: skip
    """Give a draft a draft vocabulary: its LM head scores only the SIZE tokens the target uses most
    (lossless; a smaller head read per step; the draft_vocab setting off ignores it; README 'Draft
    vocabulary')."""
    import json

    from dflash.errors import DatasetError
    from dflash.models.config import DraftConfig
    from dflash.models.draft_vocab import (
        VOCAB_FILE,
        check_counts,
        check_not_shipped,
        check_size,
        check_vocab_path,
        choose,
        count_tokens,
        coverage,
        save_draft_vocab,
    )
    from dflash.train.shards import read_shards

    if not (draft / "config.json").is_file():
        raise InputError(f"--draft {draft} is not a draft folder (no config.json).",
                         hint="pass a local draft folder, e.g. one written by dflash train or init-draft")  # fmt: skip
    cfg = DraftConfig.load(draft)  # a one-line error for a malformed config
    check_not_shipped(draft)
    path = draft / VOCAB_FILE
    check_vocab_path(path)
    if size == 0:
        path.unlink(missing_ok=True)
        typer.echo(f"{draft}: no draft vocabulary (the full {cfg.vocab_size:,} tokens)")
        return
    check_size(size, cfg.vocab_size)
    if data is None:
        raise InputError("--data is required to choose a draft vocabulary.",
                         hint="pass the folder 'dflash data regenerate --out' wrote")  # fmt: skip
    meta = data / "meta.json"
    if meta.is_file() and json.loads(meta.read_text()).get("eval_only"):
        raise DatasetError(f"{data} was regenerated with --eval-only (benchmark test prompts); a "
                           "vocabulary chosen on it inflates benchmark τ.", hint="pass it as --eval-data instead")  # fmt: skip
    counts = count_tokens(read_shards(data))
    check_counts(counts, cfg.vocab_size, data)
    ids = choose(counts, size, cfg.vocab_size)
    cover = coverage(ids, counts)
    extra = {}
    line = f"covers {cover:.2%} of {sum(counts.values()):,} response tokens in {data}"
    if eval_data is not None:
        held = count_tokens(read_shards(eval_data))
        check_counts(held, cfg.vocab_size, eval_data)
        extra["eval_coverage"] = coverage(ids, held)
        line += f", {extra['eval_coverage']:.2%} of {sum(held.values()):,} in {eval_data}"
    if len(counts) < size:
        line += f" (only {len(counts):,} distinct tokens seen; the rest are the lowest unseen ids)"
    save_draft_vocab(draft, ids, source=str(data.resolve()), coverage=cover, **extra)
    typer.echo(f"{path}: {len(ids):,} of {cfg.vocab_size:,} tokens; {line}")


@data_app.command("regenerate")
def regenerate(
    prompts: Annotated[list[str], typer.Option("--prompts", "-p",
                       help="Prompt source, repeatable: gsm8k:train, mbpp:train, mmlu, a benchmark name, a .txt file (one prompt per non-empty line) or a .jsonl file with 'prompt', 'turns' or 'messages' (its first user turn is answered, after its system message if any); SPEC@N keeps the first N in Random(42) order.")],  # fmt: skip
    out: Annotated[Path, typer.Option("--out", help="Data folder (resumed if it exists).")],
    target: TargetOpt = None,
    max_new_tokens: Annotated[int, typer.Option(help="Response budget per prompt (tokens).")] = 1024,
    batch_size: Annotated[int, typer.Option(help="Rows decoded together (batched engine) or prompts per generate call (hf).")] = 256,
    temperature: Annotated[float, typer.Option(help="First response of each prompt: 0 = greedy; > 0 samples.")] = 0.0,
    samples: Annotated[int, typer.Option(help="Responses per prompt; the 2nd.. are sampled at --sample-temperature.")] = 1,
    sample_temperature: Annotated[float, typer.Option(help="Temperature of the extra responses.")] = 0.8,
    eval_only: Annotated[bool, typer.Option("--eval-only", help="Allow benchmark test prompts, for held-out evaluation only (train refuses the folder).")] = False,
    engine: Annotated[str, typer.Option(help="auto (batched static decoder for Llama/Qwen targets), batched or hf.")] = "auto",
    max_prompt_tokens: Annotated[int, typer.Option(help="Skip prompts longer than this (tokens).")] = 1024,
    data_dir: Annotated[Path | None, typer.Option(help="Local datasets folder, laid out like tests/datasets (default: the hub).")] = None,
    time_limit: Annotated[float | None, typer.Option(help="Stop cleanly after about this many seconds (resume later).")] = None,
    device: Annotated[str, typer.Option(help="auto, cuda, cuda:N or cpu.")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16, float32.")] = "auto",
    seed: Annotated[int, typer.Option(help="Sampling seed (temperature > 0).")] = 0,
) -> None:  # fmt: skip
    """Let the target answer prompts through its chat template; write JSONL shards to train on."""
    from dflash.train.data import regenerate as run

    specs = [s.strip() for p in prompts for s in p.split(",") if s.strip()]
    if not specs:
        raise InputError("--prompts is empty.", hint="e.g. --prompts gsm8k:train")
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; pass a folder for the JSONL shards.")
    if time_limit is not None and time_limit <= 0:
        raise InputError(f"--time-limit must be > 0 seconds, got {time_limit}.")
    from dflash.train.data import check_regenerate_options

    check_regenerate_options(max_new_tokens, batch_size, samples, temperature, sample_temperature, engine)
    console = Console(stderr=True)
    # the bar starts with the first written batch: argument, prompt and folder errors (found
    # before the target loads) print as one line, with no bar in front of them
    bar = Progress(TextColumn("regenerating"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=console)  # fmt: skip
    task = None

    def on_batch(done: int, total: int, new_tokens: int, seconds: float) -> None:
        nonlocal task
        if task is None:
            bar.start()
            task = bar.add_task("gen", total=None, rate="")
        bar.update(task, completed=done, total=total, rate=f"{new_tokens / max(seconds, 1e-9):,.0f} tok/s")

    try:
        res = run(target, specs, out, max_new_tokens=max_new_tokens, batch_size=batch_size,
                  temperature=temperature, samples=samples, sample_temperature=sample_temperature,
                  eval_only=eval_only, engine=engine, max_prompt_tokens=max_prompt_tokens,
                  data_dir=data_dir, device=device, dtype=dtype, time_limit=time_limit, seed=seed,
                  on_batch=on_batch)  # fmt: skip
    finally:
        bar.stop()
    if res["engine"] is None:
        console.print(f"{out}: {res['done']}/{res['total']} responses, already complete (nothing to do)")
        return
    state = "complete" if res["finished"] else "stopped early (run again to resume)"
    rate = res["tokens"] / max(res["seconds"], 1e-9)
    skipped = f", {res['skipped']} long prompts skipped" if res["skipped"] else ""
    console.print(f"{out}: {res['done']}/{res['total']} responses, {res['tokens']:,} new tokens this run "
                  f"({rate:,.0f} tok/s, {res['engine']} engine){skipped}, {state}")  # fmt: skip


def train(
    data: Annotated[Path, typer.Option("--data", help="Folder of regenerated JSONL shards.")],
    out: Annotated[Path, typer.Option("--out", help="Output draft folder (resumed if it holds a run).")],
    target: TargetOpt = None,
    init: Annotated[Path | None, typer.Option(help="Start from this draft folder (default: a fresh one).")] = None,
    layers: Annotated[int, typer.Option(help="Draft decoder layers (fresh drafts).")] = 5,
    block_size: Annotated[int, typer.Option(help="Block size L (anchor + L-1 masked slots).")] = 16,
    anchors: Annotated[int, typer.Option(help="Random blocks per sequence (cap), re-drawn each epoch.")] = 512,
    epochs: Annotated[int, typer.Option(help="Passes over the data.")] = 6,
    max_steps: Annotated[int | None, typer.Option(help="Cap on optimizer steps.")] = None,
    lr: Annotated[float, typer.Option(help="Peak AdamW learning rate (cosine, 4% warmup).")] = 6e-4,
    max_len: Annotated[int, typer.Option(help="Cut sequences to this many tokens.")] = 2048,
    batch_tokens: Annotated[int, typer.Option(help="Padded sequence tokens per batch (a batch holds at least one sequence, however long).")] = 16384,
    gamma: Annotated[float | None, typer.Option(help="Loss decay gamma (default: 7/5/4 for L=16/10/8, else L/2).")] = None,
    eval_data: Annotated[Path | None, typer.Option(help="Responses for the held-out τ (default: 2% of --data).")] = None,
    eval_every: Annotated[int, typer.Option(help="Held-out τ every N steps.")] = 200,
    save_every: Annotated[int, typer.Option(help="Checkpoint every N steps.")] = 500,
    log_every: Annotated[int, typer.Option(help="Log record (loss, samples/s) every N steps.")] = 10,
    time_limit: Annotated[float | None, typer.Option(help="Seconds of training; the schedule anneals to fit.")] = None,
    pause_after: Annotated[float | None, typer.Option(help="Stop this invocation after N seconds; run again to resume.")] = None,
    seed: Annotated[int, typer.Option(help="Seed for initialisation, order and anchors.")] = 0,
    attention: Annotated[str, typer.Option(help="auto (flex on CUDA, dense on CPU), flex or dense.")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cuda, cuda:N or cpu.")] = "auto",
    save_dtype: Annotated[str, typer.Option(help="Exported weights: bfloat16 or float32.")] = "bfloat16",
    state_dir: Annotated[Path | None, typer.Option(help="Resume state folder (default: OUT/state).")] = None,
    mask_token_id: Annotated[int | None, typer.Option(help="Mask id of a fresh draft (default: as init-draft).")] = None,
    resume_from: Annotated[Path | None, typer.Option(help="Continue from a draft folder written by train (weights only): fresh optimizer and schedule, step count kept; --max-steps counts all steps.")] = None,
    arch: Annotated[str | None, typer.Option(help="dflash or dflash2 (default: the --init/--resume-from draft's, else dflash); dflash2 with a v1 --init starts from that draft.")] = None,
) -> None:  # fmt: skip
    """Train a DFlash or DFlash2 draft on target-regenerated data (paper recipe); resumable.

    Under 'torchrun --nproc-per-node N -m dflash train ...' the run is data-parallel over N
    processes (one GPU each): --batch-tokens is per process, rank 0 prints, evaluates and writes.
    """
    from dflash.bench.distributed import finish_distributed, init_distributed
    from dflash.train.train import TrainConfig

    if gamma is not None and gamma <= 0:
        raise InputError(f"--gamma must be > 0, got {gamma}.")
    if time_limit is not None and time_limit <= 0:
        raise InputError(f"--time-limit must be > 0 seconds, got {time_limit}.")

    cfg = TrainConfig(target=target, data=str(data), out=str(out), init=str(init) if init else None,
                      layers=layers, block_size=block_size, anchors=anchors, epochs=epochs,
                      max_steps=max_steps, lr=lr, max_len=max_len, batch_tokens=batch_tokens,
                      gamma=gamma, seed=seed, time_limit=time_limit,
                      eval_data=str(eval_data) if eval_data else None, eval_every=eval_every,
                      save_every=save_every, log_every=log_every, attention=attention, device=device,
                      save_dtype=save_dtype, state_dir=str(state_dir) if state_dir else None,
                      mask_token_id=mask_token_id, arch=arch,
                      resume_from=str(resume_from) if resume_from else None)  # fmt: skip
    cfg.check()
    info = init_distributed(device)
    failed = True
    try:
        _train(cfg, info, pause_after)
        failed = False
    finally:
        finish_distributed(info, failed=failed)


def _train(cfg, info, pause_after: float | None) -> None:
    """Load the target on this rank's device, train, and print (rank 0) progress and a summary."""
    import torch

    from dflash.train.train import Trainer, load_training_target

    if info.world > 1:
        from dflash.bench.distributed import once_per_machine, rank_device
        from dflash.models.target_torch import resolve_target

        cfg.device = rank_device(info, cfg.device)
        once_per_machine(info, lambda: resolve_target(cfg.target, "--target"))  # a .gguf converts once
    torch.manual_seed(cfg.seed)
    model, _tok = load_training_target(cfg.target, cfg.device)
    out, rank0 = cfg.out, info.rank == 0
    console = Console(stderr=True, soft_wrap=True)  # no 80-column cut when piped
    live = console.is_terminal and rank0  # a live bar on a terminal, else a line per interval
    bar = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), console=console,
                   disable=not live)  # fmt: skip
    task = bar.add_task("train", total=None, stats="")
    heldout = {"tau": math.nan}

    def tau_text(x: float, digits: int) -> str:  # nan when no held-out response exists yet
        return "n/a" if math.isnan(x) else f"{x:.{digits}f}"

    def on_log(rec: dict) -> None:
        if not rank0:
            return
        if "warning" in rec:
            console.print(f"[yellow]warning:[/] {rec['warning']}")
            return
        if rec.get("heldout"):
            heldout.update(rec["heldout"])
            per = rec["heldout"].get("per_dataset") or {}
            parts = ", ".join(f"{n} {tau_text(t, 2)}" for n, t in per.items())
            console.print(f"step {rec['step']}: held-out τ {tau_text(heldout['tau'], 3)}"
                          + (f" ({parts})" if parts else "")
                          + (f", loss {rec['loss']:.3f}" if "loss" in rec else ""))  # fmt: skip
        if "loss" in rec:
            stats = (f"loss {rec['loss']:.3f} acc {rec['accuracy']:.2f} train τ {rec['accept']:.2f} "
                     f"held-out τ {tau_text(heldout['tau'], 2)} lr {rec['lr']:.1e} "
                     f"{rec['samples_per_s']:.1f} samples/s")  # fmt: skip
            bar.update(task, completed=rec["step"], stats=stats)
            if not live:
                total = bar.tasks[0].total
                console.print(f"step {rec['step']}/{total:.0f}: {stats}" if total else
                              f"step {rec['step']}: {stats}", highlight=False)  # fmt: skip

    trainer = Trainer(cfg, model, on_log=on_log, dist=info)
    heldout.update(trainer.last_heldout() or {})  # a resumed run shows its last τ until the next eval
    base = trainer.base_step  # steps of earlier segments (--resume-from)
    bar.update(task, total=base + trainer.total_steps, completed=base + trainer.cursor["step"])
    with bar:
        last = trainer.run(pause_after=pause_after)
    if not rank0:
        return
    state = ("finished" if trainer.finished() else
             "interrupted, saved (run the same command to resume)" if trainer.interrupted else
             "paused (run again to resume)")  # fmt: skip
    speed = trainer.speed
    rate = (f", {speed['samples'] / speed['seconds']:.2f} samples/s "
            f"({speed['tokens'] / speed['seconds']:,.0f} tok/s, {info.world} process(es))"
            if speed["seconds"] > 0 else "")  # fmt: skip
    done_steps = base + trainer.cursor["step"]  # past the total when a resume lowered --max-steps
    console.print(f"wrote {out}: step {done_steps}/{max(done_steps, base + trainer.total_steps)} {state}, "
                  f"held-out τ {tau_text(heldout['tau'], 3)}, loss {tau_text(last.get('loss', math.nan), 3)}"
                  + rate)  # fmt: skip
    if trainer.interrupted:
        raise typer.Exit(130)  # as an interrupted program; the state is saved
