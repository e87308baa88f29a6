"""Step costs of ``--block-size auto``: the cost table, its measurement and its cache.

:class:`CostTable` holds the seconds of one verify step and one draft forward by width;
:func:`measure_costs` times them through the ``LocalBackend`` protocol and
:func:`load_or_measure_costs` keeps them as JSON under ``<dflash cache>/costs/``. The chooser
that prices widths with them is :class:`dflash.auto_block.BlockPolicy`; :mod:`dflash.auto_block`
re-exports every name here.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CALIBRATION_PROMPT = 128  # context length (tokens) the costs are timed at
CALIBRATION_REPEATS = 5  # timed repetitions per width (the median is kept)
COST_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # widths timed; others interpolated
COST_VERSION = 3  # cache key; 2: draft at the trained width, head on L-1 rows; 3: plain w/o features


@dataclass
class CostTable:
    """Measured seconds of one verify step and one draft forward by width.

    Attributes:
        verify_s: width L -> seconds of verify(anchor + L-1 proposals) + argmax + host copy
            + rollback (what the loop does per step besides drafting).
        draft_s: width L -> seconds of the draft forward of a width-L step, run as the loop
            runs it (at the draft's trained width, the head on L-1 rows where the backend
            takes ``rows``).
        key: what the table was measured for (backend, device, host, dtype, model, threads...).
        source: "measured" now, or "cache" when read from disk.
        path: the cache file it was read from or saved to (None: not cached).
        measured: when and under what load it was measured: ``at`` (ISO time), ``host``,
            ``load_per_core`` (the 1-minute load average per CPU core then; None where the
            platform has none).
        scale: online correction factors, ``plain`` (L = 1) and ``drafted`` (L > 1): the
            running ratio of timed steps to the table's cost (``BlockPolicy`` with a clock
            updates them; they live as long as the table object, not on disk).
    """

    verify_s: dict[int, float]
    draft_s: dict[int, float] = field(default_factory=dict)
    key: dict[str, Any] = field(default_factory=dict)
    source: str = "measured"
    scale: dict[str, float] = field(default_factory=lambda: {"plain": 1.0, "drafted": 1.0})
    path: str | None = None
    measured: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def _at(table: dict[int, float], width: int) -> float:
        """Linear interpolation between measured widths (flat beyond the ends)."""
        if width in table:
            return table[width]
        xs = sorted(table)
        if width <= xs[0]:
            return table[xs[0]]
        if width >= xs[-1]:
            return table[xs[-1]]
        hi = next(x for x in xs if x > width)
        lo = max(x for x in xs if x < width)
        return table[lo] + (table[hi] - table[lo]) * (width - lo) / (hi - lo)

    def step_s(self, length: int, draft_width: int | None = None) -> float:
        """Seconds of one step of width L: verify(L) + draft(draft_width or L) for L > 1
        (``draft_width``: price the draft as that of a width-``draft_width`` step)."""
        cost = self._at(self.verify_s, length)
        if length > 1 and self.draft_s:
            cost += self._at(self.draft_s, draft_width or length)
        return cost

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "verify_s": {str(k): v for k, v in self.verify_s.items()},
                "draft_s": {str(k): v for k, v in self.draft_s.items()}, "measured": self.measured}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "cache") -> CostTable:
        return cls({int(k): float(v) for k, v in data["verify_s"].items()},
                   {int(k): float(v) for k, v in data.get("draft_s", {}).items()},
                   dict(data.get("key", {})), source, measured=dict(data.get("measured") or {}))  # fmt: skip

    def provenance(self) -> dict[str, Any]:
        """Where the table comes from, for ``--verbose`` and ``--json``: ``source`` ("measured"
        now or "cache"), ``path``, and when, where and under what load it was measured."""
        return {"source": self.source, "path": self.path, **self.measured}

    def describe(self) -> str:
        """One line for ``--verbose``: measured now, or loaded from where, measured when."""
        load = self.measured.get("load_per_core")
        under = f", load {load:.2f} per core" if isinstance(load, (int, float)) else ""
        if self.source == "measured":
            saved = f"; saved to {self.path}" if self.path else ""
            return f"cost table measured now{under}{saved}"
        when = self.measured.get("at", "at an unknown time")
        host = self.measured.get("host")
        return f"cost table loaded from {self.path} (measured {when}{' on ' + host if host else ''}{under})"


def ladder(max_width: int, widths: list[int] | tuple[int, ...] | None = None) -> list[int]:
    """Widths to time: ``widths`` if given (e.g. a graph path's captured widths), else the
    ladder 1, 2, 3, 4, 5, 6, 8, ... up to ``max_width`` plus ``max_width`` itself."""
    if widths:
        return sorted({int(w) for w in widths if 1 <= w <= max_width} | {1})
    return sorted({w for w in COST_LADDER if w <= max_width} | {1, max_width})


def measure_costs(backend: Any, widths: list[int], *, prompt_len: int = CALIBRATION_PROMPT,
                  repeats: int = CALIBRATION_REPEATS, on_step: Any = None) -> CostTable:  # fmt: skip
    """Time verify and draft forwards of every width through the ``LocalBackend`` protocol.

    A random prompt of ``prompt_len`` tokens is prefilled, one token committed, then each width
    is timed ``repeats`` times, drafting as the loop does (at the trained width; the head on
    the L-1 rows verified when the backend sets ``draft_head_rows``). Widths are interleaved,
    so a noisy moment hits all of them alike, after one untimed round (which also captures
    CUDA graphs). The median repetition is kept: on a shared CPU other work slows every
    forward roughly in proportion to its length, and the fastest repetition would find a
    quiet moment more often for a short forward than for a long one, which skews the ratios
    the choice depends on (measured on 2 busy cores: verify(4)/verify(1) 2.8 by the fastest
    of 3 against 1.7 quiet). The costs are then made non-decreasing in width
    (pool-adjacent-violators), which removes what noise is left. The target cache is rolled back after every verify; the
    backend is reset at the end.

    Args:
        backend: any ``dflash.backends.base.LocalBackend`` (torch, MLX...).
        widths: widths L to time (1 = a plain one-token step, no draft).
        on_step: called with no argument after each of the ``(repeats + 1) * len(widths)``
            steps (a progress bar).

    Returns:
        CostTable with ``verify_s`` for every width and ``draft_s`` for widths > 1.
    """
    vocab = int(backend.vocab_size)
    prompt_len = max(2, min(prompt_len, backend.max_context - max(widths) - 8
                            - (repeats + 1) * len(widths)))
    ids = [(7 + 7919 * i) % vocab for i in range(prompt_len)]
    trained = getattr(backend, "draft_block_size", 1)
    drafting = trained > 1 and max(widths) > 1
    trim = bool(getattr(backend, "draft_head_rows", False))
    steps = (repeats + 1) * len(widths)  # each timed verify keeps its anchor (see below)
    backend.reset(prompt_len + steps + max(widths) + 8)
    _logits, _ = backend.prefill(ids, drafting)
    anchor, start = ids[-1], prompt_len
    _logits, feats = backend.verify(anchor, None, start, drafting)  # commit one token
    start += 1
    context = feats[:1] if drafting else None
    verify: dict[int, list[float]] = {w: [] for w in widths}
    draft: dict[int, list[float]] = {w: [] for w in widths if w > 1}
    for rep in range(repeats + 1):
        order = widths[rep % len(widths) :] + widths[: rep % len(widths)]
        for w in order:
            proposals = None
            if w > 1 and drafting:
                backend.synchronize()
                t0 = time.perf_counter()
                rows = {"rows": w - 1} if trim else {}
                proposals, _ = backend.draft(anchor, context, start, max(w, trained), **rows)
                proposals = proposals[: w - 1]
                backend.to_list(proposals)
                backend.synchronize()
                if rep:
                    draft[w].append(time.perf_counter() - t0)
            elif w > 1:  # no draft: verify a block of copies of the anchor
                continue
            backend.synchronize()
            t0 = time.perf_counter()
            # A plain step keeps no target features (the loop asks for them only in the
            # last FEATURE_LEAD plain steps before a probe); a drafted one does.
            logits, _ = backend.verify(anchor, proposals, start, drafting and w > 1)
            backend.to_list(backend.argmax(logits))
            # Keep the anchor, as the loop does: some caches (mlx) roll back only inside the
            # last verify and never past its first row.
            backend.rollback(start + 1)
            backend.synchronize()
            start += 1
            if rep:
                verify[w].append(time.perf_counter() - t0)
            if on_step is not None:
                on_step()
    backend.reset(prompt_len + max(widths) + 8)
    return CostTable(monotone({w: statistics.median(v) for w, v in verify.items() if v}),
                     monotone({w: statistics.median(v) for w, v in draft.items() if v}))  # fmt: skip


def monotone(table: dict[int, float]) -> dict[int, float]:
    """The non-decreasing fit of costs by width closest in squared error (pool adjacent
    violators): a wider forward is never predicted cheaper than a narrower one."""
    blocks: list[list[float]] = []  # [sum, count] per pooled run of widths
    for w in sorted(table):
        blocks.append([table[w], 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    values = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return dict(zip(sorted(table), values, strict=True))


def cost_cache_path(key: dict[str, Any]) -> Path:
    """``<dflash cache>/costs/<sha256(key)[:16]>.json``."""
    from dflash.models.target_torch import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return cache_root() / "costs" / f"{digest[:16]}.json"


def load_per_core() -> float | None:
    """The 1-minute load average per CPU core (None where the platform has none)."""
    try:
        return round(os.getloadavg()[0] / (os.cpu_count() or 1), 2)
    except (AttributeError, OSError):
        return None


LOAD_GAP = 0.5  # load per core, then vs now, from which a cached table's note is printed


def load_or_measure_costs(backend: Any, key: dict[str, Any], widths: list[int],
                          recalibrate: bool = False) -> CostTable:  # fmt: skip
    """The cost table for ``key`` from the cache, else measured now (with a progress bar on
    stderr) and cached.

    The key holds the machine's name (``host``) besides ``key``'s backend, device, dtype and
    pair, so a cache folder shared between machines never hands one machine another's costs.
    A table measured under a load per core that differs from the present one by
    :data:`LOAD_GAP` or more is used, with a one-line note on stderr (the block sizes it picks
    may suit the other load). ``recalibrate`` (``--recalibrate``) ignores the cache and overwrites it. A missing, corrupt
    or unwritable cache only means measuring again (never an error).
    """
    import platform
    import sys

    key = {**key, "host": platform.node(), "widths": list(widths), "cost_version": COST_VERSION}
    path = cost_cache_path(key)
    if not recalibrate and path.is_file():
        try:
            table = CostTable.from_dict(json.loads(path.read_text(encoding="utf-8")))
            if set(widths) <= set(table.verify_s):
                table.path = str(path)
                then, now = table.measured.get("load_per_core"), load_per_core()
                if isinstance(then, (int, float)) and now is not None and abs(now - then) >= LOAD_GAP:
                    print(f"dflash: the --block-size auto cost table was measured under another load "
                          f"({then:.2f} per core then, {now:.2f} now): its block sizes may suit that load; "
                          f"pass --recalibrate to measure again", file=sys.stderr, flush=True)  # fmt: skip
                return table
        except (OSError, ValueError, KeyError, TypeError):
            pass
    print(f"dflash: measuring step costs at widths {', '.join(map(str, widths))} for --block-size auto "
          f"(once per machine, device, dtype, target and draft; cached in {path.parent})", file=sys.stderr, flush=True)  # fmt: skip
    from dflash.progress import step_progress

    measured = {"at": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host": key["host"], "load_per_core": load_per_core()}
    with step_progress("calibrating --block-size auto", (CALIBRATION_REPEATS + 1) * len(widths)) as advance:
        table = measure_costs(backend, widths, on_step=advance)
    table.key, table.measured = key, measured
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table.to_dict(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        table.path = str(path)
    except OSError:
        pass
    return table
