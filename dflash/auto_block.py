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

The cost table, its measurement and its cache live in :mod:`dflash.auto_block_costs`
(re-exported here).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflash.auto_block_costs import (  # noqa: F401 - re-exported
    CALIBRATION_PROMPT,
    CALIBRATION_REPEATS,
    COST_LADDER,
    COST_VERSION,
    CostTable,
    cost_cache_path,
    ladder,
    load_or_measure_costs,
    measure_costs,
    monotone,
)
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
COST_ALPHA = 0.1  # weight of one timed step in the online cost correction
COST_SCALE_RANGE = (0.5, 2.0)  # a timed step counts as at most this far from the table's cost


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
            "cost_table": self.costs.provenance(),
            "step_cost_ms": {str(w): round(1000 * c, 3) for w, c in self.step_cost.items()},
            "cost_scale": {k: round(v, 4) for k, v in self.costs.scale.items()},
            "steps": [
                {**asdict(c), "cost_ms": round(1000 * c.cost_s, 3), "tau": round(c.tau, 3)}
                for c in self.history
            ],  # fmt: skip
        }
