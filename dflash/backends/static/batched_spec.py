"""Batched DFlash decoding with continuous batching: B rows, one draft and one verify forward per step.

    spec = BatchedSpec(target, draft, max_batch=16, capacity=2048)
    for job, tokens in spec.run([SpecJob(prompt_ids, 256), ...], block_size=8):
        ...

Every row holds one request at its own positions, in the per-row KV layout of
:class:`~dflash.backends.static.batched.BatchedGenerator` (target K/V [B, Hkv, S, D] per layer,
written by position), plus the target features [B, S, F] the draft reads and the draft's context
K/V [B, Hkv', S, D']. A step of width L (the same for every row) drafts one block per row (the
draft at its trained width, from the anchor and the last L' committed rows' features, L' the
draft's block size), verifies [anchor, L - 1 proposals] of every row in one target forward,
accepts per row with the rule of :mod:`dflash.accept` (each row's width trimmed to its budget,
its own stop ids, its own sampling settings and seeded uniforms) and commits on the device
(:mod:`dflash.backends.static.batched_accept`); the host then reads one [B, 1 + L] buffer.
Width 1 is plain batched decoding through the same forward: ``plain_steps`` steps per graph
replay and host sync, no draft forward (as the plain batched generator). Rows join (prefilled
in chunks, right-padded, into the lowest free rows; the target only; :mod:`.batched_admit`)
and leave between calls.

On CUDA each step is one graph replay, captured per (rows bucket, attention width bucket, L,
sampling kind): the step runs over the first ``nb`` rows, ``nb`` the smallest bucket covering
the highest occupied row, and attends over the first ``width`` KV slots (a multiple of
``kv_bucket`` covering the longest row, dense attention with a per-row position mask). On the
CPU the same code runs eagerly; in float32 every row's greedy ids equal that row decoded alone
(tests/backends/static/test_batched_spec.py).

Draft context: a drafted step rewrites the draft K/V of the last L' rows before each row's
anchor; rows further back (the prompt, rows of plain steps) are written first by the chunked
catch-up (:meth:`BatchedSpec._catch_up`), so a row that never drafts never runs the draft.

Targets: dense full-attention Llama/Qwen2/Qwen3 (as the batched generator); drafts: DFlash v1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dflash.backends.draft_head import DraftHead
from dflash.backends.static.batched import BatchedGenerator
from dflash.backends.static.batched_accept import accept_rows, commit_rows
from dflash.backends.static.batched_admit import PREFILL_CHUNK, RowAdmission
from dflash.backends.static.batched_rows import DraftRows, RowStep, SpecJob
from dflash.errors import InputError
from dflash.models.draft_torch import rope_cos_sin

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
PLAIN_STEPS = 4  # plain (width-1) steps per graph replay and host sync (the plain generator's way)


class BatchedSpec(RowAdmission, BatchedGenerator):
    """Batched speculative decoding over a dense HF target and a DFlash v1 draft.

    Args:
        target: HF Llama/Qwen2/Qwen3 causal LM (full attention) on its device, eval mode.
        draft: :class:`~dflash.models.draft_torch.DFlashDraft` on the same device and dtype.
        max_batch: rows (B).
        capacity: tokens per row (prompt + response).
        use_graphs: one CUDA graph per step shape (CUDA only).
        kv_bucket: attention width granularity (KV slots).
        draft_vocab: score proposals over the draft's vocabulary when it has one.
        plain_steps: plain (width-1) steps per :meth:`step` call: one graph replay, one host
            sync, no draft, as the plain batched generator runs; rows join only between calls.
        prefill_chunk: prompt positions per prefill forward (one graph replay on CUDA).

    Memory: the target K/V of :class:`BatchedGenerator` plus B x S x F features and the draft's
    K/V, S = capacity + max(L', plain_steps) + 1 rounded up to ``kv_bucket``.

    Raises:
        InputError: bad sizes, or a draft that is not DFlash v1.
    """

    def __init__(self, target: Any, draft: Any, *, max_batch: int = 16, capacity: int = 2048,
                 use_graphs: bool = True, kv_bucket: int = 256, draft_vocab: bool = True,
                 plain_steps: int = PLAIN_STEPS, prefill_chunk: int = PREFILL_CHUNK):  # fmt: skip
        if draft is None or getattr(draft, "is_dflash2", False):
            raise InputError("Batched speculative decoding needs a DFlash v1 draft.")
        self.block = int(draft.config.block_size)  # L': the draft's trained width
        self.plain_steps = max(1, int(plain_steps))
        slots = -(-(capacity + max(self.block, self.plain_steps) + 1) // kv_bucket) * kv_bucket
        super().__init__(target, max_batch=max_batch, capacity=slots, use_graphs=use_graphs,
                         steps_per_sync=1, kv_bucket=kv_bucket, kv_lengths=False, compile=False)  # fmt: skip
        self.max_len, self.slots = capacity, slots
        self.draft = draft
        dc, dev, b = draft.config, self.device, max_batch
        self.feature_slots: dict[int, list[int]] = {}
        for n, i in enumerate(dc.target_layer_ids):  # HF hidden_states[i + 1]: layer i's output
            self.feature_slots.setdefault(int(i), []).append(n)
        self.n_feats = len(dc.target_layer_ids)
        hidden = target.config.hidden_size
        self.feats = torch.zeros(b, slots, self.n_feats * hidden, dtype=self.dtype, device=dev)
        self.dcache = DraftRows(dc.num_hidden_layers, b, dc.num_key_value_heads, slots, dc.head_dim,
                                 self.dtype, dev)  # fmt: skip
        self.head = DraftHead.for_draft(target.get_output_embeddings(), draft, draft_vocab)
        z = dict(dtype=torch.long, device=dev)
        self.mask_ids = torch.full((self.block - 1,), int(dc.mask_token_id), **z)
        self.arange = torch.arange(max(self.block, 1) + 1, **z)
        self.props = torch.zeros(b, max(self.block - 1, 1), **z)
        self.last = torch.zeros(b, 1 + max(self.block, self.plain_steps), **z)
        self.prefill_chunk = max(1, int(prefill_chunk))  # prefill's static buffers (batched_admit)
        self.p_ids = torch.zeros(b, self.prefill_chunk, **z)
        self.p_pos = torch.zeros(b, self.prefill_chunk, **z)
        self.p_rows = torch.zeros(b, **z)
        self.p_out = torch.zeros(b, self.prefill_chunk, hidden, dtype=self.dtype, device=dev)
        self.c_bounds = torch.zeros(b, 2, **z)  # the catch-up's first and last position per row
        self.c_off = torch.zeros(1, **z)  # the catch-up chunk's offset
        self.c_arange = torch.arange(self.prefill_chunk, **z)[None]
        self.row_stops = torch.full((b, 4), -1, **z)
        self.top_k, self.top_p = torch.zeros(b, **z), torch.ones(b, dtype=torch.float32, device=dev)
        self.unif = torch.zeros(b, max(self.block + 1, 2 * self.plain_steps), dtype=torch.float32,
                                device=dev)  # fmt: skip
        self.spec_graphs: dict[tuple, Any] = {}
        self.pool: Any = None
        # host mirrors, per row: position of the anchor, draft rows written (< seen), the job
        self.h_pos, self.h_seen, self.h_n = [0] * b, [0] * b, [0] * b
        self.h_limit = [0] * b
        self.h_done = [False] * b  # the row's request ended (stop or budget); still held
        self.jobs: list[SpecJob | None] = [None] * b
        self.rngs: list[np.random.Generator | None] = [None] * b
        self.steps_run = 0

    # ------------------------------------------------------------------------- forwards
    def _target(self, ids: torch.Tensor, qpos: torch.Tensor, rows: torch.Tensor, width: int,
                gather: bool) -> torch.Tensor:  # fmt: skip
        """Target forward of ids [R, T] at positions qpos [R, T] of batch rows ``rows`` [R]:
        writes K/V and features there, attends to keys <= each query's position among the
        first ``width`` slots; returns the last layer's hidden states [R, T, H] before the
        final norm (:meth:`_logits` applies it: returning the normed states would norm twice,
        which only weights of ones forgive). ``gather``: rows are arbitrary (prefill) rather
        than 0..R-1."""
        r, t = ids.shape
        cos, sin = rope_cos_sin(qpos, self.inv_freq, self.rope_scale, self.dtype)
        mask = self.key_pos[:width][None, None] <= qpos[:, :, None]  # [R, T, W]
        rep = self.heads // self.kv_heads
        gmask = mask[:, None, None].expand(r, 1, rep, t, width).reshape(r, 1, rep * t, width)
        x = F.embedding(ids, self.embed)
        slots: list[torch.Tensor] = [x] * self.n_feats
        last = len(self.layers) - 1
        ri = rows[:, None]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
            self.k[i][ri, :, qpos] = k.transpose(1, 2)  # [R, T, Hkv, D]
            self.v[i][ri, :, qpos] = v.transpose(1, 2)
            if gather:
                kc, vc = self.k[i][:, :, :width][rows], self.v[i][:, :, :width][rows]
            else:
                kc, vc = self.k[i][:r, :, :width], self.v[i][:r, :, :width]
            # query heads grouped by KV head as rows of one query ([R, Hkv, rep * T, D]): no K/V
            # copies, and the masked memory-efficient kernel (SDPA's enable_gqa is flash/math only)
            qg = q.reshape(r, self.kv_heads, rep * t, self.head_dim)
            o = F.scaled_dot_product_attention(
                qg, kc, vc, attn_mask=gmask, scale=layer.self_attn.scaling
            )
            o = o.view(r, self.heads, t, self.head_dim)
            x = self._finish_layer(layer, x, o.transpose(1, 2).reshape(r, t, -1))
            if i < last:
                for n in self.feature_slots.get(i, ()):
                    slots[n] = x
        if last in self.feature_slots:  # HF's hidden_states[N] is final-normed
            normed = self.model.model.norm(x)
            for n in self.feature_slots[last]:
                slots[n] = normed
        self.feats[ri, qpos] = torch.cat(slots, dim=-1)
        return x

    def _draft_rows(self, nb: int, width: int, length: int) -> None:
        """Draft one block per row 0..nb-1 (anchor ``tok`` at ``pos``; context: the last L'
        rows' features, clamped at 0) at the draft's width L'; the head scores the first
        ``length`` - 1 rows only, whose proposals go to ``props[:nb, :length - 1]``."""
        lb, pos = self.block, self.pos[:nb]
        ar = self.arange[:lb]
        ctx = (pos[:, None] - lb + ar).clamp(min=0)  # [nb, L']
        q_pos = pos[:, None] + ar  # [nb, L']
        dc = self.dcache
        dc.rows, dc.write_pos, dc.width, dc.gather = self.rows[:nb], ctx, width, False
        ones = torch.ones(nb, lb, dtype=torch.bool, device=self.device)
        valid = torch.cat((self.key_pos[:width][None] < pos[:, None], ones), 1)[:, None, None]
        k_pos = torch.cat((self.key_pos[:width][None].expand(nb, -1), q_pos), 1)
        rules = self.draft.inference_masks(q_pos, k_pos)
        masks = {kind: valid.expand(nb, 1, lb, -1) if rule is None else rule & valid
                 for kind, rule in rules.items()}  # fmt: skip
        block = torch.cat((self.tok[:nb, None], self.mask_ids[None].expand(nb, -1)), 1)
        hidden = self.feats[self.rows[:nb, None], ctx]  # [nb, L', F]
        h = self.draft(F.embedding(block, self.embed), hidden, q_pos, ctx, cache=dc, masks=masks)
        props = self.head.to_target(self.head.small_logits(h[:, 1:length]).argmax(-1))  # [nb, L-1]
        self.props[:nb, : length - 1].copy_(self.proposals_hook(props, nb))

    def argmax_hook(self, best: torch.Tensor, nb: int) -> torch.Tensor:
        """The target's greedy ids [nb, L] as accepted (identity; a benchmark may force them)."""
        return best

    def proposals_hook(self, props: torch.Tensor, nb: int) -> torch.Tensor:
        """The draft's proposals [nb, L-1] as verified (identity; tests and benchmarks script
        them, see ``scripts/gpu_check_batched_spec.py``)."""
        return props

    def _plain(self, nb: int, width: int, repeat: int, kind: str | None) -> None:
        """``repeat`` plain steps of rows 0..nb-1 (graphable, no host sync, no draft): step i
        writes its token to ``last[:, 1 + i]`` and adds its count to ``last[:, 0]`` (a row
        that stops stays stopped, so each row's tokens are ``last[r, 1 : 1 + count]``);
        sampled rows use ``unif[:, 2i : 2i + 2]``. The commit is the plain generator's (a
        handful of element-wise ops), equal to :func:`commit_rows` at width 1."""
        rows, last = self.rows[:nb], self.last[:nb]
        tok, pos, n, limit = self.tok[:nb], self.pos[:nb], self.n[:nb], self.limit[:nb]
        live, done, stops = self.live[:nb], self.done[:nb], self.row_stops[:nb]
        last[:, 0].zero_()
        zero = torch.zeros(nb, dtype=torch.long, device=self.device)
        for i in range(repeat):
            h = self._target(tok[:, None], pos[:, None], rows, width, gather=False)
            logits = self._logits(h)  # [nb, 1, V]
            nxt = self.argmax_hook(logits.argmax(-1), nb)[:, 0]
            if kind is not None:  # sampled rows: the bonus draw of accept.py at width 1
                sampled = {"temp": self.temp[:nb], "unif": self.unif[:nb, 2 * i : 2 * i + 2],
                           "top_k": self.top_k[:nb] if kind == "filters" else None,
                           "top_p": self.top_p[:nb] if kind == "filters" else None}  # fmt: skip
                nxt = accept_rows(logits, self.props[:nb], zero, sampled, nxt[:, None])[1]
            act = live & ~done & (limit > n)
            last[:, 1 + i] = nxt
            last[:, 0] += act
            tok.copy_(torch.where(act, nxt, tok))
            pos.add_(act)
            n.add_(act)
            done |= act & ((nxt[:, None] == stops).any(-1) | (n >= limit))

    def _step(self, nb: int, width: int, length: int, kind: str | None, repeat: int = 1) -> None:  # type: ignore[override]
        """One step of rows 0..nb-1 at verify width ``length`` (graphable, no host sync); at
        width 1, ``repeat`` plain steps (:meth:`_plain`)."""
        if length == 1:
            return self._plain(nb, width, repeat, kind)
        if length > 1:
            self._draft_rows(nb, width, length)
        rows = self.rows[:nb]
        ids = torch.cat((self.tok[:nb, None], self.props[:nb, : length - 1]), 1)
        qpos = self.pos[:nb, None] + self.arange[:length]
        h = self._target(ids, qpos, rows, width, gather=False)
        logits = self._logits(h)  # [nb, L, V]
        lim = (
            torch.minimum(self.limit[:nb] - self.n[:nb], torch.full_like(rows, length)) - 1
        ).clamp(min=0)
        sampled = None
        if kind is not None:
            sampled = {"temp": self.temp[:nb], "unif": self.unif[:nb],
                       "top_k": self.top_k[:nb] if kind == "filters" else None,
                       "top_p": self.top_p[:nb] if kind == "filters" else None}  # fmt: skip
        best = self.argmax_hook(logits.argmax(-1), nb)
        acc, bonus = accept_rows(logits, self.props[:nb], lim, sampled, best)
        commit_rows(acc, bonus, self.props[:nb], length, self._rows_state(nb))

    def _rows_state(self, nb: int) -> dict:
        return {"tok": self.tok[:nb], "pos": self.pos[:nb], "n": self.n[:nb], "limit": self.limit[:nb],
                "live": self.live[:nb], "done": self.done[:nb], "stops": self.row_stops[:nb],
                "last": self.last[:nb]}  # fmt: skip

    def _replay(self, nb: int, width: int, length: int, kind: str | None, repeat: int = 1) -> None:
        """Run the step (or a call's plain steps), eagerly or from its CUDA graph."""
        self._graph(
            (nb, width, length, kind, repeat), lambda: self._step(nb, width, length, kind, repeat)
        )

    def _graph(self, key: tuple, body: Callable[[], None]) -> None:
        """Run ``body`` eagerly (CPU), or from its CUDA graph ``key`` (captured at first use
        after two warm-up runs on a side stream, with every row marked not live so a step's
        warm-up commits nothing; a prefill's warm-up writes what its replay writes)."""
        if not self.use_graphs:
            with torch.inference_mode():
                body()
            return
        if key not in self.spec_graphs:
            live = self.live.clone()
            self.live.zero_()
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):
                    body()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:  # one memory pool for every graph: replays never overlap
                self.pool = torch.cuda.graph_pool_handle()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
                body()
            self.spec_graphs[key] = graph
            self.live.copy_(live)
        self.spec_graphs[key].replay()

    def time_step(self, nb: int, length: int, context: int) -> float:
        """Seconds of one step of ``nb`` rows at width ``length`` attending over ``context``
        keys (every row marked not live, so nothing is committed; synchronised wall time). At
        width 1: a call's ``plain_steps`` steps (one replay, one sync), divided by their number:
        what a plain step costs as :meth:`step` runs it."""
        repeat = self.plain_steps if length == 1 else 1
        width = min(
            self.slots, -(-(context + max(length, repeat) + 1) // self.bucket) * self.bucket
        )
        live = self.live.clone()
        self.live.zero_()
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda *a: None)
        try:
            sync(self.device)
            t0 = time.perf_counter()
            self._replay(nb, width, length, None, repeat)
            sync(self.device)
            return (time.perf_counter() - t0) / repeat
        finally:
            self.live.copy_(live)

    # ------------------------------------------------------------------------- rows
    def rows_bucket(self, busy: Sequence[int]) -> int:
        """The rows a step runs over (``nb``): the smallest of ``ROW_BUCKETS`` covering the
        highest busy row, at most B (1 with none busy). The chooser prices a step at it."""
        top = max(busy, default=0)
        return min(self.b, next((b for b in ROW_BUCKETS if b > top), self.b))

    def step(self, length: int) -> list[RowStep]:
        """One step of every busy row at verify width ``length`` (2..L'), or at width 1
        ``plain_steps`` plain steps in one replay (no draft, no catch-up); returns what each
        busy row committed (finished rows stay until :meth:`release`)."""
        busy = [r for r in self.busy_rows() if not self.h_done[r]]
        if not busy:
            return []
        length = max(1, min(length, self.block))
        repeat = self.plain_steps if length == 1 else 1
        nb = self.rows_bucket(busy)
        top = max(self.h_pos[r] for r in busy) + max(length, repeat) + 1
        width = min(self.slots, -(-top // self.bucket) * self.bucket)
        if length > 1:
            self._catch_up(busy)
        kind = None
        sampled = [r for r in range(nb) if self.rngs[r] is not None]
        if sampled:
            kind = "filters" if any(self.jobs[r].sampling.top_k > 0 or self.jobs[r].sampling.top_p < 1
                                    for r in sampled) else "temp"  # fmt: skip
            unif = np.zeros((nb, self.unif.shape[1]), dtype=np.float32)
            for r in sampled:  # each row's own generator, in its steps' order
                if length == 1:
                    unif[r, : 2 * repeat] = np.concatenate(
                        [self._uniforms(r, 1) for _ in range(repeat)]
                    )
                else:
                    unif[r, : length + 1] = self._uniforms(r, length)
            self.unif[:nb].copy_(torch.from_numpy(unif))
        self._replay(nb, width, length, kind, repeat)
        self.steps_run += 1
        got = self.last[:nb, : 1 + max(length, repeat)].cpu().tolist()  # the call's one host sync
        out = []
        for r in busy:
            count, toks = got[r][0], got[r][1 : 1 + got[r][0]]
            if length > 1:
                self.h_seen[r] = self.h_pos[r]
            proposed = min(length, self.h_limit[r] - self.h_n[r]) - 1
            self.h_pos[r] += count
            self.h_n[r] += count
            stops = self.jobs[r].stop_ids
            finish = (
                "stop"
                if toks and toks[-1] in stops
                else ("length" if self.h_n[r] >= self.h_limit[r] else None)
            )
            out.append(RowStep(r, toks, max(0, min(count - 1, proposed)), proposed, finish))
            self.h_done[r] = finish is not None
        return out

    # ------------------------------------------------------------------------- whole runs
    def run_jobs(self, jobs: Sequence[SpecJob], block_size: int | Callable[[list[int]], int] = 0,
                 on_step: Callable[[int, RowStep], None] | None = None) -> Iterator[tuple[int, list[int]]]:  # fmt: skip
        """Generate every job with continuous batching; yields ``(job index, ids)`` as each
        finishes; new jobs enter once ``refill_min`` rows are free (or none is busy), so prefills
        (eager) come in groups. ``block_size``: the width of every step (0 = the draft's L'), or a chooser
        called with the busy rows before each step. ``on_step(job index, RowStep)`` sees every
        row's every step (the prefill's token included)."""
        for r in self.busy_rows():
            self.release(r)
        owner: dict[int, int] = {}
        outs: dict[int, list[int]] = {}
        nxt = 0
        while nxt < len(jobs) or owner:
            free = self.free_rows()
            if nxt < len(jobs) and free and (len(free) >= self.refill_min or not owner):
                take = list(range(nxt, min(len(jobs), nxt + len(free))))
                steps = self.admit([jobs[i] for i in take])
                nxt += len(take)
                for i, s in zip(take, steps, strict=True):
                    owner[s.row], outs[i] = i, list(s.tokens)
                    if on_step is not None:
                        on_step(i, s)
            width = (
                block_size(self.busy_rows()) if callable(block_size) else (block_size or self.block)
            )
            for s in self.step(width):
                outs[owner[s.row]] += s.tokens
                if on_step is not None:
                    on_step(owner[s.row], s)
            for r in [r for r in owner if self.h_done[r]]:
                yield owner[r], outs.pop(owner[r])
                del owner[r]
                self.release(r)
