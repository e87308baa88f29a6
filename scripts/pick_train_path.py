"""Print 1 or 0: whether the new training path (DFLASH_TRAIN_FAST=1) should be used, from two
``scripts/train_profile.py`` results (old path first, new path second).

    python3 scripts/pick_train_path.py fast0.json fast1.json

The new path wins when it kept FlexAttention (no fall-back to dense masks) and trained at least
as many tokens per second as the old one, or when the old run produced nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def tokens_per_s(path: str) -> float:
    """Tokens/s of one profile, 0 when missing, failed, or fell back to dense masks."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return 0.0
    if d.get("flex_at_end") is False:
        return 0.0
    return float(d.get("tokens_per_s") or 0.0)


if __name__ == "__main__":
    old, new = tokens_per_s(sys.argv[1]), tokens_per_s(sys.argv[2])
    print(1 if new > 0 and new >= old else 0)
