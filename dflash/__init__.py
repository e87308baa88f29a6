"""dflash: lossless speculative decoding with block-diffusion (DFlash) drafts.

Public API: :func:`load` -> :class:`Pipeline` (``chat_prompt``, ``generate``, ``stream``).
"""

from dflash._version import __version__
from dflash.types import GenerationResult, RoundResult, SamplingParams

__all__ = ["load", "Pipeline", "GenerationResult", "RoundResult", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy: `import dflash` and `dflash --help` must not import torch.
    if name in ("load", "Pipeline"):
        from dflash import api

        return getattr(api, name)
    raise AttributeError(name)
