"""Rows joining and leaving a :class:`~dflash.backends.static.batched_spec.BatchedSpec`: admission
(the prompts' prefill and each row's first token), release, and the draft's lazy context
catch-up. A mixin: the engine's buffers and forwards are :class:`BatchedSpec`'s.

Prefill runs in chunks of ``prefill_chunk`` prompt positions for all joining rows at once
([R, C] tokens per forward, right-padded): on CUDA each chunk is one graph replay, captured per
(rows bucket, attention width) with the rows, tokens and positions in static buffers, so a
join costs a few replays instead of an eager forward's thousands of kernel launches. Padding
positions (past a prompt's end) write K/V and features a row never reads before it rewrites
them (a query attends keys at positions <= its own, and every position is written before it
is attended); rows padding the chunk up to its bucket are other free rows (their slots are
rewritten when they join), else the chunk runs at the exact rows count.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dflash.backends.static.batched_accept import accept_rows
from dflash.backends.static.batched_rows import RowStep, SpecJob
from dflash.errors import InputError

PREFILL_CHUNK = 64  # prompt positions per prefill forward (one graph replay on CUDA)
PREFILL_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class RowAdmission:
    """Admission, release and draft catch-up of :class:`BatchedSpec` rows (see the module
    docstring); needs the engine's ``_target``, ``_logits``, ``_graph`` and row state."""

    def _prefill(self, prompts: list[list[int]], rows: list[int]) -> torch.Tensor:
        """Run the target over ``prompts`` into ``rows`` (K/V and features at positions
        0..len-1) in chunks; returns the last layer's states [R, H] (before the final norm) at
        each prompt's last position."""
        with torch.inference_mode():
            return self._prefill_chunks(prompts, rows)

    def _prefill_chunks(self, prompts: list[list[int]], rows: list[int]) -> torch.Tensor:
        r, dev, c = len(prompts), self.device, self.prefill_chunk
        others = [x for x in self.free_rows() if x not in rows]
        rb = next((b for b in PREFILL_BUCKETS if b >= r), r)
        if rb - r > len(others):
            rb = r
        all_rows = rows + others[: rb - r]
        lens = [len(p) for p in prompts]
        chunks = -(-max(lens) // c)
        ids = np.zeros((rb, chunks * c), dtype=np.int64)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p
        self.p_rows[:rb].copy_(torch.tensor(all_rows))
        out = torch.zeros(r, self.embed.shape[1], dtype=self.dtype, device=dev)
        ar = torch.arange(c, device=dev)
        for k in range(chunks):
            lo = k * c
            width = min(self.slots, -(-(lo + c) // self.bucket) * self.bucket)
            self.p_ids[:rb].copy_(torch.from_numpy(ids[:, lo : lo + c]))
            self.p_pos[:rb].copy_((lo + ar).clamp(max=self.slots - 1)[None].expand(rb, c))

            def body(rb=rb, width=width):
                h = self._target(self.p_ids[:rb], self.p_pos[:rb], self.p_rows[:rb], width, True)
                self.p_out[:rb].copy_(h)

            self._graph(("prefill", rb, width), body)
            ends = [i for i, n in enumerate(lens) if lo <= n - 1 < lo + c]
            if ends:
                sel = torch.tensor(ends, device=dev)
                at = torch.tensor([lens[i] - 1 - lo for i in ends], device=dev)
                out[sel] = self.p_out[sel, at]
        return out

    def free_rows(self) -> list[int]:
        return [r for r in range(self.b) if self.jobs[r] is None]

    def busy_rows(self) -> list[int]:
        return [r for r in range(self.b) if self.jobs[r] is not None]

    def admit(self, jobs: Sequence[SpecJob]) -> list[RowStep]:
        """Prefill ``jobs`` into the lowest free rows (:meth:`_prefill`) and pick each one's
        first token; returns one :class:`RowStep` per job (``row`` is where it went).

        Raises:
            InputError: more jobs than free rows, an empty prompt, one that leaves no room in
                ``capacity``, or a budget < 1.
        """
        free = self.free_rows()
        if len(jobs) > len(free):
            raise InputError(f"{len(jobs)} jobs for {len(free)} free rows.")
        for j in jobs:
            if not j.prompt_ids or len(j.prompt_ids) >= self.max_len or j.max_new_tokens < 1:
                raise InputError(f"A prompt of {len(j.prompt_ids)} tokens does not fit the batched "
                                 f"engine's capacity of {self.max_len} tokens.",
                                 hint="raise the capacity or shorten the prompt")  # fmt: skip
        if not jobs:
            return []
        rows, dev = free[: len(jobs)], self.device
        need = max(len(j.stop_ids) for j in jobs) if jobs else 0
        if need > self.row_stops.shape[1]:  # more stop ids: a wider table (new graphs)
            wider = torch.full((self.b, need), -1, dtype=torch.long, device=dev)
            wider[:, : self.row_stops.shape[1]] = self.row_stops
            self.row_stops = wider
            self.spec_graphs.clear()
        rows_t = torch.tensor(rows, device=dev)
        lens = torch.tensor([len(j.prompt_ids) for j in jobs], device=dev)
        last = self._prefill([list(j.prompt_ids) for j in jobs], rows)
        with torch.inference_mode():
            logits = self._logits(last)[:, None]  # [R, 1, V]
            temp = torch.tensor(
                [j.sampling.temperature for j in jobs], dtype=torch.float32, device=dev
            )
            self.temp[rows_t] = temp
            self.top_k[rows_t] = torch.tensor([j.sampling.top_k for j in jobs], device=dev)
            self.top_p[rows_t] = torch.tensor(
                [j.sampling.top_p for j in jobs], dtype=torch.float32, device=dev
            )
            for r, j in zip(rows, jobs, strict=True):
                self.rngs[r] = None if j.sampling.greedy else np.random.default_rng(j.sampling.seed)
            unif = torch.tensor(np.stack([self._uniforms(r, 1) for r in rows]), device=dev)
            sampled = (
                self._sampled_rows(rows_t, unif)
                if not all(j.sampling.greedy for j in jobs)
                else None
            )
            zero = torch.zeros(len(jobs), dtype=torch.long, device=dev)
            _, first = accept_rows(logits, zero[:, None], zero, sampled)
        firsts = first.tolist()
        table = np.full((len(jobs), self.row_stops.shape[1]), -1, dtype=np.int64)
        for i, j in enumerate(jobs):  # every row's stop ids in one copy (no per-row launches)
            table[i, : len(j.stop_ids)] = list(j.stop_ids)
        self.row_stops[rows_t] = torch.from_numpy(table).to(dev)
        out = []
        for r, j, f in zip(rows, jobs, firsts, strict=True):
            stops = list(j.stop_ids)
            limit = min(j.max_new_tokens, self.max_len - len(j.prompt_ids))
            self.jobs[r] = j
            # no draft context yet (h_seen 0): the first drafted step's catch-up writes it, so
            # rows that never draft (plain steps only) never run the draft
            self.h_pos[r], self.h_seen[r], self.h_n[r], self.h_limit[r] = (
                len(j.prompt_ids),
                0,
                1,
                limit,
            )
            finish = "stop" if f in stops else ("length" if limit <= 1 else None)
            out.append(RowStep(r, [f], None, 0, finish))
            self.h_done[r] = finish is not None
        self.tok[rows_t], self.pos[rows_t] = first, lens
        self.n[rows_t] = 1
        self.limit[rows_t] = torch.tensor([self.h_limit[r] for r in rows], device=dev)
        self.live[rows_t] = True
        self.done[rows_t] = torch.tensor([s.finish is not None for s in out], device=dev)
        return out

    def _sampled_rows(self, rows: torch.Tensor, unif: torch.Tensor) -> dict:
        filters = bool(((self.top_k[rows] > 0) | (self.top_p[rows] < 1)).any())
        return {"temp": self.temp[rows], "unif": unif, "top_k": self.top_k[rows] if filters else None,
                "top_p": self.top_p[rows] if filters else None}  # fmt: skip

    def _uniforms(self, row: int, width: int) -> np.ndarray:
        """W + 1 uniforms of the row's own generator (zeros for a greedy row)."""
        rng = self.rngs[row]
        return (
            np.zeros(width + 1, dtype=np.float32)
            if rng is None
            else rng.random(width + 1).astype(np.float32)
        )

    def release(self, row: int) -> None:
        """Free a row (its request finished or left)."""
        self.jobs[row] = None
        self.h_done[row] = False
        self.rngs[row] = None
        self.live[row] = False
        self.done[row] = True

    def _catch_up(self, busy: list[int]) -> None:
        """Write the draft context K/V of rows committed since the last draft further back than
        L' rows (the prompt of a row not drafted yet, and rows of width-1 steps): positions
        h_seen .. h_pos - L' - 1 of every row that needs it, ``prefill_chunk`` positions per
        forward (one graph replay per (rows bucket) on CUDA; a row's shorter range repeats its
        last position). Rows padding the bucket rewrite their position 0 from their features."""
        lb = self.block
        need = [r for r in busy if self.h_pos[r] - self.h_seen[r] > lb]
        if not need:
            return
        span = max(self.h_pos[r] - lb - self.h_seen[r] for r in need)
        r, c = len(need), self.prefill_chunk
        others = [x for x in range(self.b) if x not in need]
        rb = next((b for b in PREFILL_BUCKETS if b >= r), r)
        if rb - r > len(others):
            rb = r
        pad = rb - r
        bounds = [[self.h_seen[x], self.h_pos[x] - lb - 1] for x in need] + [[0, 0]] * pad
        self.p_rows[:rb].copy_(torch.tensor(need + others[:pad]))
        self.c_bounds[:rb].copy_(torch.tensor(bounds))

        def body(rb=rb):
            rows, lo, hi = self.p_rows[:rb], self.c_bounds[:rb, :1], self.c_bounds[:rb, 1:]
            ctx = torch.minimum(lo + self.c_off + self.c_arange, hi)  # [rb, C]
            dc = self.dcache
            dc.rows, dc.write_pos, dc.width, dc.gather = rows, ctx, 1, True
            self.draft.write_context(self.feats[rows[:, None], ctx], ctx, dc)

        for k in range(-(-span // c)):
            self.c_off.fill_(k * c)
            self._graph(("catch_up", rb), body)
