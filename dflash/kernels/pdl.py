"""Programmatic dependent launch (PDL) of the static path's kernels: the ``DFLASH_PDL`` switch
(:func:`pdl_enabled`, :func:`pdl_setting`), the forward being captured (:func:`pdl_part`) and
the fall-back that turns PDL off after a failed capture (:func:`disable_pdl`).

:mod:`dflash.kernels.small_linear` re-exports the public names; the process state
(``_PDL_OFF``, ``_PART``, ``_CAPABILITY``, ``_HAS_GDC``) lives here only: read and patch it here.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

PDL_ENV = "DFLASH_PDL"

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
# PDL needs Triton's griddepcontrol intrinsics (with its ``launch_pdl`` launch option)
_HAS_GDC = triton is not None and hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait")


def pdl_enabled(device: torch.device, inductor: bool = False) -> bool:
    """Whether the static path's kernels launch with programmatic dependent launch (PDL, on
    by default on Hopper and newer GPUs): a kernel may start while the previous one finishes,
    streams weights that do not depend on it, and waits (``griddepcontrol.wait``) before it
    reads or writes anything else. Every PDL kernel waits before it lets its dependents start,
    so when a kernel starts, every kernel but the one just before it has finished.

    ``DFLASH_PDL``: unset or ``1`` for this project's Triton kernels and Inductor's
    (``torch._inductor.config.triton.enable_pdl``), ``kernels`` for this project's only,
    ``draft`` for both but only in the draft's forward (what :func:`pdl_part` marks as
    ``"draft"`` while it is captured), ``0`` for none. ``inductor``: ask about Inductor's
    kernels. Needs CUDA with compute capability >= 9 (Hopper) and a Triton with
    ``tl.extra.cuda.gdc_wait`` (Triton 3.6 on the H200); otherwise it is off whatever the setting.

    H200, real demo pair (``dflash benchmark``, gsm8k 64, 2026-12-01, one machine): DFlash
    3,693.8 tok/s with ``1`` against 3,277.2 with ``0``, the block-1 baseline 1,167.6 against
    1,055.7; the same tokens and acceptance lengths on all 64 prompts. ``draft``: 3,438.3 and
    1,056.3.

    Raises:
        InputError: another value.
    """
    raw = pdl_setting()
    if _PDL_OFF:
        return False
    on = raw in ("", "1") or (raw == "kernels" and not inductor) or (raw == "draft" and _PART[0] == "draft")
    if not (on and _HAS_GDC and device.type == "cuda"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)[0]
    return _CAPABILITY[index] >= 9


def pdl_setting() -> str:
    """``DFLASH_PDL`` as given ("" when unset), checked.

    Raises:
        InputError: not one of 0, 1, kernels, draft.
    """
    raw = os.environ.get(PDL_ENV, "").strip().lower()
    if raw not in PDL_VALUES:
        from dflash.errors import InputError

        raise InputError(f"{PDL_ENV} must be 0, 1, kernels or draft, got {raw!r}.",
                         hint="unset it for the default (1)")  # fmt: skip
    return raw


_CAPABILITY: dict[int, int] = {}  # CUDA device index -> compute capability major
_PDL_OFF = False  # set by disable_pdl (a capture failed with PDL on)
_PART: list[str | None] = [None]  # the forward being captured ("draft", "target"), see pdl_part
PDL_VALUES = ("", "0", "1", "kernels", "draft")


@contextmanager
def pdl_part(part: str | None):
    """Mark the forward whose kernels are traced or captured meanwhile (``"draft"`` or
    ``"target"``) for :func:`pdl_enabled` under ``DFLASH_PDL=draft``."""
    before, _PART[0] = _PART[0], part
    try:
        yield
    finally:
        _PART[0] = before


def disable_pdl(device: torch.device, part: str | None = None) -> bool:
    """Turn PDL off for the rest of the process (the static path's fall-back after a failed
    capture of ``part``'s forward, see :func:`pdl_part`) when it was on for that capture on
    ``device`` (this project's kernels or Inductor's); returns whether it was."""
    global _PDL_OFF
    with pdl_part(part):
        was = pdl_enabled(device) or pdl_enabled(device, inductor=True)
    _PDL_OFF = _PDL_OFF or was
    return was
