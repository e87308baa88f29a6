"""Load any DFlash draft folder as the torch module its config names (brief §4.3: the class
follows ``architectures``: DFlash v1 or DFlash2)."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash.models.config import DraftConfig
from dflash.models.draft2_torch import DFlash2Draft
from dflash.models.draft_torch import DFlashDraft


def load_draft(folder: str | Path, dtype: torch.dtype | None = None, device="cpu") -> DFlashDraft:
    """A :class:`DFlashDraft` or :class:`DFlash2Draft`, as ``config.json`` says, on ``device``.

    Raises:
        CheckpointError, ConfigError: as :meth:`DFlashDraft.load`.
    """
    cls = DFlash2Draft if DraftConfig.load(Path(folder)).is_dflash2 else DFlashDraft
    return cls.load(folder, dtype=dtype, device=device)
