"""Replay ``--block-size auto`` on recorded acceptance: what would the chooser have done?

Reads ``dflash benchmark --output`` records made at one fixed block size (the draft's trained
width is best: every step then shows how far the draft was right) and a cost table (the JSON
that ``--block-size auto`` caches under ``<dflash cache>/costs/``), and prints the speedup over
plain decoding that fixed block sizes and ``BlockPolicy`` variants reach when every step costs
what the table says. A step of width L that starts at token n accepts min(run(n), L - 1)
drafts, where run(n) is read off the recorded step that covered token n (a step starting inside
a recorded one gets what was left of that one's accepted run: slightly pessimistic). No
model runs; seconds per variant. Used to check the EMA weight and probe interval (issue 13).

    python scripts/auto_replay.py --costs costs.json records.jsonl [more.jsonl ...] \\
        [--alpha 0.05,0.15] [--probe-every 16,48] [--switch-budget 0,3] [--fixed 4,8,16] \\
        [--widths 1,2,3,4,6,8,12,16]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from dflash.auto_block import BlockPolicy, CostTable, load_acceptance
from dflash.models.target_torch import DEMO_DRAFT_DIR


def timelines(paths: list[str]) -> dict[str, list[list[int]]]:
    """dataset -> per response, run[n] = drafts a step starting at token n would get accepted."""
    out: dict[str, list[list[int]]] = defaultdict(list)
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                run: list[int] = []
                for length in rec["acceptance_lengths"]:
                    run += [max(0, length - 1 - i) for i in range(length)]
                out[rec["dataset"]].append(run)
    return out


def replay(run: list[int], costs: CostTable, choose, observe=None) -> float:
    """Seconds to produce len(run) tokens choosing each step's L with ``choose(remaining)``."""
    n, total, budget = 0, 0.0, len(run)
    while n < budget:
        width = max(1, min(choose(budget - n), budget - n))
        accepted = min(run[n], width - 1)
        total += costs.step_s(width)
        if observe is not None:
            observe(accepted, width - 1)
        n += accepted + 1
    return total


def speedup(runs: list[list[int]], costs: CostTable, make) -> float:
    """Plain decoding time over the replayed time, summed over responses."""
    plain = sum(len(r) * costs.step_s(1) for r in runs)
    spent = 0.0
    for r in runs:
        policy = make()
        spent += replay(r, costs, policy.choose, getattr(policy, "observe", None))
    return plain / spent


class Fixed:
    """A fixed block size (no learning)."""

    def __init__(self, width: int):
        self.width = width

    def choose(self, remaining: int) -> int:
        return self.width


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+")
    ap.add_argument("--costs", required=True, help="cost table JSON (verify_s, draft_s)")
    ap.add_argument("--draft", default=str(DEMO_DRAFT_DIR), help="folder with acceptance.json")
    ap.add_argument("--block-size", type=int, default=16, help="the draft's trained block size")
    ap.add_argument("--fixed", default="1,4,6,8,16")
    ap.add_argument("--alpha", default="0.05,0.15")
    ap.add_argument("--probe-every", default="16,48")
    ap.add_argument(
        "--switch-budget",
        default="3",
        help="BlockPolicy switch_budget values (0 = a switch to plain is immediate)",
    )
    ap.add_argument(
        "--widths",
        default=None,
        help="widths auto may use (a graph path's auto_widths), default 1..block size",
    )
    args = ap.parse_args()
    with open(args.costs, encoding="utf-8") as f:
        costs = CostTable.from_dict(json.load(f))
    prior = load_acceptance(args.draft, args.block_size)
    data = timelines(args.records)
    rows: list[tuple[str, object]] = [(f"fixed {w}", lambda w=w: Fixed(w))
                                      for w in map(int, args.fixed.split(","))]  # fmt: skip
    widths = [int(w) for w in args.widths.split(",")] if args.widths else None
    for a in map(float, args.alpha.split(",")):
        for pe in map(int, args.probe_every.split(",")):
            for sb in map(float, args.switch_budget.split(",")):
                rows.append((f"auto alpha={a} probe={pe} sb={sb:g}",
                             lambda a=a, pe=pe, sb=sb: BlockPolicy(
                                 costs, prior, args.block_size, alpha=a, probe_every=pe,
                                 switch_budget=sb, widths=widths)))  # fmt: skip
    print("variant".ljust(36) + "".join(ds.rjust(11) for ds in data))
    for label, make in rows:
        print(label.ljust(36) + "".join(f"{speedup(r, costs, make):10.3f}x" for r in data.values()))


if __name__ == "__main__":
    main()
