"""The backends dflash knows, in one place: every backend list in a message, a --help text or a
check comes from here (a list written out by hand once forgot openai).

Torch-free and mlx-free: the CLI imports it before anything heavy.
"""

from __future__ import annotations

from dflash.errors import BackendError

# backend -> what runs the models (the --help text of the BACKEND argument)
DESCRIPTIONS = {
    "transformers": "torch: CUDA or CPU",
    "mlx": "mlx-lm: Apple Silicon or Linux CPU",
    "openai": "a client of an OpenAI-compatible server",
}
BACKENDS = tuple(DESCRIPTIONS)  # every backend of `dflash generate` and `dflash benchmark`
LOCAL_BACKENDS = ("transformers", "mlx")  # run the models in this process (dflash.load)
CLIENT_BACKENDS = tuple(b for b in BACKENDS if b not in LOCAL_BACKENDS)  # openai


def one_of(names: tuple[str, ...] | list[str]) -> str:
    """``transformers, mlx or openai`` (``transformers or mlx`` for two, the name for one)."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def backend_help() -> str:
    """The --help text of the BACKEND argument: every backend with what runs it."""
    return "; ".join(f"{name} ({what})" for name, what in DESCRIPTIONS.items()) + "."


def check_backend(backend: str, command: str) -> None:
    """Refuse a backend name dflash does not know, naming every one it does; ``command``
    (``generate``, ``benchmark``) is the example in the hint.

    Raises:
        BackendError: ``Unknown backend 'x'; choose one of transformers, mlx or openai.``
    """
    if backend not in BACKENDS:
        raise BackendError(f"Unknown backend {backend!r}; choose one of {one_of(BACKENDS)}.",
                           hint=f"the backend is the first argument: dflash {command} transformers ...")  # fmt: skip


# the mlx backend's devices, in every --device error of it (dflash/api.py and dflash/backends/mlx.py)
MLX_DEFAULT_DEVICE = "the Metal GPU on Apple Silicon, the CPU on Linux"
MLX_DEVICES = "the mlx backend takes --device auto (its default device), cpu or gpu (cuda and metal mean gpu)"
MLX_NO_GPU_HINT = f"use --device auto or cpu; {MLX_DEVICES}"
