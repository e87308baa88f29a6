"""The ``dflash serve`` command: checks its options (before binding the port, so a bad one
fails at once), builds the :class:`~dflash.serve.engine.Engine` and the app
(:func:`dflash.serve.server.build_app`) and runs them under uvicorn.

    dflash serve                                   # demo pair on http://127.0.0.1:30000/v1
    dflash serve --model M --draft D --port 30000 --api-key KEY

FastAPI, uvicorn and prometheus_client are imported only when the server starts
(``pip install -e ".[serve]"``).
"""

# No ``from __future__ import annotations``: Typer reads the options' annotations at runtime.
import os
import socket
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from dflash.errors import BackendError, InputError
from dflash.options import WARMUP_DEFAULT

DEMO_NAME = "SmolLM2-135M-Instruct"


def _check_port_free(host: str, port: int) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise InputError(f"--host {host} cannot be resolved.") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as err:
            raise InputError(f"Cannot listen on {host}:{port} ({err.strerror}).",
                             hint="pick another --port or stop what uses it") from None  # fmt: skip


def _check_pair(model: str | None, draft: str | None, width: int | None, backend: str = "transformers",
                device: str = "auto", dtype: str = "auto", kernels: str = "auto") -> None:  # fmt: skip
    """The checks of ``dflash.load`` that read no weights, before the server binds its port: the
    ``--device`` and ``--dtype`` names (for ``backend``), ``--kernels`` and the kernel settings'
    environment overrides (:class:`~dflash.kernels.settings.KernelSettings`), the target path
    exists, the draft resolves to a folder (a hub id is downloaded now rather than after
    binding) and ``--block-size`` fits the draft's trained block size.

    Raises:
        CheckpointError: a missing model path or draft; InputError: a bad device, dtype or
            setting, or a block size too large.
    """
    from dflash.api import check_device_name, check_dtype_name
    from dflash.kernels.settings import KernelSettings
    from dflash.models.config import DraftConfig
    from dflash.models.target_torch import check_model_path, resolve_draft  # torch-free helpers

    check_device_name(device, backend)
    check_dtype_name(dtype)
    KernelSettings.resolve(kernels)  # torch-free

    if model is not None:
        check_model_path(model)
    folder = resolve_draft(draft, model)
    trained = DraftConfig.load(folder).block_size
    if width is not None and width > trained:
        raise InputError(f"--block-size {width} exceeds the draft's trained block size {trained}.",
                         hint=f"use --block-size {trained} or less, or auto")  # fmt: skip


def serve(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Target: hub id, folder or .gguf (default: demo SmolLM2-135M-Instruct).")] = None,
    draft: Annotated[str | None, typer.Option("--draft", "-d", help="DFlash draft: hub id or folder (default: the shipped demo draft).")] = None,
    backend: Annotated[str, typer.Option(help="Local backend: transformers or mlx.")] = "transformers",
    host: Annotated[str, typer.Option(help="Interface to bind; 0.0.0.0 exposes the server to the network.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (30000, as SGLang; the openai backend's default --base-url).")] = 30000,
    api_key: Annotated[str | None, typer.Option(help="Require 'Authorization: Bearer KEY' on /v1 (default: $DFLASH_API_KEY; none = open).", show_default=False)] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Model name in the API (default: the --model name).")] = None,
    block_size: Annotated[str | None, typer.Option(help="auto (default: chosen per step from measured costs and acceptance) or the verify width incl. the anchor; 1 = no drafting.")] = None,
    device: Annotated[str, typer.Option(help="auto, cuda, cuda:N or cpu (mlx: auto, gpu or cpu).")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16, float32.")] = "auto",
    cuda_graphs: Annotated[bool | None, typer.Option("--cuda-graphs/--no-cuda-graphs", help="Static caches + CUDA graphs (default: on for CUDA with Llama/Qwen-style targets).")] = None,
    kernels: Annotated[str, typer.Option(help="transformers: auto runs this project's Triton kernels in the CUDA graphs where they fit; off runs torch ops there (if a kernel fails on your GPU).")] = "auto",
    recalibrate: Annotated[bool, typer.Option("--recalibrate", help="Measure the --block-size auto step costs again at startup instead of reading them from the dflash cache.")] = False,
    warmup: Annotated[int, typer.Option(help="transformers, CUDA graphs: untimed warm-up tokens per block size at startup (0 = none).")] = WARMUP_DEFAULT,
    log_level: Annotated[str, typer.Option(help="uvicorn log level: warning, info (access log), debug.")] = "info",
    prefix_cache_mb: Annotated[int, typer.Option(help="Prefix cache size in MiB (target K/V rows and features of earlier requests, reused by one that starts alike; plain transformers path); 0 = off.")] = 2048,
    tool_call_parser: Annotated[str | None, typer.Option(help="Tool-call format: hermes, qwen3_coder, llama3_json, openai (gpt-oss), gemma4 (default: from the chat template).")] = None,
    max_batch: Annotated[int | None, typer.Option(help="Generations decoded together by batched speculative decoding (dense Llama/Qwen targets, DFlash v1 drafts); default 1 (one at a time); try 16 on CUDA.", show_default=False)] = None,
) -> None:  # fmt: skip
    """Serve a target/draft pair over an OpenAI-compatible HTTP API (batched on CUDA)."""
    from dflash.backend_names import LOCAL_BACKENDS, one_of

    if backend not in LOCAL_BACKENDS:
        raise BackendError(f"dflash serve runs a local backend ({one_of(LOCAL_BACKENDS)}); got {backend!r}.",
                           hint="use " + " or ".join(f"--backend {b}" for b in LOCAL_BACKENDS))  # fmt: skip
    if not 0 < port < 65536:
        raise InputError(f"--port must be in 1..65535, got {port}.")
    if max_batch is not None and not 1 <= max_batch <= 512:
        raise InputError(
            f"--max-batch must be in 1..512, got {max_batch}.",
            hint="1 serves one generation at a time",
        )
    if max_batch not in (None, 1) and backend != "transformers":
        raise InputError(
            "--max-batch runs on the transformers backend only.", hint="drop --max-batch"
        )
    from dflash.options import (
        check_recalibrate,
        check_warmup,
        parse_block_size,
        refuse_foreign_options,
    )

    refuse_foreign_options(backend, {"--kernels": kernels != "auto", "--warmup": warmup != WARMUP_DEFAULT},
                           {"--kernels": ("transformers",), "--warmup": ("transformers",)})  # fmt: skip
    chosen = parse_block_size(block_size)  # "auto" (also for None) or an int, as for generate
    width = None if chosen == "auto" else int(chosen)  # the Engine takes None for auto
    check_warmup(warmup)
    check_recalibrate(recalibrate, [chosen])
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as err:
        raise BackendError(f"dflash serve needs fastapi, uvicorn and prometheus_client ({err.name} "
                           "is missing).", hint='pip install -e ".[serve]" (from this repository)') from None  # fmt: skip
    from uvicorn.config import LOG_LEVELS

    if log_level.lower() not in LOG_LEVELS:
        raise InputError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}.",
                         hint="info (the default) logs each request; warning only problems")  # fmt: skip
    from dflash.serve.tools import ALIASES, PARSER_NAMES

    if tool_call_parser is not None and tool_call_parser not in ALIASES:
        raise InputError(f"Unknown --tool-call-parser {tool_call_parser!r}.",
                         hint="use one of " + ", ".join(PARSER_NAMES))  # fmt: skip
    _check_pair(
        model, draft, width, backend, device, dtype, kernels
    )  # before binding: fails at once
    _check_port_free(host, port)
    api_key = api_key or os.environ.get("DFLASH_API_KEY") or None
    names = [served_model_name or (DEMO_NAME if model is None else Path(model).name or model)]
    if model and model not in names:
        names.append(model)

    def load() -> Any:
        import dflash

        pipe = dflash.load(model, draft, backend=backend, device=device, dtype=dtype,
                           cuda_graphs=cuda_graphs, kernels=kernels)  # fmt: skip
        pipe.recalibrate = recalibrate  # read by the calibration at startup
        return pipe

    from dflash.serve.batch_engine import BatchEngine
    from dflash.serve.server import build_app

    engine = BatchEngine(load, names, width, warmup, max_batch=max_batch)
    engine.tool_parser_name = tool_call_parser
    if prefix_cache_mb < 0:
        raise InputError(
            f"--prefix-cache-mb must be >= 0, got {prefix_cache_mb}.", hint="0 turns it off"
        )
    engine.prefix_cache_bytes = prefix_cache_mb * 2**20
    app = build_app(engine, api_key)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                           timeout_graceful_shutdown=5))  # fmt: skip
    engine.on_failure = lambda: setattr(server, "should_exit", True)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"dflash serve: warning: listening on {host} without --api-key", file=sys.stderr)
    print(f"dflash serve: loading {names[0]}; OpenAI API at http://{host}:{port}/v1 "
          f"({'one generation at a time' if (max_batch or 1) == 1 else f'up to {max_batch} generations at once'}"
          f"{', API key required' if api_key else ''})",
          file=sys.stderr, flush=True)  # fmt: skip
    server.run()
    if engine.error is not None:
        raise engine.error
