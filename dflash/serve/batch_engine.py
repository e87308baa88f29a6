"""``dflash serve --max-batch N``: many generations at once through batched speculative decoding.

:class:`BatchEngine` is the :class:`~dflash.serve.engine.Engine` with a scheduler thread that
owns a :class:`~dflash.backends.static.batched_spec.BatchedSpec` of N rows: requests join free
rows between steps (prefilled together), every step drafts and verifies all rows at once (the
width chosen per step for the whole batch by :class:`~dflash.auto_block_batch.BatchPolicy` under
``--block-size auto``, else the fixed width), each row commits its own tokens under its own
budget, stop ids and sampling settings (its own seeded generator), and leaves when it ends or
its client goes. Greedy text is that of the request served alone (float32; in bf16 up to the
rounding of batched matmuls).

Where batching cannot run (N = 1, a target other than a dense Llama/Qwen2/Qwen3, a draft other
than DFlash v1, the mlx backend) it is the one-at-a-time Engine. Log-probabilities and
structured output stay on the one-at-a-time path (a 400 with ``--max-batch`` > 1).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dflash.serve.engine import Engine
from dflash.serve.protocol import ApiError
from dflash.types import RoundResult

CUDA_MAX_BATCH = 1  # --max-batch's default on CUDA: one at a time until the batched scheduler is measured there (docs/batched-spec.md)
BATCH_CAPACITY = 4096  # tokens per row (prompt + response), at most the model's context
COST_CONTEXT = 256  # context the step costs are timed at (keys attended)
ADMIT_WAIT_STEPS = 4  # a queued request waits at most this many steps for others to prefill with


@dataclass
class _Req:
    """One generation waiting for or holding a row."""

    ids: list[int]
    budget: int
    stops: list[int]
    sampling: Any
    cancel: threading.Event
    emit: Any
    info: dict
    row: int = -1
    last: float = field(default_factory=time.perf_counter)
    queued_step: int = 0
    need: int = 0  # tokens a batched row must hold: prompt + an explicit max_tokens (+1 else)


def default_max_batch(device: Any) -> int:
    """--max-batch when not given: ``CUDA_MAX_BATCH`` on CUDA, 1 elsewhere."""
    return CUDA_MAX_BATCH if getattr(device, "type", str(device)) == "cuda" else 1


class BatchEngine(Engine):
    """The Engine with batched generations (see the module docstring).

    Args:
        load, names, block_size, warmup: as :class:`Engine`.
        max_batch: rows decoded together; None = :func:`default_max_batch` for the device.
    """

    def __init__(self, *args, max_batch: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_batch_opt = max_batch
        self.max_batch = 1
        self.spec: Any = None
        self.policy: Any = None
        self.pending: deque[_Req] = deque()
        self.cond = threading.Condition()
        self.rows: dict[int, _Req] = {}
        self.step_no = 0  # batch steps run
        self.solo: tuple[_Req, Any] | None = None  # a lone request on the one-at-a-time path
        self.solo_runs = 0  # requests that ran there (tests)
        load = self._load

        def load_and_build() -> Any:  # the engine is ready (/health) once both are done
            pipe = load()
            self._build(pipe)
            return pipe

        self._load = load_and_build

    def _build(self, pipe: Any) -> None:
        """Make the batched engine when the pair and the device allow it, and start its thread."""
        from dflash.backends.static.backend import supports_dense_static

        be = pipe.backend
        target, draft = getattr(be, "target", None), getattr(be, "draft_model", None)
        device = getattr(be, "device", None)
        n = self.max_batch_opt if self.max_batch_opt is not None else default_max_batch(device)
        why = None
        if n <= 1:
            why = ""
        elif target is None or not supports_dense_static(target):
            why = "the target is not a dense Llama/Qwen2/Qwen3"
        elif draft is None or getattr(draft, "is_dflash2", False):
            why = "the draft is not DFlash v1"
        if why is not None:
            if why:
                print(f"dflash serve: one generation at a time ({why}; batching needs one).",
                      file=sys.stderr, flush=True)  # fmt: skip
            return
        from dflash.auto_block import load_acceptance
        from dflash.auto_block_batch import BatchCosts, BatchPolicy
        from dflash.backends.static.batched_spec import ROW_BUCKETS, BatchedSpec

        capacity = min(be.max_context, BATCH_CAPACITY)
        spec = BatchedSpec(target, draft, max_batch=n, capacity=capacity,
                           use_graphs=device.type == "cuda")  # fmt: skip
        block = spec.block
        self.batch_block = pipe.resolve_block_size(self.block_size_opt)  # "auto" or a width
        if self.batch_block == "auto":
            widths = sorted({w for w in (1, 2, 4, 8, 16) if w <= block} | {block})
            buckets = sorted({b for b in ROW_BUCKETS if b < n} | {n})
            repeats = 5 if device.type == "cuda" else 1
            costs = BatchCosts.measure(spec, buckets, widths, context=min(COST_CONTEXT, capacity // 2),
                                       repeats=repeats)  # fmt: skip
            prior = load_acceptance(getattr(pipe, "draft_dir", None), block).rates
            self.policy = BatchPolicy(costs, block, prior, plain_steps=spec.plain_steps)
        self.spec, self.max_batch = spec, n
        threading.Thread(target=self._loop, name="dflash-batch", daemon=True).start()
        print(f"dflash serve: batching up to {n} generations (block size {self.batch_block})",
              file=sys.stderr, flush=True)  # fmt: skip

    def check_host_path(self, what: str) -> None:
        super().check_host_path(what)
        if self.spec is not None:
            raise ApiError(400, f"{what} is not available with --max-batch > 1 yet; restart the "
                           "server with --max-batch 1 to use it.", param=what.strip("'"))  # fmt: skip

    # -- requests ---------------------------------------------------------------------------
    def run(self, ids, req, cancel, emit, sampling=None, info=None) -> None:  # type: ignore[override]
        """Queue the generation for the scheduler thread (returns at once); without batching,
        :meth:`Engine.run`."""
        if self.spec is None:
            return super().run(ids, req, cancel, emit, sampling, info)
        budget = req.max_tokens or (self.pipe.backend.max_context - len(ids))
        eos = [] if req.ignore_eos else list(self.pipe.stop_ids)
        stops = eos + [t for t in req.stop_token_ids if t not in eos]
        state = info if info is not None else {"state": "queued"}
        need = len(ids) + (req.max_tokens or 1)
        item = _Req(list(ids), budget, stops, sampling or req.sampling, cancel, emit, state,
                    queued_step=self.step_no, need=need)  # fmt: skip
        with self.cond:
            self.pending.append(item)
            self.cond.notify()

    def _loop(self) -> None:
        """The scheduler: admit, step, hand out tokens, end rows; forever."""
        while True:
            with self.cond:
                while not self.pending and not self.rows and self.solo is None:
                    self.cond.wait()
            try:
                self._admit()
                if self.solo is not None:
                    self._solo_step()
                if self.rows:
                    self._step()
            except Exception as err:  # noqa: BLE001 - every held request gets it; the server lives on
                for r in list(self.rows):
                    self._end(r, err)
                if self.solo is not None:
                    self._end_solo(err)

    def _admit(self) -> None:
        from dflash.backends.static.batched_spec import SpecJob

        spec = self.spec
        free = len(spec.free_rows())
        take: list[_Req] = []
        with self.cond:
            # prefills are eager (tens of ms of launches whatever their size): while rows are
            # busy, new requests join in groups (refill_min free rows), waiting a few steps at most
            if self.rows and self.pending and free < spec.refill_min:
                if self.step_no - self.pending[0].queued_step < ADMIT_WAIT_STEPS:
                    return
            alone = False  # a request no batched row holds runs alone, once the rows have drained
            while self.pending and len(take) < free:
                if self.pending[0].need > spec.max_len:
                    if take or self.rows or self.solo is not None:
                        break  # first in, first served: the queue behind it waits too
                    alone = True
                    take.append(self.pending.popleft())
                    break
                take.append(self.pending.popleft())
        ready = []
        for item in take:
            with self.metrics.lock:
                if item.info.get("state") == "dropped":
                    item.emit(("end", None))
                    continue
                item.info["state"] = "running"
                self.metrics.waiting -= 1
                self.metrics.running += 1
            ready.append(item)
        if not ready:
            return
        if len(ready) == 1 and not self.rows and self.solo is None and (alone or not self.pending):
            it = ready[0]  # alone: the one-at-a-time path (fused kernels, the device loop)
            self.solo_runs += 1
            gen = self.pipe.stream(it.ids, block_size=self.stream_block, max_new_tokens=it.budget,
                                   sampling=it.sampling, stop_ids=it.stops)  # fmt: skip
            self.solo = (it, gen)
            return
        jobs = [SpecJob(it.ids, it.budget, tuple(it.stops), it.sampling) for it in ready]
        try:
            steps = spec.admit(jobs)
        except Exception as err:  # noqa: BLE001 - e.g. a prompt past the rows' capacity
            for it in ready:
                self._finish(it, err)
            return
        now = time.perf_counter()
        for it, s in zip(ready, steps, strict=True):
            it.row, it.last = s.row, now
            self.rows[s.row] = it
            if self.policy is not None:
                self.policy.forget(s.row)
            it.info["cached_tokens"] = 0
            self.metrics.prefix(len(it.ids), 0)
            self.metrics.ttft.observe(now - it.info.get("submitted", now))
            self.metrics.tokens(len(s.tokens))
            it.emit(("step", RoundResult(tokens=s.tokens, accepted=None, finish_reason=s.finish)))
            if s.finish is not None or it.cancel.is_set():
                self._end(s.row, None)

    def _step(self) -> None:
        spec = self.spec
        busy = [r for r in self.rows if not spec.h_done[r]]
        if self.policy is not None:
            width = self.policy.choose(busy, [spec.h_limit[r] - spec.h_n[r] for r in busy],
                                       rows=spec.rows_bucket(busy))  # fmt: skip
        else:
            width = int(self.batch_block)
        steps = spec.step(width)
        self.step_no += spec.plain_steps if width == 1 else 1  # a plain call runs several
        now = time.perf_counter()
        for s in steps:
            it = self.rows[s.row]
            if self.policy is not None and s.proposed:
                self.policy.observe(s.row, s.accepted or 0, s.proposed)
            self.metrics.tokens(len(s.tokens))
            self.metrics.step(len(s.tokens), s.proposed)
            self.metrics.step_latency(now - it.last, len(s.tokens))
            it.last = now
            it.emit(("step", RoundResult(tokens=s.tokens, accepted=len(s.tokens), proposed=s.proposed,
                                         finish_reason=s.finish)))  # fmt: skip
            if s.finish is not None:
                self._end(s.row, None)
        for r in [r for r, it in self.rows.items() if it.cancel.is_set()]:
            self._end(r, None)

    def _solo_step(self) -> None:
        """One step of the lone request on the one-at-a-time path (interleaved with batch
        steps once other requests came and were batched)."""
        it, gen = self.solo
        try:
            step = next(gen)
        except StopIteration:
            return self._end_solo(None)
        now = time.perf_counter()
        self.metrics.tokens(len(step.tokens))
        if step.accepted is None:
            it.info["cached_tokens"] = 0
            self.metrics.prefix(len(it.ids), 0)
            self.metrics.ttft.observe(now - it.info.get("submitted", now))
        else:
            self.metrics.step(step.accepted, step.proposed)
            self.metrics.step_latency(now - it.last, len(step.tokens))
        it.last = now
        it.emit(("step", step))
        if step.finish_reason is not None or it.cancel.is_set():
            self._end_solo(None)

    def _end_solo(self, error: Exception | None) -> None:
        it, gen = self.solo
        self.solo = None
        gen.close()
        self._finish(it, error)

    def _end(self, row: int, error: Exception | None) -> None:
        it = self.rows.pop(row)
        self.spec.release(row)
        self._finish(it, error)

    def _finish(self, it: _Req, error: Exception | None) -> None:
        with self.metrics.lock:
            self.metrics.running -= 1
        self.metrics.e2e.observe(
            time.perf_counter() - it.info.get("submitted", time.perf_counter())
        )
        it.emit(("end", error))
