"""``--block-size auto``: pick the verify width L of every step from measured costs and acceptance.

Model (backend-free). A step of width L verifies [anchor, d_1 .. d_{L-1}]; with conditional
per-position acceptance rates p_k = P(d_k accepted | d_1..d_{k-1} accepted) it commits in
expectation

    τ(L) = 1 + Σ_{j=1}^{L-1} Π_{k=1}^{j} p_k      tokens (bonus included)

and costs c(L) = verify(L) + draft(L) seconds (no draft for L = 1; the draft runs at its
trained width, its LM head only on the L - 1 rows verified where the backend allows it). The
long-run decode rate of a renewal process is E[tokens] / E[time], so each step takes
argmax_L τ(L) / c(L) (ties go to the smaller L); L = 1 is plain decoding and wins when the draft
does not pay. The rates start from ``acceptance.json`` in the draft folder (written at training
time) or a conservative prior, and follow the request's own verify steps with an exponential
moving average. Once a request has drafted ``SWITCH_EVIDENCE`` steps, a switch from drafting to
plain decoding must be confirmed by a few drafted steps in a row (as many as cost at most
``SWITCH_BUDGET`` plain steps more than plain decoding would), so a short run of rejections
does not send a request that drafts well into a long plain stretch. Costs are timed once per device and model with a few forwards through the
``LocalBackend`` protocol and cached as JSON under ``<dflash cache>/costs/``; while requests run,
the wall time of every step corrects them online (one factor for plain steps, one for drafted
ones, an exponential moving average kept for the process), since a few timed forwards on a
shared machine can be off by a third.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash.errors import ConfigError

ACCEPTANCE_FILE = "acceptance.json"
PRIOR_RATE = 0.5  # per-position acceptance assumed for a draft without acceptance.json
EMA_ALPHA = 0.15  # weight of one verify step in the online acceptance estimate
PROBE_EVERY = 48  # after this many plain (L = 1) steps, one drafted step re-measures acceptance
PROBE_GAP_MAX = 1536  # a probe that does not bring drafting back doubles the gap, up to this
FIRST_PROBE = 2  # a request that starts plain probes at its 2nd step: its own evidence, early
SWITCH_BUDGET = 3.0  # plain steps' worth of extra time spent confirming a switch to plain
SWITCH_EVIDENCE = 16  # drafted steps of a request after which a switch to plain needs confirming
FEATURE_LEAD = 16  # plain steps before a probe whose target features are kept for the draft
CALIBRATION_PROMPT = 128  # context length (tokens) the costs are timed at
CALIBRATION_REPEATS = 5  # timed repetitions per width (the median is kept)
COST_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # widths timed; others interpolated
COST_ALPHA = 0.1  # weight of one timed step in the online cost correction
COST_SCALE_RANGE = (0.5, 2.0)  # a timed step counts as at most this far from the table's cost
COST_VERSION = 3  # cache key; 2: draft at the trained width, head on L-1 rows; 3: plain w/o features


# ---------------------------------------------------------------------------------------------
# acceptance


@dataclass
class AcceptancePrior:
    """Per-position acceptance a draft ships with (``acceptance.json`` in its folder).

    File format (JSON object)::

        {"block_size": 16,
         "position_acceptance": [0.64, 0.67, ...],   # p_1 .. p_{B-1}, each in [0, 1]
         "source": "how it was measured (dataset, device, dtype, steps)"}

    ``position_acceptance[k - 1]`` is P(draft position k accepted | positions 1..k-1 accepted),
    the same quantity ``dflash benchmark`` prints as per-position acceptance. ``dflash train``
    writes the rates as ``per_position`` (null where the held-out data never reached a
    position); a file with both keys may name the first one's origin in
    ``position_acceptance_source``.

    Attributes:
        block_size: B, the width the rates were measured at.
        rates: p_1 .. p_{B-1}.
        source: free text; "prior" when no file was found.
    """

    block_size: int
    rates: list[float]
    source: str = "prior"

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written to ``acceptance.json``."""
        return {"block_size": self.block_size, "position_acceptance": self.rates,
                "source": self.source}  # fmt: skip


def default_prior(block_size: int) -> AcceptancePrior:
    """The conservative prior used without ``acceptance.json``: p_k = 0.5 at every position."""
    return AcceptancePrior(block_size, [PRIOR_RATE] * max(block_size - 1, 0), "prior")


def load_acceptance(folder: str | Path | None, block_size: int) -> AcceptancePrior:
    """Read ``acceptance.json`` from a draft folder, else return :func:`default_prior`.

    Rates are cut or extended (with the last rate) to ``block_size - 1`` positions; a null rate
    (position never reached) takes the previous one (the prior's 0.5 at position 1).

    Raises:
        ConfigError: the file exists but is not valid JSON of the documented format.
    """
    path = Path(folder) / ACCEPTANCE_FILE if folder is not None else None
    if path is None or not path.is_file():
        return default_prior(block_size)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        key = "position_acceptance" if "position_acceptance" in data else "per_position"
        rates: list[float] = []  # per_position: as ``dflash train`` writes it, nulls included
        for r in data[key]:
            rates.append(float(r) if r is not None else (rates[-1] if rates else PRIOR_RATE))
        measured = int(data.get("block_size", len(rates) + 1))
        source = data.get(f"{key}_source", data.get("source", path))
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"{path} is not a valid acceptance file ({err}).",
                          hint="delete it or rewrite it in the format of dflash.auto_block") from None  # fmt: skip
    if not rates or not all(0.0 <= r <= 1.0 for r in rates):
        raise ConfigError(
            f"{path}: position_acceptance must be a non-empty list of rates in [0, 1]."
        )
    need = max(block_size - 1, 0)
    rates = (rates + [rates[-1]] * need)[:need]
    return AcceptancePrior(measured, rates, str(source))


def write_acceptance(folder: str | Path, rates: list[float], block_size: int, source: str) -> Path:
    """Write ``acceptance.json`` into a draft folder (for ``dflash train`` / ``benchmark``).

    Args:
        rates: p_1 .. p_{B-1}; None entries (position never reached) are replaced by the
            previous rate (or the prior for the first).
        block_size: B the rates were measured at.
        source: how they were measured, free text.
    """
    clean: list[float] = []
    for r in rates:
        clean.append(float(r) if r is not None else (clean[-1] if clean else PRIOR_RATE))
    path = Path(folder) / ACCEPTANCE_FILE
    path.write_text(
        json.dumps(AcceptancePrior(block_size, clean, source).to_dict(), indent=1) + "\n"
    )
    return path


def expected_tau(rates: list[float], length: int) -> float:
    """τ(L) = 1 + Σ_{j<L} Π_{k<=j} p_k: expected tokens committed by a width-L step."""
    tau, run = 1.0, 1.0
    for p in rates[: max(length - 1, 0)]:
        run *= p
        tau += run
    return tau


# ---------------------------------------------------------------------------------------------
# costs


@dataclass
class CostTable:
    """Measured seconds of one verify step and one draft forward by width.

    Attributes:
        verify_s: width L -> seconds of verify(anchor + L-1 proposals) + argmax + host copy
            + rollback (what the loop does per step besides drafting).
        draft_s: width L -> seconds of the draft forward of a width-L step, run as the loop
            runs it (at the draft's trained width, the head on L-1 rows where the backend
            takes ``rows``).
        key: what the table was measured for (backend, device, dtype, model, threads...).
        source: "measured" now, or "cache" when read from disk.
        scale: online correction factors, ``plain`` (L = 1) and ``drafted`` (L > 1): the
            running ratio of timed steps to the table's cost (``BlockPolicy`` with a clock
            updates them; they live as long as the table object, not on disk).
    """

    verify_s: dict[int, float]
    draft_s: dict[int, float] = field(default_factory=dict)
    key: dict[str, Any] = field(default_factory=dict)
    source: str = "measured"
    scale: dict[str, float] = field(default_factory=lambda: {"plain": 1.0, "drafted": 1.0})

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
                "draft_s": {str(k): v for k, v in self.draft_s.items()}}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "cache") -> CostTable:
        return cls({int(k): float(v) for k, v in data["verify_s"].items()},
                   {int(k): float(v) for k, v in data.get("draft_s", {}).items()},
                   dict(data.get("key", {})), source)  # fmt: skip


def ladder(max_width: int, widths: list[int] | tuple[int, ...] | None = None) -> list[int]:
    """Widths to time: ``widths`` if given (e.g. a graph path's captured widths), else the
    ladder 1, 2, 3, 4, 5, 6, 8, ... up to ``max_width`` plus ``max_width`` itself."""
    if widths:
        return sorted({int(w) for w in widths if 1 <= w <= max_width} | {1})
    return sorted({w for w in COST_LADDER if w <= max_width} | {1, max_width})


def measure_costs(backend: Any, widths: list[int], *, prompt_len: int = CALIBRATION_PROMPT,
                  repeats: int = CALIBRATION_REPEATS) -> CostTable:  # fmt: skip
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


def load_or_measure_costs(backend: Any, key: dict[str, Any], widths: list[int]) -> CostTable:
    """The cost table for ``key`` from the cache, else measured now and cached.

    ``DFLASH_RECALIBRATE=1`` ignores the cache. A missing, corrupt or unwritable cache only
    means measuring again (never an error).
    """
    key = {**key, "widths": list(widths), "cost_version": COST_VERSION}
    path = cost_cache_path(key)
    if not os.environ.get("DFLASH_RECALIBRATE") and path.is_file():
        try:
            table = CostTable.from_dict(json.loads(path.read_text(encoding="utf-8")))
            if set(widths) <= set(table.verify_s):
                return table
        except (OSError, ValueError, KeyError, TypeError):
            pass
    import sys

    print(f"dflash: measuring step costs at widths {', '.join(map(str, widths))} for --block-size auto "
          f"(once per device, dtype, target and draft; cached in {path.parent})", file=sys.stderr, flush=True)  # fmt: skip
    table = measure_costs(backend, widths)
    table.key = key
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table.to_dict(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass
    return table


# ---------------------------------------------------------------------------------------------
# the per-step chooser


@dataclass
class Choice:
    """One step's decision (shown by ``--verbose`` and ``--json``).

    Attributes:
        block_size: L chosen (1 = plain decoding).
        tau: predicted τ(L), tokens.
        cost_s: predicted step time, seconds.
        probe: a drafted step forced after many plain steps, to re-measure acceptance.
        held: a drafted step taken although plain decoding predicted more, to confirm a switch
            to plain (see ``BlockPolicy``).
        accepted: draft tokens accepted (filled in by ``observe``; None for L = 1).
    """

    block_size: int
    tau: float
    cost_s: float
    probe: bool = False
    held: bool = False
    accepted: int | None = None

    @property
    def rate(self) -> float:
        """Predicted tokens per second of this step."""
        return self.tau / self.cost_s if self.cost_s > 0 else math.inf


class BlockPolicy:
    """Chooses L each step and learns acceptance online; one object per request.

    The loop calls ``choose(remaining)`` before a step and ``observe(accepted, proposed)`` after
    its verify (``accepted`` = draft tokens accepted, ``proposed`` = L - 1).

    Args:
        costs: measured step costs.
        prior: per-position acceptance to start from (rates p_1 .. p_{B-1}).
        max_width: largest L (the draft's trained block size).
        widths: the allowed widths (e.g. captured CUDA-graph widths); None = 1..max_width.
        draft_width: the width the loop drafts at (None: at L; an int: always at that width,
            the first L-1 proposals used).
        alpha: EMA weight of one observation.
        probe_every: plain steps in a row before one drafted probe step (0 disables); each
            probe after which the choice stays at L = 1 doubles the gap (up to
            ``PROBE_GAP_MAX``), drafting again resets it, so on a long weak-draft request the
            probes cost less and less (on a CPU a failed probe costs about 1.5 plain steps).
        first_probe: the gap while the request has not drafted yet. The prior was measured
            elsewhere (another device, dataset, dtype); where it makes drafting look slightly
            worse than plain decoding (the demo pair on a CPU) a request would otherwise wait
            ``probe_every`` steps for its first evidence, and one probe then moves the EMA
            too little to matter: an easy request (gsm8k) decoded plainly throughout.
        clock: seconds (e.g. ``time.perf_counter``) to time each step with, from one ``choose``
            to the next (the loop syncs once a step, so that is the step's wall time); the
            times correct ``costs.scale`` (EMA weight ``COST_ALPHA``, each time clamped to
            ``COST_SCALE_RANGE`` of the table's cost), so later steps and requests price widths
            at what they really cost. None (the default): the table is used as it is.
        switch_budget: once the request has drafted ``SWITCH_EVIDENCE`` steps, drafting stops
            only after n drafted steps in a row predicted plain decoding to be faster, n = max(1,
            floor(switch_budget * c(1) / (c(L) - c(1)))) (L: the best drafted width), so the
            confirming steps cost at most ``switch_budget`` plain steps more than plain
            decoding even where the draft has stopped paying. Where a drafted step is cheap
            (an H200: c(L) ~ 1.7 c(1), n = 4) a few rejections in a row no longer start a plain
            stretch that a probe ends only dozens of steps later; where it is dear (a CPU:
            c(L) ~ 2.7 c(1), n = 1) the switch is immediate, as before. 0 disables it. Before
            ``SWITCH_EVIDENCE`` drafted steps the rates are mostly the prior's, not evidence,
            and a weak-draft request leaves them at once.
    """

    def __init__(self, costs: CostTable, prior: AcceptancePrior, max_width: int, *,
                 widths: list[int] | tuple[int, ...] | None = None, draft_width: int | None = None,
                 alpha: float = EMA_ALPHA, probe_every: int = PROBE_EVERY,
                 first_probe: int = FIRST_PROBE, clock: Any = None,
                 switch_budget: float = SWITCH_BUDGET):  # fmt: skip
        self.costs, self.prior, self.max_width = costs, prior, max_width
        allowed = widths if widths else range(1, max_width + 1)
        self.widths = sorted({int(w) for w in allowed if 1 <= w <= max_width} | {1})
        self.base_cost = {w: costs.step_s(w, draft_width) for w in self.widths}  # the table's
        self.step_cost: dict[int, float] = {}
        self._apply_scale()
        self.clock = clock
        self._t_prev: float | None = None  # when the previous choose() returned
        self.rates = list(prior.rates[: max(max_width - 1, 0)])
        self.rates += [self.rates[-1] if self.rates else PRIOR_RATE] * (
            max_width - 1 - len(self.rates)
        )
        self.start_rates = list(self.rates)
        self.reached = [0] * len(self.rates)  # observations per position in this request
        self.alpha, self.probe_every = alpha, probe_every
        self.history: list[Choice] = []
        self.switch_budget = switch_budget
        self._plain_run = 0
        self._doubt = 0  # drafted steps in a row after which plain decoding was predicted faster
        self._probe_gap = min(first_probe, probe_every)  # plain steps before the next probe

    def _apply_scale(self) -> None:
        sp, sd = self.costs.scale.get("plain", 1.0), self.costs.scale.get("drafted", 1.0)
        self.step_cost = {w: c * (sp if w == 1 else sd) for w, c in self.base_cost.items()}

    def observe_time(self, width: int, seconds: float) -> None:
        """Correct the costs with one timed step of ``width`` (seconds, wall time)."""
        base = self.base_cost.get(width, 0.0)
        if base <= 0 or seconds <= 0:
            return
        lo, hi = COST_SCALE_RANGE
        kind = "plain" if width == 1 else "drafted"
        ratio = min(max(seconds / base, lo), hi)
        old = self.costs.scale.get(kind, 1.0)
        self.costs.scale[kind] = old + COST_ALPHA * (ratio - old)
        self._apply_scale()

    def effective_rates(self) -> list[float]:
        """p_1 .. p_{B-1} used for predictions: the EMA where this request has reached a
        position; elsewhere the starting rate scaled by how the reached positions moved
        (Σ EMA / Σ start over them), so an easy request also raises positions the block has
        not reached yet and a hard one lowers them."""
        seen = [k for k, n in enumerate(self.reached) if n]
        if not seen:
            return self.rates
        base = sum(self.start_rates[k] for k in seen)
        scale = sum(self.rates[k] for k in seen) / base if base > 0 else 1.0
        return [r if n else min(1.0, s * scale)
                for r, n, s in zip(self.rates, self.reached, self.start_rates, strict=True)]  # fmt: skip

    def predict(self, length: int, rates: list[float] | None = None) -> Choice:
        """Predicted τ and step cost of width ``length`` under the current rates."""
        rates = self.effective_rates() if rates is None else rates
        return Choice(length, expected_tau(rates, length), self.step_cost[length])

    def best(self, remaining: int, drafted_only: bool = False) -> Choice:
        """The width maximising τ(L)/c(L) among allowed widths <= remaining (ties: smaller L)."""
        best: Choice | None = None
        rates = self.effective_rates()
        for w in self.widths:
            if w > max(remaining, 1) or (drafted_only and w == 1):
                continue
            c = self.predict(w, rates)
            if best is None or c.rate > best.rate * (1 + 1e-9):
                best = c
        return best or self.predict(1)

    def choose(self, remaining: int) -> int:
        """L for the next step, given ``remaining`` tokens of budget (L <= remaining)."""
        if self.clock is not None:  # the previous step ended here: time it
            now = self.clock()
            if self._t_prev is not None and self.history:
                self.observe_time(self.history[-1].block_size, now - self._t_prev)
            self._t_prev = now
        choice = self.best(remaining)
        last = self.history[-1] if self.history else None
        if choice.block_size > 1 and last is not None and last.block_size == 1:
            # A plain run ends only at a probe: the loop keeps target features for the draft
            # just before one (needs_features), and timed plain steps may move the costs.
            choice = self.predict(1)
        self._doubt = self._doubt + 1 if choice.block_size == 1 else 0
        if (choice.block_size == 1 and last is not None and last.block_size > 1
                and not last.probe and remaining > 1):  # fmt: skip
            held = self.best(remaining, drafted_only=True)
            if self._doubt < self.confirm_steps(held):
                held.held = True
                choice = held
        if self.history and self.history[-1].probe and choice.block_size == 1:  # it failed
            gap = max(self.probe_every, 2 * self._probe_gap)
            self._probe_gap = min(gap, max(PROBE_GAP_MAX, self.probe_every))
        if choice.block_size == 1 and self.probe_every and remaining > 1 and len(self.widths) > 1:
            self._plain_run += 1
            if self._plain_run >= self._probe_gap:
                choice = self.best(remaining, drafted_only=True)
                choice.probe = True
        if choice.block_size > 1:
            self._plain_run = 0
            if not choice.probe:  # drafting on its own merits: the regular gap again
                self._probe_gap = self.probe_every
        self.history.append(choice)
        return choice.block_size

    def confirm_steps(self, drafted: Choice) -> int:
        """Drafted steps in a row that must predict plain decoding before drafting stops: 1
        before the request has drafted ``SWITCH_EVIDENCE`` steps (or with ``switch_budget`` 0),
        else max(1, floor(switch_budget * c(1) / (c(L) - c(1)))) for the drafted width L."""
        extra = drafted.cost_s - self.step_cost[1]
        if not self.switch_budget or self.reached[0] < SWITCH_EVIDENCE or extra <= 0:
            return 1
        return max(1, int(self.switch_budget * self.step_cost[1] / extra))

    def needs_features(self) -> bool:
        """Whether the step just chosen must return target features for the draft.

        During a run of plain steps the choice can only change at the next probe (plain steps
        teach nothing), so features (which cost a few % of a one-token forward on a CPU) are
        kept only for the last ``FEATURE_LEAD`` plain steps before it; the probe's draft then
        sees the prompt, everything up to the run, and the latest tokens. Lossless either way.
        """
        if not self.history or self.history[-1].block_size > 1 or not self.probe_every:
            return True
        return self._probe_gap - self._plain_run <= FEATURE_LEAD

    def observe(self, accepted: int, proposed: int) -> None:
        """Update the rates from one verify step: ``accepted`` of ``proposed`` drafts matched.

        Positions 1..min(accepted + 1, proposed) were reached; those <= accepted passed.
        """
        if self.history and proposed:
            self.history[-1].accepted = accepted
        a, current = self.alpha, self.effective_rates()
        for k in range(1, min(accepted + 1, proposed, len(self.rates)) + 1):
            if not self.reached[k - 1]:  # first visit: start from the scaled rate, not the prior
                self.rates[k - 1] = current[k - 1]
            hit = 1.0 if accepted >= k else 0.0
            self.rates[k - 1] += a * (hit - self.rates[k - 1])
            self.reached[k - 1] += 1

    def summary(self) -> dict[str, Any]:
        """JSON-ready description: costs (ms), acceptance source, and every step's choice."""
        return {
            "acceptance_source": self.prior.source,
            "cost_source": self.costs.source,
            "step_cost_ms": {str(w): round(1000 * c, 3) for w, c in self.step_cost.items()},
            "cost_scale": {k: round(v, 4) for k, v in self.costs.scale.items()},
            "steps": [
                {**asdict(c), "cost_ms": round(1000 * c.cost_s, 3), "tau": round(c.tau, 3)}
                for c in self.history
            ],  # fmt: skip
        }
