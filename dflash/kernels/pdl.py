"""Programmatic dependent launch (PDL) of the static path's kernels: whether a device supports it
(:func:`pdl_supported`) and the :class:`~dflash.kernels.settings.Launch` a kernel called without
one uses (:func:`default_launch`).

With PDL a kernel may start while the previous one finishes, streams weights that do not
depend on it, and waits (``griddepcontrol.wait``) before it reads or writes anything else.
Every PDL kernel waits before it lets its dependents start, so when a kernel starts, every
kernel but the one just before it has finished. Which forwards use it is the ``pdl`` field of
:class:`~dflash.kernels.settings.KernelSettings` (:func:`~dflash.kernels.settings.pdl_wanted`).

H200, real demo pair (``dflash benchmark``, gsm8k 64, one machine): DFlash 3,693.8 tok/s with
PDL against 3,277.2 without, the block-1 baseline 1,167.6 against 1,055.7; the same tokens and
acceptance lengths on all 64 prompts. PDL in the draft's forward only: 3,438.3 and 1,056.3.
"""

from __future__ import annotations

import torch

from dflash.kernels.settings import KernelSettings, Launch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
# PDL needs Triton's griddepcontrol intrinsics (with its ``launch_pdl`` launch option)
_HAS_GDC = triton is not None and hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait")
_CAPABILITY: dict[int, int] = {}  # CUDA device index -> compute capability major


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch with PDL: CUDA with compute capability >= 9
    (Hopper) and a Triton with ``tl.extra.cuda.gdc_wait`` (Triton 3.6 on the H200)."""
    if not (_HAS_GDC and device.type == "cuda"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)[0]
    return _CAPABILITY[index] >= 9


def default_launch(device: torch.device) -> Launch:
    """The default settings, with PDL where ``device`` supports it: how a kernel called without
    a :class:`~dflash.kernels.settings.Launch` runs (tests, sweeps)."""
    return Launch(KernelSettings(), pdl_supported(device))
