"""Process set-up for commands that run only the mlx backend: no torch next to mlx.

mlx-lm imports transformers for its tokenizers, and transformers imports torch whenever torch is
installed (``transformers.configuration_utils`` -> ``modeling_rope_utils`` -> ``torch``): about
3.7 s of imports, torch's thread pools and, on a CUDA machine, torch's CUDA libraries (cuDNN,
cuBLAS of torch's CUDA version) loaded into the process before mlx's own. Nothing on the mlx
path uses torch (the GGUF conversion reads the file with numpy), so ``dflash generate mlx``,
``dflash benchmark mlx`` and ``dflash serve --backend mlx`` hide it before anything imports
transformers; transformers then runs torch-free, as it does where torch is not installed.

Torch-free and mlx-free: the CLI calls it before anything heavy.
"""

from __future__ import annotations

import sys

BLOCKED = "torch"


def keep_torch_out() -> bool:
    """Make ``import torch`` fail in this process (``sys.modules["torch"] = None``), so that
    transformers, imported by mlx-lm, sees no torch. Only for processes that never need torch:
    once hidden, transformers' model classes are unavailable in this process.

    Returns:
        True when torch is now hidden; False when torch (or transformers, which may already have
        decided that torch is there) was imported before: nothing changes then.
    """
    if sys.modules.get(BLOCKED, 0) is None:
        return True
    if BLOCKED in sys.modules or "transformers" in sys.modules:
        return False
    sys.modules[BLOCKED] = None  # importlib: find_spec -> None, import -> ImportError
    return True


def torch_loaded() -> bool:
    """Whether torch is imported in this process (a hidden torch does not count)."""
    return sys.modules.get(BLOCKED) is not None
