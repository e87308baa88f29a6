"""CUDA-graph capture of :class:`~dflash.backends.static.backend.StaticBackend` (a mixin it
inherits): the plan's graphs captured before a request (:meth:`StaticGraphs.capture_all`), each
forward once per (kind, width) with its own memory pool, optionally through ``torch.compile``,
under the PDL part of its forward, and the fall-back after a failed capture.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from functools import partial

import torch

from dflash.backends.static.graph_plan import allow_recompiles, inductor_cache_dir
from dflash.kernels.settings import ENV, fall_back


@contextmanager
def inductor_pdl(on: bool, device: torch.device):
    """Inductor's PDL code (``torch._inductor.config.triton.enable_pdl``, a process-wide setting
    read when a forward compiles) set to ``on`` meanwhile, on CUDA where this torch has it, and
    restored afterwards (other ``torch.compile`` users in the process keep their setting).

    Dynamo does not guard compiled code on it: a frame shared by the draft's and the target's
    forwards keeps the setting of its first compile under the ``pdl`` setting ``draft``; both
    are exact."""
    import torch._inductor.config as inductor_config

    if device.type != "cuda" or not hasattr(inductor_config.triton, "enable_pdl"):
        yield
        return
    before = inductor_config.triton.enable_pdl
    inductor_config.triton.enable_pdl = on
    try:
        yield
    finally:
        inductor_config.triton.enable_pdl = before


class StaticGraphs:
    """The graph methods of :class:`~dflash.backends.static.backend.StaticBackend` (which holds
    the state they use: ``graphs``, ``plan``, ``device_loop``, ``compile``, ``settings``, the
    forwards)."""

    def capture_all(self) -> None:
        """Capture the plan's graphs that are not captured yet (verify 1 and L, draft L).

        Each new graph is then replayed ``graph_warm`` times (the setting, default 3) before the
        request's first token: a graph's first launch uploads it to the device, and in a fresh
        process the GPU is still idle from compiling; both would otherwise land in the first
        decode steps of the first request. The static inputs made at capture point at the last
        cache rows, which no request reaches before overwriting them, so the replays are
        harmless. A fall-back after a failed capture drops every graph, so the loop runs until
        all are captured with the same settings.
        """
        keys = self.plan.keys()
        if self.device_loop is not None:  # the same forwards with the device loop's glue
            keys += [("d" + kind, width) for kind, width in keys]
        if getattr(self, "dflash2", False):  # DFlash2: the sampled walk's draft graph too
            keys += [("sdraft", width) for kind, width in self.plan.keys() if kind == "draft"]
        new: set[tuple[str, int]] = set()
        while any(key not in self.graphs for key in keys):
            for kind, width in keys:
                if (kind, width) in self.graphs:
                    continue
                new.add((kind, width))
                if kind == "verify":
                    self._verify_graph(width)
                elif kind in ("draft", "sdraft"):
                    self._draft_graph(width, kind)
                else:
                    self._device_graph(kind, width)
        warm = self.settings.graph_warm
        if new and warm > 0:
            for _ in range(warm):
                for key in keys:
                    if key in new:
                        self.graphs[key][0].replay()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def _fn(self, kind: str, width: int = 0):
        """The forward a graph captures: eager, or once wrapped in ``torch.compile`` (the
        ``compile_mode`` setting, None: torch's default); for the device loop's kinds
        (``dverify``, ``ddraft``) its glue around that forward (the draft's proposals only)."""
        if kind == "dverify":
            return lambda: self.device_loop.verify_step(width, self._fn("verify"))
        if kind == "ddraft":
            return lambda: self.device_loop.draft_step(partial(self._fn("draft"), logits=False))
        eager = {"verify": self._target_forward, "draft": self._draft_forward,
                 "sdraft": partial(self._draft_forward, sample=True)}[kind]  # fmt: skip
        if not self.compile:
            return eager
        if kind not in self._compiled:
            inductor_cache_dir()
            self._compiled[kind] = torch.compile(eager, dynamic=False, mode=self.settings.compile_mode)
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
        part = "draft" if kind in ("draft", "ddraft", "sdraft") else "target"
        try:
            with inductor_pdl(self.pdl_on(part, inductor=True), self.device):  # per forward
                self.graphs[key] = self._capture(self._fn(kind, width), static_inputs)
        except Exception as e:  # noqa: BLE001 - Inductor/Triton raise many types
            if not self._fall_back(e, part):
                raise
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return self._graph(kind, width, make_inputs)
        return self.graphs[key]

    def _fall_back(self, error: Exception, part: str | None = None) -> bool:
        """After a failed capture (of the ``part`` forward's graph): the settings with the next
        live kernel off (:func:`~dflash.kernels.settings.fall_back`), else ``torch.compile``
        off, with one line on stderr; every graph is then captured again with them. False when
        nothing is left to turn off."""
        why = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
        step = fall_back(self.settings, self.live_kernels(part))
        if step is not None:
            settings, what, fix = step
            if settings.pdl != self.settings.pdl:  # compiled code has no guard on it: compile again
                self._compiled.clear()
                if self.device_loop is not None:
                    self.device_loop._compiled.clear()
                torch._dynamo.reset()
            self.configure(settings)
        elif self.compile:
            self.compile = False
            mode = self.settings.compile_mode
            what = "torch.compile"
            fix = f"eager ops (check {ENV['compile_mode']}={mode!r}, or --no-compile)" if mode else \
                "eager ops (--no-compile silences this)"
        else:
            return False
        self.graphs.clear()  # every graph again, with the same settings
        print(f"dflash: {what} failed ({why}); continuing with {fix}.", file=sys.stderr)
        return True

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

    def _draft_graph(self, length: int, kind: str = "draft"):
        """The draft graph at ``length`` (``kind`` "sdraft": a DFlash2 draft's sampled walk)."""
        dev, window = self.device, self.draft_block_size

        def make_inputs():  # block ids, anchor position, context rows; harmless during capture
            return (torch.full((1, length), self.mask_token_id, dtype=torch.long, device=dev),
                    self.key_pos[-length:-length + 1].clone(),
                    self.key_pos[-length - window : -length].clone())  # fmt: skip

        return self._graph(kind, length, make_inputs)
