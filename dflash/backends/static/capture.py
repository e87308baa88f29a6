"""CUDA-graph capture of :class:`~dflash.backends.static.backend.StaticBackend` (a mixin it
inherits): the plan's graphs captured before a request (:meth:`StaticGraphs.capture_all`), each
forward once per (kind, width) with its own memory pool, optionally through ``torch.compile``,
under the PDL part of its forward, and the fall-back after a failed capture.
"""

from __future__ import annotations

import os
from functools import partial

import torch

from dflash.backends.static.graph_plan import allow_recompiles, inductor_cache_dir, warm_replays
from dflash.backends.static.switches import fall_back, inductor_pdl
from dflash.kernels.pdl import pdl_enabled, pdl_part


class StaticGraphs:
    """The graph methods of :class:`~dflash.backends.static.backend.StaticBackend` (which holds
    the state they use: ``graphs``, ``plan``, ``device_loop``, ``compile``, the forwards)."""

    def capture_all(self) -> None:
        """Capture the plan's graphs that are not captured yet (verify 1 and L, draft L).

        Each new graph is then replayed ``DFLASH_GRAPH_WARM`` times (default 3, see
        :func:`~dflash.backends.static.graph_plan.warm_replays`) before the request's first token: a
        graph's first launch uploads it to the device, and in a fresh process the GPU is still
        idle from compiling; both would otherwise land in the first decode steps of the first
        request. The static inputs made at capture point at the last cache rows, which no request
        reaches before overwriting them, so the replays are harmless.

        Raises:
            InputError: ``DFLASH_GRAPH_WARM`` is not a whole number >= 0 (before any capture).
        """
        warm = warm_replays()
        keys = self.plan.keys()
        if self.device_loop is not None:  # the same forwards with the device loop's glue
            keys += [("d" + kind, width) for kind, width in keys]
        new = [key for key in keys if key not in self.graphs]
        for kind, width in keys:
            if kind == "verify":
                self._verify_graph(width)
            elif kind == "draft":
                self._draft_graph(width)
            else:
                self._device_graph(kind, width)
        if new and warm > 0:
            for _ in range(warm):
                for key in new:
                    self.graphs[key][0].replay()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def _fn(self, kind: str, width: int = 0):
        """The forward a graph captures: eager, or once wrapped in ``torch.compile``; for the
        device loop's kinds (``dverify``, ``ddraft``) its glue around that forward."""
        head = {"argmax": True} if self.head_argmax else {}  # DFLASH_HEAD_ARGMAX: no logits
        dhead = self.device_loop_draft_kw()  # the device loop's draft: proposals only
        if kind in ("dverify", "ddraft") and self.compile and self.step_compile:
            key = f"{kind}-{width}"  # glue and forward traced as one function (DFLASH_STEP_COMPILE)
            if key not in self._compiled:
                inductor_cache_dir()
                lp = self.device_loop
                step = (partial(lp.verify_step, width, partial(self._target_forward, **head), whole=True)
                        if kind == "dverify" else partial(lp.draft_step, partial(self._draft_forward, **dhead),
                                                          whole=True))  # fmt: skip
                mode = os.environ.get("DFLASH_COMPILE_MODE") or None  # as the forwards below
                self._compiled[key] = torch.compile(step, dynamic=False, mode=mode)
            return self._compiled[key]
        if kind == "dverify":
            return lambda: self.device_loop.verify_step(width, partial(self._fn("verify"), **head))
        if kind == "ddraft":
            return lambda: self.device_loop.draft_step(partial(self._fn("draft"), **dhead))
        eager = self._target_forward if kind == "verify" else self._draft_forward
        if not self.compile:
            return eager
        if kind not in self._compiled:
            inductor_cache_dir()
            # DFLASH_COMPILE_MODE (e.g. max-autotune-no-cudagraphs: Triton GEMM templates tuned
            # per shape, minutes the first time) is an experiment; the default mode is measured.
            mode = os.environ.get("DFLASH_COMPILE_MODE") or None
            self._compiled[kind] = torch.compile(eager, dynamic=False, mode=mode)
        return self._compiled[kind]

    def _graph(self, kind: str, width: int, make_inputs):
        """Capture the ``kind`` forward once per (kind, width); returns (graph, outputs, inputs).

        Each graph gets its own memory pool: with a shared pool, one graph's intermediates may
        overwrite another's outputs (the draft's proposals are read after the verify replay).
        """
        key = (kind, width)
        if key in self.graphs:
            return self.graphs[key]
        static_inputs = make_inputs()  # allocated once per graph, not per step
        if self.compile:  # Dynamo compiles in this thread, during the warm-up (its config is
            allow_recompiles()  # per thread: a server captures in its worker thread)
        part = "draft" if kind in ("draft", "ddraft") else "target"
        try:
            with pdl_part(part):  # DFLASH_PDL=draft: PDL in the draft's graphs only
                with inductor_pdl(pdl_enabled(self.device, inductor=True), self.device):
                    self.graphs[key] = self._capture(self._fn(kind, width), static_inputs)
        except Exception as e:  # noqa: BLE001 - Inductor/Triton raise many types
            if not self._fall_back(e, part, kind):
                raise
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return self._graph(kind, width, make_inputs)
        return self.graphs[key]

    def _fall_back(self, error: Exception, part: str | None = None, kind: str | None = None) -> bool:
        """After a failed capture (of a ``kind`` graph), turn off the next optional piece (see
        :func:`~dflash.backends.static.switches.fall_back`); False when nothing is left."""
        return fall_back(self, error, part, kind)

    def _capture(self, fn, static_inputs):
        """Warm ``fn`` up, then capture it into a new graph with its own memory pool."""
        self._warm_up(fn, static_inputs)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            out = fn(*static_inputs)
        return graph, out, static_inputs

    def _warm_up(self, fn, static_inputs) -> None:
        """Run ``fn`` twice on a side stream (allocator, lazy inits, compilation) before capture."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                fn(*static_inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _verify_graph(self, width: int):
        def make_inputs():  # ids [1, W] and positions [1, W]; capture writes harmless rows
            return (torch.zeros(1, width, dtype=torch.long, device=self.device),
                    self.key_pos[-width:][None].clone())  # fmt: skip

        return self._graph("verify", width, make_inputs)

    def _device_graph(self, kind: str, width: int):
        """The device loop's graph ``kind`` ("dverify"/"ddraft") at ``width``; its state is parked
        (no budget, last cache rows) while the graph is warmed up and captured."""
        if (kind, width) not in self.graphs:
            self.device_loop.park()
        return self._graph(kind, width, tuple)

    def _draft_graph(self, length: int):
        dev, window = self.device, self.draft_block_size

        def make_inputs():  # block ids, anchor position, context rows; harmless during capture
            return (torch.full((1, length), self.mask_token_id, dtype=torch.long, device=dev),
                    self.key_pos[-length:-length + 1].clone(),
                    self.key_pos[-length - window : -length].clone())  # fmt: skip

        return self._graph("draft", length, make_inputs)
