"""Which CUDA graphs the static path captures, how widths are padded onto them, and where
Inductor keeps compiled kernels. Plain Python (no CUDA needed), so it is unit-tested on CPU.

Plan: a request can need at most three graphs, all captured before its first token:

- verify at width 1 (block-size-1 baselines, and the last step when one token is left),
- verify at the draft's trained block size L (any narrower verify, e.g. the last block of a
  request cut by the token budget or a smaller ``--block-size``, is padded up to L and the extra
  rows are ignored; a padded row writes K/V only at positions past the committed length, which
  the position mask hides and the next step overwrites),
- the draft at L (the loop always drafts at the trained width).

Each graph has its own memory pool (one shared pool let verify intermediates overwrite the
draft's proposals), so graph memory is bounded by three pools per capacity; a larger request
re-allocates the caches and re-captures (before its first token).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

COMPILE_ENV = "TORCHINDUCTOR_CACHE_DIR"


@dataclass(frozen=True)
class GraphPlan:
    """The graphs of one static backend.

    Attributes:
        verify_widths: verify widths captured, ascending (tokens, anchor included).
        draft_width: width of the draft graph (the trained block size), 0 without a draft.
    """

    verify_widths: tuple[int, ...]
    draft_width: int

    def verify_width(self, width: int) -> int:
        """The captured width a verify of ``width`` rows runs at (padded up), or ``width`` itself
        when it exceeds every planned width (then it is captured on first use).

        Raises:
            ValueError: width < 1.
        """
        if width < 1:
            raise ValueError(f"verify width must be >= 1, got {width}")
        return next((w for w in self.verify_widths if w >= width), width)

    def keys(self) -> list[tuple[str, int]]:
        """(kind, width) of every graph to capture up front: verify widths, then the draft."""
        keys = [("verify", w) for w in self.verify_widths]
        return keys + ([("draft", self.draft_width)] if self.draft_width > 1 else [])


def plan_graphs(draft_block_size: int, has_draft: bool, uniform: bool = False) -> GraphPlan:
    """The capture plan for a target with (or without) a draft of trained block size L.

    Args:
        uniform: one verify width L for everything, block-1 decoding included (padded), so the
            baseline and DFlash run the same kernels and round alike in bf16 (an option for
            bitwise parity checks; a block-1 step then costs a width-L forward).

    Returns:
        GraphPlan with verify widths (1, L) ((L,) when uniform; (1,) without a draft or for
        L = 1) and the draft width L.
    """
    if uniform and has_draft and draft_block_size > 1:
        return GraphPlan(verify_widths=(draft_block_size,), draft_width=draft_block_size)
    if not has_draft or draft_block_size <= 1:
        return GraphPlan(verify_widths=(1,), draft_width=0)
    return GraphPlan(verify_widths=(1, draft_block_size), draft_width=draft_block_size)


def resolve_compile(compile_flag: bool | None, use_graphs: bool) -> bool:
    """``--compile/--no-compile``: None (default) compiles exactly when CUDA graphs are used.

    Compiling (Inductor) fuses the ~600 small kernels per forward; it costs about 30 s per graph
    on first use and much less later, as kernels are cached on disk (:func:`inductor_cache_dir`).
    Eager stays the reference and the CPU path.
    """
    if compile_flag is None:
        return use_graphs
    return bool(compile_flag)


def inductor_cache_dir() -> Path:
    """Set ``TORCHINDUCTOR_CACHE_DIR`` to ``<dflash cache>/inductor`` unless already set; returns
    the folder compiled kernels are kept in across runs."""
    from dflash.models.target_torch import cache_root

    if not os.environ.get(COMPILE_ENV):
        os.environ[COMPILE_ENV] = str(cache_root() / "inductor")
    return Path(os.environ[COMPILE_ENV])


RECOMPILE_LIMIT = 64


def allow_recompiles(limit: int = RECOMPILE_LIMIT) -> int:
    """Raise Dynamo's per-function recompile limit to at least ``limit`` (never lowers it);
    returns the limit in force.

    Dynamo keeps one cache per code object, shared by every ``torch.compile`` wrapper of it:
    each backend instance and each width adds an entry. Past the limit (8 by default) Dynamo
    silently runs the function eagerly, so a process with several backends or many widths
    (``--block-size auto``, ``scripts/bench_big.py``) would time eager steps as compiled ones.
    Called before each graph capture (whose warm-up is where Dynamo compiles the forwards and
    the device loop's glue): the setting holds in the calling thread only (torch keeps config
    overrides per context), and a server captures in its worker thread."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), limit))
    return getattr(dynamo_config, name)
