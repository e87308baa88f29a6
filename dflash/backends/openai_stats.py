"""Acceptance statistics reported by OpenAI-compatible servers (brief §7.5), no HTTP here.

- SGLang ``meta_info``: per choice in chat completions when ``return_meta_info`` is set, else at
  the top level: ``spec_accept_length`` (τ), ``spec_verify_ct``, and a histogram when present;
  from ``dflash serve`` also each verify step's τ and proposals
  (``spec_accept_length_per_step``, ``spec_proposed_drafts_per_step``).
- vLLM ``/metrics`` (Prometheus text): the ``vllm:spec_decode_*`` counters, scraped before and
  after a run: τ = 1 + accepted tokens / drafts; per-position acceptance from the per-position
  counters (divided by ``num_drafts_per_pos`` where the server exports it, as ``dflash serve``
  does). ``dflash serve`` exports both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SPEC_PREFIX = "vllm:spec_decode_"


def extract_meta(obj: dict) -> dict | None:
    """SGLang ``meta_info``: ``choices[0].meta_info`` first (chat completions), else top level."""
    for choice in obj.get("choices") or []:
        if isinstance(choice, dict) and isinstance(choice.get("meta_info"), dict):
            return choice["meta_info"]
    meta = obj.get("meta_info")
    return meta if isinstance(meta, dict) else None


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of a Prometheus text exposition: name -> [(labels, value), ...]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        labels: dict[str, str] = {}
        if "{" in line:
            name, _, rest = line.partition("{")
            body, _, tail = rest.rpartition("}")
            for part in _split_labels(body):
                key, _, value = part.partition("=")
                labels[key.strip()] = value.strip().strip('"')
        else:
            name, _, tail = line.partition(" ")
        fields = tail.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out.setdefault(name.strip(), []).append((labels, value))
    return out


def _split_labels(body: str) -> list[str]:
    parts, current, quoted = [], "", False
    for i, ch in enumerate(body):
        if ch == '"' and (i == 0 or body[i - 1] != "\\"):
            quoted = not quoted
        if ch == "," and not quoted:
            parts.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current)
    return parts


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters, summed over label sets (engines, models).

    Attributes:
        drafts: verify steps that checked a draft (``num_drafts``).
        draft_tokens: draft tokens proposed (``num_draft_tokens``).
        accepted: draft tokens accepted (``num_accepted_tokens``).
        per_pos: accepted tokens at draft position 0, 1, ...
            (``num_accepted_tokens_per_pos{position}``): drafts whose first p+1 were accepted.
        reached: drafts that reached draft position 0, 1, ... (proposed a token there with all
            earlier ones accepted; ``num_drafts_per_pos{position}``, exported by ``dflash
            serve``); empty when the server does not export it (vLLM, SGLang).
    """

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)

    @classmethod
    def from_text(cls, text: str | None) -> SpecCounters | None:
        """Read the counters from ``/metrics`` text; None when the server exports none."""
        if not text:
            return None
        samples = parse_prometheus(text)

        def total(name: str) -> float | None:
            values = samples.get(SPEC_PREFIX + name + "_total") or samples.get(SPEC_PREFIX + name)
            return sum(v for _, v in values) if values else None

        drafts = total("num_drafts")
        if drafts is None:
            return None

        def by_position(name: str) -> list[float]:
            pos: dict[int, float] = {}
            for labels, value in samples.get(SPEC_PREFIX + name) or []:
                if labels.get("position", "").isdigit():
                    p = int(labels["position"])
                    pos[p] = pos.get(p, 0.0) + value
            return [pos.get(p, 0.0) for p in range(max(pos) + 1)] if pos else []

        return cls(drafts, total("num_draft_tokens") or 0.0, total("num_accepted_tokens") or 0.0,
                   by_position("num_accepted_tokens_per_pos_total"),
                   by_position("num_drafts_per_pos_total"))  # fmt: skip

    def minus(self, before: SpecCounters | None) -> SpecCounters:
        """Counters accumulated since ``before`` (a scrape taken earlier)."""
        if before is None:
            return self

        def diff(xs: list[float], ys: list[float]) -> list[float]:
            n = max(len(xs), len(ys))
            pad = lambda v: v + [0.0] * (n - len(v))  # noqa: E731
            return [a - b for a, b in zip(pad(xs), pad(ys), strict=True)]

        reached = diff(self.reached, before.reached) if self.reached else []
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted, diff(self.per_pos, before.per_pos),
                            reached)  # fmt: skip

    def stats(self) -> dict[str, Any] | None:
        """τ = 1 + accepted / drafts, acceptance rate = accepted / draft tokens, and per-position
        conditional acceptance P(k accepted | 1..k-1 accepted) (k = 1-based draft position);
        None when no draft was checked.

        The rate at k is ``per_pos[k-1] / reached[k-1]`` (drafts that accepted k over drafts
        that proposed k with 1..k-1 accepted), None where no draft reached k. Without
        ``reached`` (vLLM, SGLang: one width for every draft) the drafts that accepted k-1 stand
        in for those that reached k (``per_pos[k-2]``, ``drafts`` for k = 1): right at a fixed
        width, too many under varying widths (a draft fully accepted at width k never
        proposed k).
        """
        if self.drafts <= 0:
            return None
        rates: list[float | None] = []
        if self.reached:
            n = max(len(self.per_pos), len(self.reached))
            for k in range(n):
                count = self.per_pos[k] if k < len(self.per_pos) else 0.0
                reach = self.reached[k] if k < len(self.reached) else 0.0
                rates.append(count / reach if reach > 0 else None)
        else:
            previous = self.drafts
            for count in self.per_pos:
                rates.append(count / previous if previous > 0 else None)
                previous = count
        return {
            "tau": 1.0 + self.accepted / self.drafts,
            "drafts": int(self.drafts),
            "draft_tokens": int(self.draft_tokens),
            "accepted_tokens": int(self.accepted),
            "acceptance_rate": self.accepted / self.draft_tokens if self.draft_tokens else None,
            "per_position_acceptance": rates,
        }


def meta_stats(meta: dict | None) -> dict[str, Any] | None:
    """τ, verify steps, histogram and per-step lists from SGLang-style ``meta_info``; None when
    it has no τ.

    Returns:
        {"tau": float, "verify_ct": int | None, "histogram": list[int] | None,
        "accept_lengths": list[int] | None, "proposed": list[int] | None} where
        ``histogram[k]`` counts verify steps with k accepted drafts (τ = k + 1), and
        ``accept_lengths[i]`` / ``proposed[i]`` are verify step i's τ (bonus included) and draft
        tokens proposed (``spec_accept_length_per_step`` / ``spec_proposed_drafts_per_step``,
        sent by ``dflash serve``); both None unless both are int lists of one length with
        1 <= τ <= proposed + 1 at every step.
    """
    if not meta:
        return None
    tau = meta.get("spec_accept_length")
    if not isinstance(tau, (int, float)) or isinstance(tau, bool):
        return None
    verify = meta.get("spec_verify_ct")
    hist = meta.get("spec_correct_drafts_histogram", meta.get("spec_accept_histogram"))
    ok_hist = isinstance(hist, list) and all(isinstance(h, int) for h in hist)
    taus = meta.get("spec_accept_length_per_step")
    props = meta.get("spec_proposed_drafts_per_step")

    def ints(xs: Any) -> bool:
        return isinstance(xs, list) and all(type(x) is int for x in xs)

    ok_steps = (ints(taus) and ints(props) and len(taus) == len(props)
                and all(1 <= a <= p + 1 for a, p in zip(taus, props, strict=True)))  # fmt: skip
    return {
        "tau": float(tau),
        "verify_ct": int(verify) if isinstance(verify, (int, float)) else None,
        "histogram": list(hist) if ok_hist else None,
        "accept_lengths": list(taus) if ok_steps else None,
        "proposed": list(props) if ok_steps else None,
    }
