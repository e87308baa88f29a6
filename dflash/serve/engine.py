"""The generation engine of ``dflash serve``: loads the pipeline in a background thread and runs
one generation at a time on a single worker thread (no batching). Each generation streams its
verify steps back to the event loop through an asyncio queue; a request that leaves (its client
disconnected, or it was cancelled) stops its generation at the next verify step, and a request
that leaves while still queued leaves the waiting gauge at once.

The Prometheus counters and gauges it moves are :class:`dflash.serve.metrics.ServerMetrics`.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dflash.errors import BackendError, DflashError, InputError
from dflash.options import WARMUP_DEFAULT
from dflash.serve.metrics import ServerMetrics
from dflash.serve.protocol import ApiError, GenRequest

DISCONNECT_CHECK_S = 0.5  # how often a non-streamed request asks whether its client is gone


class Engine:
    """Holds the pipeline (loaded in a background thread) and runs one generation at a time.

    Args:
        load: returns a ``dflash.api.Pipeline`` (called once, off the event loop).
        names: model names requests may ask for (the first is the served name).
        block_size: verify width L (None: auto, per step).
        warmup: untimed warm-up tokens per block size on the CUDA-graph path (``--warmup``).
    """

    def __init__(self, load: Callable[[], Any], names: list[str], block_size: int | None = None,
                 warmup: int = WARMUP_DEFAULT):  # fmt: skip
        self._load = load
        self.warmup = warmup
        self.names = names
        self.block_size_opt = block_size
        self.block_size = 1
        self.stream_block: int | str = 1
        self.pipe: Any = None
        self.error: DflashError | None = None
        self.on_failure: Callable[[], None] | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-generate")
        self.metrics = ServerMetrics(names[0], 1)  # made again at load with the block size
        self.active: set[threading.Event] = set()
        self.created = int(time.time())
        self.tool_parser_name: str | None = None  # --tool-call-parser (None: from the template)
        self.prefix_cache_bytes = 0  # --prefix-cache-mb (0: off)

    def start_loading(self) -> None:
        """Load in a daemon thread; on failure store the error and call ``on_failure``."""
        threading.Thread(target=self._load_now, name="dflash-load", daemon=True).start()

    def _load_now(self) -> None:
        t0 = time.perf_counter()
        try:
            pipe = self._load()
            resolved = pipe.resolve_block_size(self.block_size_opt)
            self.stream_block = resolved  # "auto" (default) or a fixed width
            self.block_size = pipe.block_size if resolved == "auto" else resolved  # stats width
            if resolved == "auto":
                pipe.calibrate()  # costs measured (or read from the cache) before any request
            if getattr(pipe.backend, "use_graphs", False):  # as `dflash generate` does
                self._warm_up(pipe, self.warmup)
            describe = getattr(pipe.backend, "describe", dict)
            if self.prefix_cache_bytes and hasattr(pipe.backend, "prefix_cache") \
                    and describe().get("impl") == "dynamic":  # the plain path  # fmt: skip
                from dflash.backends.prefix_cache import PrefixCache

                pipe.backend.prefix_cache = PrefixCache(self.prefix_cache_bytes)
            self.metrics = ServerMetrics(self.names[0], self.block_size)
            self.pipe = pipe
            print(f"dflash serve: {self.names[0]} ready in {time.perf_counter() - t0:.1f} s "
                  f"(block size {self.stream_block})", file=sys.stderr, flush=True)  # fmt: skip
        except Exception as err:  # noqa: BLE001 - reported as one line, then the server stops
            self.error = err if isinstance(err, DflashError) else BackendError(
                f"Loading the model failed: {type(err).__name__}: {err}")  # fmt: skip
            if self.on_failure:
                self.on_failure()

    @staticmethod
    def _warm_up(pipe: Any, tokens: int = WARMUP_DEFAULT) -> None:
        """The CUDA-graph path's untimed warm-up on a short chat prompt (``tokens`` tokens per
        block size; caches for up to 2,048 new tokens). Optional: a failure (e.g. out of memory)
        is one warning line on stderr and the server starts anyway."""
        try:
            ids = pipe.chat_prompt([{"role": "user", "content": "Hello"}])
            budget = max(1, min(2048, pipe.backend.max_context - len(ids)))
            pipe.warm_up(ids, max_new_tokens=budget, tokens=tokens)
        except Exception as err:  # noqa: BLE001 - the warm-up only saves the first request time
            print(f"dflash serve: warning: warm-up skipped ({type(err).__name__}: {err})",
                  file=sys.stderr, flush=True)  # fmt: skip

    def check_ready(self) -> None:
        """Raise ApiError 503 while loading (or after a failed load)."""
        if self.pipe is None:
            msg = "The model failed to load." if self.error else "The model is still loading."
            raise ApiError(503, msg, code="model_loading")

    def prompt_ids(self, req: GenRequest, prompt: str | list[int] | None = None) -> list[int]:
        """Template + tokenize on the event-loop thread (chat), or a completions ``prompt`` (text
        or token ids); ApiError 400 for a bad or long prompt, or a ``max_tokens`` that does not
        fit beside it in the context (as vLLM refuses it)."""
        pipe = self.pipe
        kwargs = self._template_kwargs(req) if req.chat else {}
        try:
            if req.chat:
                ids = pipe.chat_prompt(req.messages, template_kwargs=kwargs)
            else:
                ids = (
                    list(pipe.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else prompt
                )
                pipe.check_prompt(ids)
        except InputError as err:
            code = "context_length_exceeded" if "context" in err.message else None
            raise ApiError(400, err.message, param="messages" if req.chat else "prompt",
                           code=code) from None  # fmt: skip
        except Exception as err:  # noqa: BLE001 - e.g. a template that rejects the roles
            raise ApiError(400, f"The prompt cannot be built: {err}", param="messages") from None
        context = pipe.backend.max_context
        if req.max_tokens is not None and len(ids) + req.max_tokens > context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you "
                           f"requested {len(ids) + req.max_tokens} tokens ({len(ids)} in the prompt, "
                           f"{req.max_tokens} in the completion). Please reduce the length of the "
                           "prompt or max_tokens.", param="max_tokens", code="context_length_exceeded")  # fmt: skip
        return ids

    def _template_kwargs(self, req: GenRequest) -> dict[str, Any]:
        """The request's template kwargs, with ``reasoning_effort`` under the name this model's
        chat template reads (ApiError 400 when it reads none: it would be ignored)."""
        tools = {"tools": req.tools.tools} if req.tools is not None else {}
        if req.reasoning_effort is None:
            return {**tools, **req.template_kwargs}
        template = getattr(self.pipe.tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else ""
        key = next((k for k in ("reasoning_effort", "reasoning_strength") if k in template), None)
        if key is None:
            raise ApiError(400, "'reasoning_effort' cannot apply: this model's chat template has no "
                           "reasoning-effort setting.", param="reasoning_effort")  # fmt: skip
        return {**tools, key: req.reasoning_effort, **req.template_kwargs}

    def run(self, ids: list[int], req: GenRequest, cancel: threading.Event,
            emit: Callable[[tuple[str, Any]], None], sampling: Any = None,
            info: dict | None = None) -> None:  # fmt: skip
        """Worker thread: stream the generation's steps into ``emit``, then ("end", error|None).

        ``sampling``: the choice's settings (default ``req.sampling``); ``info``: the job's
        state shared with :meth:`steps`: "state" ("queued", "running" or "dropped" when its
        client left while it waited, already counted out of the waiting gauge), and
        "cached_tokens" (prompt tokens the prefix cache supplied) set here."""
        state = info if info is not None else {"state": "queued"}
        with self.metrics.lock:
            if state["state"] == "dropped":
                emit(("end", None))
                return
            state["state"] = "running"
            self.metrics.waiting -= 1
            if cancel.is_set():
                emit(("end", None))
                return
            self.metrics.running += 1
        error = None
        try:
            budget = req.max_tokens or (self.pipe.backend.max_context - len(ids))
            eos = [] if req.ignore_eos else list(self.pipe.stop_ids)
            stops = eos + [t for t in req.stop_token_ids if t not in eos]
            extra: dict[str, Any] = {}
            if req.logprobs is not None:
                extra["logprobs"] = req.logprobs
            if req.grammar is not None:
                extra["processor"] = req.grammar.processor(self.pipe)
            last = time.perf_counter()
            for step in self.pipe.stream(ids, block_size=self.stream_block, max_new_tokens=budget,
                                         sampling=sampling or req.sampling, stop_ids=stops,
                                         **extra):  # fmt: skip
                now = time.perf_counter()
                self.metrics.tokens(len(step.tokens))
                if step.accepted is not None:
                    self.metrics.step(step.accepted, step.proposed)
                    self.metrics.step_latency(now - last, len(step.tokens))
                else:  # the prefill's token: what the prefix cache gave is known now
                    state["cached_tokens"] = getattr(self.pipe.backend, "last_cached", 0)
                    self.metrics.prefix(len(ids), state["cached_tokens"])
                    self.metrics.ttft.observe(now - state.get("submitted", now))
                last = now
                emit(("step", step))
                if cancel.is_set():
                    break
        except Exception as err:  # noqa: BLE001 - handed to the request, the server lives on
            error = err
        finally:
            with self.metrics.lock:
                self.metrics.running -= 1
            self.metrics.e2e.observe(
                time.perf_counter() - state.get("submitted", time.perf_counter())
            )
        emit(("end", error))

    async def steps(self, ids: list[int], req: GenRequest, request: Any = None, *,
                    sampling: Any = None, info: dict | None = None) -> AsyncIterator[Any]:  # fmt: skip
        """Queue a generation and yield its RoundResults; leaving early cancels it (and a job
        still queued leaves the waiting gauge at once).

        With ``request`` given, a client disconnect is noticed within ``DISCONNECT_CHECK_S``
        seconds (non-streamed replies; for streamed ones Starlette cancels the response instead).
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        state = info if info is not None else {}
        state["state"], state["submitted"] = "queued", time.perf_counter()

        def emit(item: tuple[str, Any]) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone (server shutting down)
                cancel.set()

        with self.metrics.lock:
            self.metrics.waiting += 1
        self.active.add(cancel)
        self.executor.submit(self.run, ids, req, cancel, emit, sampling, state)
        checked = loop.time()
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_CHECK_S)
                except asyncio.TimeoutError:
                    kind, value = None, None
                # every DISCONNECT_CHECK_S, also while steps keep coming (a decoding request
                # never waits that long for its next step)
                if request is not None and loop.time() - checked >= DISCONNECT_CHECK_S:
                    checked = loop.time()
                    if await request.is_disconnected():
                        return
                if kind is None:
                    continue
                if kind == "end":
                    if value is not None:
                        raise value
                    return
                yield value
        finally:
            cancel.set()
            self.active.discard(cancel)
            with self.metrics.lock:
                if state["state"] == "queued":  # never started: out of the queue now
                    state["state"] = "dropped"
                    self.metrics.waiting -= 1

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the generation thread, between generations (a prompt forward)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    async def jobs(self, req: GenRequest) -> tuple[list[Any], list[Any]]:
        """The choices of a request in reply order (prompt by prompt, ``n`` each) with a fresh
        :class:`~dflash.serve.chat.Output` each; echoed prompts' log-probabilities are computed
        here (a prompt forward on the generation thread). ApiError 400 for a bad prompt or what
        this path cannot do."""
        import dataclasses

        from dflash.serve.chat import Job, Output

        if req.logprobs is not None or req.grammar is not None:
            self.check_host_path("'logprobs'" if req.logprobs is not None else "structured output")
        jobs = []
        for p, prompt in enumerate([None] if req.chat else req.prompts):
            ids = self.prompt_ids(req, prompt)
            echo_text, echo_lps, first = "", None, None
            if req.echo:
                echo_text = prompt if isinstance(prompt, str) else self.pipe.tokenizer.decode(
                    ids, skip_special_tokens=req.skip_special_tokens)  # fmt: skip
                if req.logprobs is not None:
                    echo_lps = await self.call(
                        lambda ids=ids, top=req.logprobs: self.pipe.prompt_logprobs(ids, top)
                    )
                    self.metrics.prompt(len(ids))  # a prompt forward of its own
                    first = ids[0]
            for j in range(req.n):
                sampling = req.sampling
                if j and sampling.seed is not None:
                    sampling = dataclasses.replace(sampling, seed=(sampling.seed + j) % 2**63)
                jobs.append(Job(p * req.n + j, ids, sampling, echo_text, echo_lps, first))
        outs = [Output(self.pipe.tokenizer, req, self.tool_parser(req), self.pipe.stop_ids)
                for _ in jobs]  # fmt: skip
        return jobs, outs

    def prepare(self, req: GenRequest, body: dict) -> None:
        """Set the request's structured-output constraint (``response_format``, ``guided_*``,
        or a forced ``tool_choice``: see :mod:`dflash.serve.grammar`); ApiError 400 for a bad
        one or a path that cannot apply it."""
        from dflash.serve.grammar import Grammar, spec_from, tool_grammar

        spec = spec_from(body)
        tools = req.tools
        if tools is not None and tools.choice not in ("none", "auto"):
            if spec is not None:
                raise ApiError(400, f"'{spec[1]}' cannot be combined with a forced 'tool_choice'.",
                               param=spec[1])  # fmt: skip
            spec = tool_grammar(tools.schemas, tools.choice), "tool_choice"
        if spec is None:
            return
        self.check_host_path("structured output")
        if "mlx" in type(self.pipe.backend).__module__:
            raise ApiError(400, "Structured output runs on the transformers backend only.",
                           param=spec[1])  # fmt: skip
        req.grammar = Grammar(*spec)
        req.grammar.check(self.pipe)

    def check_host_path(self, what: str) -> None:
        """ApiError 400 on the CUDA-graph path, whose steps do not hand their logits to the
        host loop's hooks yet (log-probabilities, grammars)."""
        describe = getattr(self.pipe.backend, "describe", None)
        if describe is not None and describe().get("impl") == "static":
            raise ApiError(400, f"{what} is not available on the CUDA-graph path yet; restart the "
                           "server with --no-cuda-graphs to use it.", param=what.strip("'"))  # fmt: skip

    def choice_meta(self, job: Any) -> dict[str, Any]:
        """Extra ``meta_info`` of a choice: ``cached_tokens`` (SGLang's name), the prompt
        tokens the prefix cache supplied."""
        return {"cached_tokens": job.info.get("cached_tokens", 0)}

    def tool_parser(self, req: GenRequest) -> Any:
        """A fresh tool-call parser for one reply to ``req`` (None: no tools, or
        ``tool_choice`` none); ApiError 400 when tools are asked for and no format is known."""
        from dflash.serve.tools import detect_parser, make_parser

        spec = req.tools
        if spec is None or spec.choice == "none":
            return None
        if spec.choice != "auto":  # forced: the grammar shapes the text, read as JSON
            return make_parser("forced", spec)
        name = self.tool_parser_name
        if name is None:
            template = getattr(self.pipe.tokenizer, "chat_template", None)
            config = getattr(getattr(self.pipe.backend, "target", None), "config", None)
            model_type = getattr(config, "model_type", None)
            name = detect_parser(template if isinstance(template, str) else None, model_type)
        if name is None:
            raise ApiError(400, "This model's chat template has no tool-call format dflash serve "
                           "recognises, so tool calls cannot be parsed; restart the server with "
                           "--tool-call-parser NAME, or send \"tool_choice\": \"none\".",
                           param="tools")  # fmt: skip
        return make_parser(name, spec)
