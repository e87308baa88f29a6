"""Write a shallower copy of a trained DFlash draft: the layers kept, everything else unchanged.

    PYTHONPATH=. python3 scripts/truncate_draft.py --draft dflash/assets/smollm2-135m-instruct-dflash \
        --keep-layers 0,1,4 --out /tmp/draft-3l

The copy keeps the context projection ``fc``, ``hidden_norm``, the final ``norm``, the mask token,
the target layer ids and the kept decoder layers' weights (in the order given); its
``num_hidden_layers`` and ``layer_types`` follow. It is a starting point for
``dflash train --resume-from`` (weights only; its step count is 0): without training its
acceptance length is far lower (the demo draft's first, second and last layers gave τ 2.34
against 4.23 on 8 gsm8k prompts on a CPU). A draft of fewer layers costs less per verify step
(paper Table 6: 3 layers gave the same speed as 5 at a lower τ), see docs/benchmarks.md.

Exit status 1 with a one-line error for bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from torch import nn


def parse_layers(text: str, depth: int) -> list[int]:
    """``"0,1,4"`` -> [0, 1, 4]: layer indices below ``depth`` in increasing order, at least one
    (a draft's layers keep their order; "4,1" is refused as a likely typo).

    Raises:
        ValueError: an index is not an integer, not above the one before or out of range, or
            none is given.
    """
    msg = f"--keep-layers must list layers of 0..{depth - 1} in increasing order, e.g. 0,1,{depth - 1}; got {text!r}"
    try:
        keep = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(msg) from None
    if not keep or keep != sorted(set(keep)) or not all(0 <= i < depth for i in keep):
        raise ValueError(msg)
    return keep


def truncate(draft, keep: list[int]):
    """The draft with only the layers ``keep`` (in the order given); modifies and returns ``draft``."""
    cfg = draft.config
    draft.config = dataclasses.replace(cfg, num_hidden_layers=len(keep),
                                       layer_types=[cfg.layer_types[i] for i in keep])  # fmt: skip
    draft.layers = nn.ModuleList([draft.layers[i] for i in keep])
    return draft


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", required=True, help="a DFlash draft folder")
    ap.add_argument("--keep-layers", required=True, help="comma-separated layer indices, e.g. 0,1,4")
    ap.add_argument("--out", required=True, help="a new folder for the shallower draft")
    args = ap.parse_args()
    from dflash.errors import DflashError
    from dflash.models.draft_torch import DFlashDraft

    out = Path(args.out)
    try:
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"{out} is not empty; pass a new --out folder")
        draft = DFlashDraft.load(args.draft)
        keep = parse_layers(args.keep_layers, draft.config.num_hidden_layers)
        truncate(draft, keep).save(out)  # in the dtype the draft was stored in
    except (ValueError, DflashError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    n = sum(p.numel() for p in draft.parameters())
    print(f"wrote {out}: layers {keep} of the draft, {n:,} parameters")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
