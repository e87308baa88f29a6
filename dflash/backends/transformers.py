"""The transformers backend's load: a HF ``AutoModelForCausalLM`` target and a torch DFlash draft,
on the CUDA-graph path (:mod:`dflash.backends.static`) where the target and device allow it,
else on the plain path (:mod:`dflash.backends.plain`, HF forward with a ``DynamicCache``).

Torch-free at import: the checks that need no weights run before torch's import (seconds on a
small CPU).
"""

from __future__ import annotations

from typing import Any

from dflash.backends.base import Loaded, device_name
from dflash.errors import BackendError
from dflash.models.config import stop_token_ids
from dflash.paths import key_path


def plain_path_note(device_type: str, refusal: str | None, cuda_graphs: bool | None) -> str | None:
    """The one stderr line said when a CUDA load falls back to the plain path because the
    CUDA-graph path cannot run the target (``refusal``: why, from
    :func:`~dflash.backends.static.support.static_refusal`); None when nothing is to be said
    (not CUDA, the target runs there, or ``--cuda-graphs``/``--no-cuda-graphs`` given)."""
    if device_type != "cuda" or refusal is None or cuda_graphs is not None:
        return None
    return (f"dflash: the CUDA-graph path cannot run this target ({refusal}); using the plain path "
            "(--no-cuda-graphs silences this).")  # fmt: skip


def load(model: str | None, draft: str | None, *, device: str = "auto", dtype: str = "auto",
         cuda_graphs: bool | None = None, compile: bool | None = None,
         uniform_width: bool = False, kernels: str = "auto",
         draft_window: int | None = None) -> Loaded:  # fmt: skip
    """Load a target and a draft for the transformers backend (arguments as :func:`dflash.load`).

    The :class:`~dflash.kernels.settings.KernelSettings` are resolved here, once (``kernels``
    and the environment overrides), before any weight loads, and handed to the backend.
    ``draft_window`` (``--draft-window N``) bounds the draft's context rows; it runs on the plain
    path (the CUDA-graph path keeps a fixed draft context).

    Raises:
        BackendError, CheckpointError, ConfigError, InputError: one-sentence reasons.
    """
    import importlib.util

    from dflash.kernels.settings import KernelSettings
    from dflash.models.config import DraftConfig
    from dflash.models.target_torch import (
        check_model_path,
        is_hub_id,
        resolve_draft,
        resolve_target,
    )

    if any(importlib.util.find_spec(m) is None for m in ("torch", "transformers")):  # before a download
        raise BackendError("The transformers backend needs torch and transformers.",
                           hint='pip install "dflash[torch]"')  # fmt: skip
    settings = KernelSettings.resolve(kernels)  # a bad override fails on a laptop too, before any weight
    if model is not None:
        check_model_path(model)
        if draft is None:  # a registered target's published draft (a hub id: downloaded below)
            from dflash.registry import registered_draft

            draft = registered_draft(model)

    def draft_folder() -> tuple[Any, DraftConfig]:
        """The draft's folder and config; ``--draft-window`` with ``cuda_graphs`` refused."""
        folder = resolve_draft(draft, model)
        cfg = DraftConfig.load(folder)
        if cuda_graphs and draft_window is not None:  # likewise
            raise BackendError("CUDA graphs do not support --draft-window yet.",
                               hint="drop --cuda-graphs (the plain path runs it) or --draft-window")  # fmt: skip
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
    from dflash.backends.plain import (
        TransformersBackend,
        check_pair,
        load_draft,
        load_target,
        pick_device,
        pick_dtype,
    )
    from dflash.backends.static.backend import StaticBackend
    from dflash.backends.static.graph_plan import resolve_compile
    from dflash.backends.static.support import static_refusal

    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    if hub_draft:
        draft_dir, draft_cfg = draft_folder()
    target_path = resolve_target(model)
    target_model, tokenizer = load_target(target_path, dev, dt)
    stops = stop_token_ids(getattr(target_model, "generation_config", None), tokenizer)
    rows = target_model.get_input_embeddings().weight.shape[0]
    check_pair(draft_cfg, target_model.config, rows, stops)
    draft_model = load_draft(draft_dir, dev, dt)
    draft_model.context_window = draft_window

    refusal = static_refusal(target_model)
    fast = dev.type == "cuda" and refusal is None and cuda_graphs is not False
    fast = fast and draft_window is None  # it runs on the plain path
    if cuda_graphs and not fast:
        raise BackendError(no_graphs_reason(target_model, refusal) if dev.type == "cuda" else
                           "CUDA graphs need a CUDA device and a Llama/Qwen2/Qwen3/Mistral/"
                           "Qwen3-MoE-style target.", hint="drop --cuda-graphs")  # fmt: skip
    note = plain_path_note(dev.type, refusal, cuda_graphs)
    if note is not None:  # one line, then the plain path
        import sys

        print(note, file=sys.stderr)
    if compile and not fast:
        raise BackendError("--compile needs the CUDA-graph path (a CUDA device and a "
                           "Llama/Qwen2/Qwen3-style target).", hint="drop --compile")  # fmt: skip
    if uniform_width and not fast:
        raise BackendError("--uniform-width needs the CUDA-graph path.", hint="drop --uniform-width")
    impl = StaticBackend(target_model, draft_model, dev, compile=resolve_compile(compile, fast),
                         uniform_width=uniform_width, settings=settings,
                         ) if fast else TransformersBackend(target_model, draft_model, dev, settings)  # fmt: skip
    cost_key = {"backend": type(impl).__name__, "device": device_name(dev), "dtype": str(dt),
                "target": target_path, "draft": key_path(draft_dir), "draft_vocab": impl.draft_vocab_size,
                "threads": torch.get_num_threads() if dev.type == "cpu" else None,
                # costs measured with other settings are kept apart (the defaults' key unchanged)
                **({"kernel_settings": settings.record()} if settings != KernelSettings() else {}),
                **({"draft_window": draft_window} if draft_window is not None else {})}  # fmt: skip
    return Loaded(impl, tokenizer, stops, str(model or "demo"), draft_dir, cost_key)


def no_graphs_reason(target: Any, refusal: str | None = None) -> str:
    """Why the CUDA-graph path does not run a loaded target (one sentence for ``--cuda-graphs``);
    ``refusal`` is :func:`static_refusal`'s reason, if known."""
    text = target.config.get_text_config()
    if "linear_attention" in (getattr(text, "layer_types", None) or []):
        why = f" ({refusal})" if refusal else ""
        return (f"CUDA graphs run GatedDeltaNet hybrids of the Qwen3-Next / Qwen3.5 layouts only{why}; "
                "the plain path runs this one exactly.")  # fmt: skip
    why = f" ({refusal})" if refusal else ""
    return f"CUDA graphs need a Llama/Qwen2/Qwen3/Mistral/Qwen3-MoE-style target{why}."
