"""``dflash benchmark``: baseline vs DFlash speed, τ and parity over prompt datasets.

    dflash benchmark transformers --dataset gsm8k --max-samples 8
    dflash benchmark transformers --dataset gsm8k --block-size auto,1,4,8,16   # a sweep
    dflash benchmark transformers --dataset gsm8k,mt-bench --data-dir ../shared/datasets \\
        --max-new-tokens 256 --check-parity --output results.jsonl --plot hist.png
    torchrun --nproc_per_node=8 -m dflash benchmark transformers --dataset math500

No torch import here: cheap checks (options, datasets, output file) run before any weights load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from dflash.backend_names import BACKENDS, CLIENT_BACKENDS, LOCAL_BACKENDS, check_backend
from dflash.bench import harness, report, runs
from dflash.bench.metrics import summarize
from dflash.data.datasets import load_prompts, select
from dflash.errors import BackendError, InputError
from dflash.paths import make_parent, refuse_folder
from dflash.types import SamplingParams

# --help groups the options that only one backend reads under a panel of their own.
OPENAI_PANEL = "openai backend only"
BASE_URL_DEFAULT, TIMEOUT_DEFAULT, RETRIES_DEFAULT = "http://127.0.0.1:30000", 3600.0, 3


def _load_pipeline(backend: str, model: str | None, draft: str | None, device: str, dtype: str,
                   cuda_graphs: bool | None = None, compile: bool | None = None,
                   uniform_width: bool = False, kernels: str = "auto", recalibrate: bool = False,
                   **mlx_options: int | None):  # fmt: skip
    """Load target + draft through the public API (a seam the tests replace with a fake);
    ``recalibrate``: the pipeline measures the ``--block-size auto`` costs again."""
    try:
        from dflash import api
    except ImportError as err:
        raise BackendError(f"dflash.api cannot be imported ({err}).") from None
    kwargs = {"cuda_graphs": cuda_graphs} | ({"compile": compile} if compile is not None else {})
    kwargs |= {"uniform_width": True} if uniform_width else {}
    kwargs |= {"kernels": kernels} if kernels != "auto" else {}
    kwargs |= {k: v for k, v in mlx_options.items() if v is not None}
    pipe = api.load(model, draft, backend=backend, device=device, dtype=dtype, **kwargs)
    pipe.recalibrate = recalibrate
    return pipe


def _check_options(
    backend: str,
    max_new_tokens: int,
    block_sizes: list[int | str | None],
    sampling: SamplingParams,
    check_parity: bool,
    output: Path | None,
    resume: bool,
    plot: Path | None,
) -> None:
    """Reject bad flag values and combinations before anything is loaded."""
    check_backend(backend, "benchmark")
    if backend not in LOCAL_BACKENDS:
        raise BackendError(f"dflash benchmark cannot drive the '{backend}' backend yet.")
    if max_new_tokens < 1:
        raise InputError(
            f"--max-new-tokens must be >= 1, got {max_new_tokens}.",
            hint="e.g. --max-new-tokens 256",
        )
    if check_parity and not sampling.greedy:
        raise InputError(
            "--check-parity compares token ids, which only match under greedy decoding.",
            hint="drop --check-parity or use --temperature 0",
        )
    if resume and output is None:
        raise InputError("--resume needs --output FILE to resume from.")
    if output is not None:  # the path given, not a sweep's per-value name (made from it)
        refuse_folder(output, "--output", "results.jsonl")
        make_parent(output, "--output")
    if plot is not None:
        report.check_plot(plot)


def benchmark(
    backend: Annotated[str, typer.Argument(help=f"Backend: {' | '.join(BACKENDS)}.")],
    dataset: Annotated[
        str,
        typer.Option(
            "--dataset",
            help="gsm8k, math500, humaneval, mbpp, mt-bench, long (synthetic long prompts, 1k to 64k "
            "tokens; long:8k, long:1k-8k), a name:split such as gsm8k:train, "
            "a .txt file (one prompt per non-empty line) or a .jsonl file (one JSON object per "
            "line: prompt, turns or messages); comma-separate several for one table each.",
        ),
    ],
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", help="Target id, folder or .gguf (default: demo target)."),
    ] = None,
    draft: Annotated[
        str | None,
        typer.Option("--draft", "-d", help="Draft id or folder (default: the demo draft)."),
    ] = None,
    max_samples: Annotated[
        int | None, typer.Option(help="Prompts per dataset after the Random(42) shuffle.")
    ] = None,
    block_size: Annotated[
        str | None,
        typer.Option(
            help="DFlash block size L (default: the draft's), auto, or a comma list to sweep "
            "(e.g. auto,1,4,8,16: one run and one table row per value)."
        ),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Token budget per response.")] = 2048,
    temperature: Annotated[float, typer.Option(help="0 for greedy decoding.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus mass; 1.0 disables.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 disables top-k.")] = 0,
    reasoning: Annotated[
        str | None, typer.Option(help="off/on or a model-supported reasoning level.")
    ] = None,
    device: Annotated[
        str, typer.Option(help="auto, cpu, cuda, cuda:N (mlx: auto, gpu or cpu).")
    ] = "auto",
    dtype: Annotated[str, typer.Option(help="auto, bfloat16, float16, float32.")] = "auto",
    data_dir: Annotated[
        Path | None,
        typer.Option(
            envvar="DFLASH_DATA_DIR", help="Read datasets from this folder instead of the hub."
        ),
    ] = None,
    offline: Annotated[
        bool,
        typer.Option(
            "--offline",
            help="Never ask the hub for a dataset: a benchmark set not "
            "in the cache comes from the test prompts shipped with dflash.",
        ),
    ] = False,
    output: Annotated[
        Path | None, typer.Option(help="Append one JSON record per response to this file.")
    ] = None,
    resume: Annotated[
        bool, typer.Option(help="Continue --output, skipping finished responses.")
    ] = False,
    check_parity: Annotated[
        bool, typer.Option(help="Compare baseline and DFlash token ids per response.")
    ] = False,
    score: Annotated[
        bool,
        typer.Option(
            "--score",
            help="Score the answers of baseline and DFlash: gsm8k/math500 exact "
            "answer, humaneval/mbpp pass@1 (RUNS the generated code, in a separate process).",
        ),
    ] = False,
    plot: Annotated[
        Path | None, typer.Option(help="Save histogram + per-position plot (needs matplotlib).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    cuda_graphs: Annotated[
        bool | None,
        typer.Option(
            "--cuda-graphs/--no-cuda-graphs",
            help="Static caches + CUDA graphs (default: on for CUDA with Llama/Qwen-style targets).",
        ),
    ] = None,
    compile: Annotated[
        bool | None,
        typer.Option(
            "--compile/--no-compile",
            help="torch.compile the CUDA-graph forwards (default: on with CUDA graphs; about "
            "30 s per graph the first time, kernels cached under the dflash cache).",
        ),
    ] = None,
    uniform_width: Annotated[
        bool,
        typer.Option(
            "--uniform-width",
            help="CUDA graphs: verify at the draft's block size everywhere, baseline included "
            "(same kernels: bitwise bf16 parity; the baseline pays a width-L forward per token).",
        ),
    ] = False,
    draft_bits: Annotated[
        int | None, typer.Option(help="mlx backend: quantize the draft to 4 or 8 bits at load.")
    ] = None,
    draft_window: Annotated[
        int | None,
        typer.Option(help="the draft attends to at most N recent context rows (tokens)."),
    ] = None,
    kernels: Annotated[
        str,
        typer.Option(
            help="transformers: auto runs this project's Triton kernels in the CUDA graphs where "
            "they fit; off runs torch ops there (if a kernel fails on your GPU)."
        ),
    ] = "auto",
    recalibrate: Annotated[
        bool,
        typer.Option(
            "--recalibrate",
            help="Measure the --block-size auto step costs again instead of reading them from "
            "the dflash cache (and cache the new ones).",
        ),
    ] = False,
    base_url: Annotated[
        str, typer.Option(rich_help_panel=OPENAI_PANEL, help="server URL, with or without /v1.")
    ] = BASE_URL_DEFAULT,
    num_prompts: Annotated[
        int | None,
        typer.Option(
            rich_help_panel=OPENAI_PANEL,
            help="alias of --max-samples: prompts per dataset (default: all; "
            "repeats when larger than the dataset); giving both with different values is an error.",
        ),
    ] = None,
    concurrency: Annotated[
        int, typer.Option(rich_help_panel=OPENAI_PANEL, help="parallel requests.")
    ] = 1,
    timeout_s: Annotated[
        float, typer.Option(rich_help_panel=OPENAI_PANEL, help="HTTP timeout per connect/read, s.")
    ] = TIMEOUT_DEFAULT,
    api_key: Annotated[
        str | None,
        typer.Option(
            rich_help_panel=OPENAI_PANEL,
            help="API key (default: $OPENAI_API_KEY); never printed.",
            show_default=False,
        ),
    ] = None,
    baseline_url: Annotated[
        str | None,
        typer.Option(
            rich_help_panel=OPENAI_PANEL, help="a second server without speculation, for a speedup."
        ),
    ] = None,
    baseline_model: Annotated[
        str | None, typer.Option(rich_help_panel=OPENAI_PANEL, help="model name on --baseline-url.")
    ] = None,
    max_retries: Annotated[
        int,
        typer.Option(
            rich_help_panel=OPENAI_PANEL, help="retries on 429/502/503/504 (with backoff)."
        ),
    ] = RETRIES_DEFAULT,
) -> None:
    """Benchmark DFlash against plain decoding (block size 1; on mlx also mlx_lm's own
    stream_generate) on prompt datasets."""
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    from dflash.options import refuse_foreign_options

    check_backend(backend, "benchmark")  # before the option checks: they name the backend
    local, remote = LOCAL_BACKENDS, CLIENT_BACKENDS
    refuse_foreign_options(backend, {
        "--draft": draft is not None, "--device": device != "auto",
        "--block-size": block_size is not None and block_size.strip().lower() != "auto",  # auto: as generate
        "--dtype": dtype != "auto", "--cuda-graphs/--no-cuda-graphs": cuda_graphs is not None,
        "--compile/--no-compile": compile is not None, "--uniform-width": uniform_width,
        "--draft-bits": draft_bits is not None, "--draft-window": draft_window is not None,
        "--kernels": kernels != "auto", "--recalibrate": recalibrate,
        "--check-parity": check_parity, "--resume": resume, "--score": score,
        "--base-url": base_url != BASE_URL_DEFAULT, "--num-prompts": num_prompts is not None,
        "--concurrency": concurrency != 1, "--timeout-s": timeout_s != TIMEOUT_DEFAULT,
        "--api-key": api_key is not None, "--baseline-url": baseline_url is not None,
        "--baseline-model": baseline_model is not None, "--max-retries": max_retries != RETRIES_DEFAULT,
    }, {
        **dict.fromkeys(("--draft", "--block-size", "--device", "--dtype", "--check-parity", "--resume",
                         "--score", "--recalibrate", "--draft-window"), local),
        **dict.fromkeys(("--cuda-graphs/--no-cuda-graphs", "--compile/--no-compile", "--uniform-width",
                         "--kernels"), ("transformers",)),
        "--draft-bits": ("mlx",),
        **dict.fromkeys(("--base-url", "--num-prompts", "--concurrency", "--timeout-s", "--api-key",
                         "--baseline-url", "--baseline-model", "--max-retries"), remote),
    })  # fmt: skip
    if (
        max_samples is not None and max_samples < 1
    ):  # named as given (openai reads it as --num-prompts)
        raise InputError(
            f"--max-samples must be >= 1, got {max_samples}.", hint="drop it to use every prompt"
        )
    if num_prompts is not None and max_samples is not None and num_prompts != max_samples:
        raise InputError(f"--num-prompts {num_prompts} and --max-samples {max_samples} disagree; they are "
                         "the same option (prompts per dataset).", hint="give one of them")  # fmt: skip
    if backend == "openai":  # torch-free path: the server does the speculative decoding
        import os

        from dflash.bench.remote_command import benchmark_openai

        benchmark_openai(
            dataset=dataset, base_url=base_url, model=model,
            api_key=api_key or os.environ.get("OPENAI_API_KEY"), baseline_url=baseline_url,
            baseline_model=baseline_model, num_prompts=num_prompts if num_prompts is not None else max_samples,
            concurrency=concurrency, max_new_tokens=max_new_tokens, sampling=sampling,
            reasoning=reasoning, timeout_s=timeout_s, max_retries=max_retries,
            data_dir=data_dir, output=output, plot=plot, offline=offline,
        )  # fmt: skip
        return
    if backend == "mlx":  # no torch next to mlx (dflash.mlx_process)
        from dflash.mlx_process import keep_torch_out

        keep_torch_out()
    from dflash.models.target_torch import local_draft_block_size  # torch-free
    from dflash.options import check_recalibrate

    block_sizes = parse_block_sizes(block_size, local_draft_block_size(draft, model))

    check_recalibrate(recalibrate, block_sizes)
    if kernels not in ("auto", "off"):
        raise InputError(f"--kernels must be auto or off, got {kernels!r}.",
                         hint="auto runs this project's Triton kernels where they fit; off runs torch ops")  # fmt: skip
    if score and len(block_sizes) > 1:
        raise InputError(
            "--score scores one run; --block-size lists several.",
            hint="drop --score or list one block size",
        )
    if draft is None and model is not None:  # the published draft of a registered target
        from dflash.registry import registered_draft

        draft = registered_draft(model)
    names = harness.check_dataset_names(dataset.split(","))
    _check_options(
        backend, max_new_tokens, block_sizes, sampling, check_parity, output, resume, plot
    )
    run_info = {  # resolved values replace these once loaded
        "backend": backend,
        "model": model,
        "draft": draft,
        "cuda_graphs": cuda_graphs,
        "compile": compile,
        **({"draft_bits": draft_bits} if draft_bits else {}),
        **({"draft_window": draft_window} if draft_window else {}),
    }
    load_args = (backend, model, draft, device, dtype, cuda_graphs, compile, uniform_width,
                 kernels, recalibrate, draft_bits, draft_window)  # fmt: skip
    if len(block_sizes) > 1:
        runs.sweep(
            _load_pipeline,
            block_sizes,
            load_args,
            names,
            (data_dir, offline),
            max_samples,
            harness.BenchConfig(
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                reasoning=reasoning,
                check_parity=check_parity,
                run_info=dict(run_info),
            ),  # fmt: skip
            output,
            resume,
            plot,
        )
        return
    selected = {name: select(load_prompts(name, data_dir, offline), max_samples) for name in names}

    config = harness.BenchConfig(
        block_size=block_sizes[0],
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        reasoning=reasoning,
        check_parity=check_parity,
        run_info=dict(run_info),
    )
    dist = harness.init_distributed(device)
    try:
        gathered = runs.run(
            dist,
            _load_pipeline,
            load_args,
            selected,
            config,
            output,
            resume,
        )
    except KeyboardInterrupt:
        runs.interrupted(output, dist.rank)
        raise
    finally:
        harness.finish_distributed(dist)
    if gathered is None:  # non-zero ranks: rank 0 reports
        return
    summaries = {name: summarize(recs) for name, recs in gathered.items()}
    console = Console(highlight=False, soft_wrap=True)  # no 80-column wrapping when piped
    for name, summary in summaries.items():
        report.print_summary(
            console, name, summary, parity_asked=config.check_parity, requested=config.block_size
        )
    if score:
        from dflash.bench.score import add_scores

        add_scores(summaries, gathered, selected, console)
    if plot is not None:
        console.print(f"plot written to {report.save_plot(plot, summaries)}")
    block = max((s["block_size"] for s in summaries.values()), default=1)
    block = config.block_size if config.block_size == "auto" else block
    print(json.dumps(_final_json(config, block, summaries), ensure_ascii=False))


def _final_json(
    config: harness.BenchConfig, block_size: int | str, summaries: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The last stdout line: run settings plus every dataset's summary."""
    return {"config": config.record_config(block_size), "datasets": summaries}


def parse_block_sizes(value: str | None, trained: int | None = None) -> list[int | str | None]:
    """``--block-size``: None (the draft's), "auto", an integer >= 1, or a comma list of those;
    ``trained``: the draft's trained block size when known, for the hint of a value below 1.

    Raises:
        InputError: an empty item, a value that is neither auto nor an integer >= 1, or a
            repeated value.
    """
    if value is None:
        return [None]
    out: list[int | str | None] = []
    for item in value.split(","):
        text = item.strip().lower()
        if text != "auto" and not text.lstrip("-").isdigit():
            raise InputError(f"--block-size takes auto or integers >= 1 (comma-separated), "
                             f"got {item.strip()!r}.", hint="e.g. --block-size auto,1,4,8,16")  # fmt: skip
        v: int | str = text if text == "auto" else int(text)
        if isinstance(v, int) and v < 1:
            from dflash.options import block_size_range

            raise InputError(f"--block-size must be >= 1, got {v}.", hint=block_size_range(trained))
        if v in out:
            raise InputError(f"--block-size lists {v} twice.", hint="list each value once")
        out.append(v)
    return out
