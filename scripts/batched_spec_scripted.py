"""A batched speculative engine with scripted proposals (``scripts/gpu_check_batched_spec.py``; the
tests load it through ``tests/helpers/batched_spec.py``). Here, not under tests/, because GPU runs
get ``dflash/`` and ``scripts/`` only.

:class:`ScriptedSpec` replaces the draft's proposals of row r at every step by the row's true
continuation (``ScriptedJob.truth``: prompt + the target's greedy ids) for the first k positions
and wrong tokens ((t + 1) mod V) after, k taken from the job's ``schedule`` step by step
(cycled): so a greedy row accepts exactly min(k, trimmed width - 1) proposals per step. The draft
still runs (its cost is real); only its output is replaced, on the device, inside the step's graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash.backends.static.batched_spec import BatchedSpec, RowStep, SpecJob


@dataclass
class ScriptedJob(SpecJob):
    """A :class:`SpecJob` with ``truth`` (prompt + continuation ids, absolute positions) and the
    accepted-proposal ``schedule`` (cycled; empty = the draft's own proposals)."""

    truth: list[int] = field(default_factory=list)
    schedule: list[int] = field(default_factory=list)


class ScriptedSpec(BatchedSpec):
    """:class:`BatchedSpec` whose proposals follow each row's script (see the module docstring)."""

    def __init__(self, *args, force: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.force = force  # the target's greedy ids forced to the truth (see argmax_hook)
        z = dict(dtype=torch.long, device=self.device)
        self.truth = torch.zeros(self.b, self.slots + self.block, **z)
        self.script_k = torch.full((self.b,), -1, **z)  # -1: the draft's own proposals
        self.vocab = int(self.embed.shape[0])
        self.scripts: list[list[int]] = [[] for _ in range(self.b)]
        self.script_step = [0] * self.b

    def admit(self, jobs):
        out = super().admit(jobs)
        for s, j in zip(out, jobs, strict=True):
            truth = list(getattr(j, "truth", []))[: self.truth.shape[1]]
            self.truth[s.row].zero_()
            if truth:
                self.truth[s.row, : len(truth)] = torch.tensor(truth, device=self.device)
            self.scripts[s.row], self.script_step[s.row] = list(getattr(j, "schedule", [])), 0
        return out

    def step(self, length: int) -> list[RowStep]:
        ks = []
        for r in range(self.b):
            sched = self.scripts[r]
            ks.append(sched[self.script_step[r] % len(sched)] if sched else -1)
            if sched and self.jobs[r] is not None and not self.h_done[r]:
                self.script_step[r] += 1 if length > 1 else 0
        self.script_k.copy_(torch.tensor(ks, device=self.device))
        return super().step(length)

    def argmax_hook(self, best: torch.Tensor, nb: int) -> torch.Tensor:
        """With ``force``: the target's greedy ids replaced by the truth, so each row commits
        its truth and accepts exactly min(k, width - 1) proposals even where bf16 rounding of a
        random model's near-tied logits would part the batched run from the plain one (speed
        runs; the compute is unchanged). Rows without a script keep the target's ids."""
        if not self.force:
            return best
        j = torch.arange(best.shape[1], device=best.device)[None]
        at = (self.pos[:nb, None] + 1 + j).clamp(max=self.truth.shape[1] - 1)
        return torch.where(self.script_k[:nb, None] >= 0, self.truth[:nb].gather(1, at), best)

    def proposals_hook(self, props: torch.Tensor, nb: int) -> torch.Tensor:
        j = torch.arange(props.shape[1], device=props.device)[None]  # [1, L'-1]
        at = (self.pos[:nb, None] + 1 + j).clamp(max=self.truth.shape[1] - 1)
        true = self.truth[:nb].gather(1, at)
        k = self.script_k[:nb, None]
        scripted = torch.where(j < k, true, (true + 1) % self.vocab)
        return torch.where(k >= 0, scripted, props)
