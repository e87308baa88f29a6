"""``dflash serve``: an OpenAI-compatible HTTP server that decodes with DFlash.

    dflash serve                                   # demo pair on http://127.0.0.1:30000/v1
    dflash serve --model M --draft D --port 30000 --api-key KEY

Endpoints: ``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/responses`` (streamed
over SSE or not; tool calls: :mod:`dflash.serve.tools`; Responses: :mod:`dflash.serve.responses`),
``GET /v1/models``, ``/health`` (503 while the model loads) and ``/metrics`` (Prometheus text,
vLLM's spec-decode counter names, plus ``num_drafts_per_pos``). ``"return_meta_info": true``
adds SGLang-style per-choice ``meta_info`` (τ, verify steps, histogram, and each step's τ and
proposals: :func:`dflash.serve.protocol.meta_info`). Requests are queued and served one
generation at a time (no batching); each generation runs in one worker thread and streams back
through an asyncio queue; a client that disconnects cancels its generation at the next verify
step.

FastAPI and uvicorn are imported only when the server starts (``pip install "dflash[serve]"``).
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route functions' annotations
# (``Request``) at runtime, and those are local to build_app.
import asyncio
import hmac
import json
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any

import typer

from dflash.errors import BackendError, DflashError, InputError
from dflash.options import WARMUP_DEFAULT
from dflash.serve.chat import full_reply, stream_reply
from dflash.serve.protocol import ApiError, GenRequest, ServerMetrics, completion_id, parse_request
from dflash.serve.tools import check_tools, history_message

MAX_BODY_BYTES = 4 * 2**20
DEMO_NAME = "SmolLM2-135M-Instruct"
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
        self.metrics = ServerMetrics(names[0], 1)
        self.latency: Any = None  # dflash.serve.metrics.Latency once prometheus_client is there
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
            try:
                from dflash.serve.metrics import Latency

                self.latency = Latency(self.names[0])
            except ImportError:  # prometheus_client missing: /metrics without the histograms
                self.latency = None
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
                ids = list(pipe.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else prompt
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
                    if self.latency is not None:
                        self.latency.step(now - last, len(step.tokens))
                else:  # the prefill's token: what the prefix cache gave is known now
                    state["cached_tokens"] = getattr(self.pipe.backend, "last_cached", 0)
                    self.metrics.prefix(len(ids), state["cached_tokens"])
                    if self.latency is not None:
                        self.latency.ttft.observe(now - state.get("submitted", now))
                last = now
                emit(("step", step))
                if cancel.is_set():
                    break
        except Exception as err:  # noqa: BLE001 - handed to the request, the server lives on
            error = err
        finally:
            with self.metrics.lock:
                self.metrics.running -= 1
            if self.latency is not None:
                self.latency.e2e.observe(time.perf_counter() - state.get("submitted", time.perf_counter()))
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
                        lambda ids=ids, top=req.logprobs: self.pipe.prompt_logprobs(ids, top))
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


def build_app(engine: Engine, api_key: str | None = None, max_body: int = MAX_BODY_BYTES) -> Any:
    """The FastAPI application around an :class:`Engine` (loading starts with the app)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        engine.start_loading()
        yield
        for cancel in list(engine.active):  # shutting down: stop generations at the next step
            cancel.set()
        engine.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="dflash serve", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, err: ApiError) -> JSONResponse:
        headers = {"Retry-After": "5"} if err.status == 503 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(err.status_code, str(err.detail)).body(),
                            status_code=err.status_code)  # fmt: skip

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, err: Exception) -> JSONResponse:
        return JSONResponse(ApiError(500, f"Internal error: {type(err).__name__}").body(),
                            status_code=500)  # fmt: skip

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:].strip() if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise ApiError(401, "Missing or wrong API key (send 'Authorization: Bearer KEY').",
                           code="invalid_api_key")  # fmt: skip

    async def read_json(request: Request) -> Any:
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > max_body:
            raise ApiError(
                413, f"The request body exceeds {max_body} bytes.", code="request_too_large"
            )
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > max_body:
                raise ApiError(413, f"The request body exceeds {max_body} bytes.",
                               code="request_too_large")  # fmt: skip
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "The request body is not valid JSON.", param="body") from None

    async def complete(request: Request, chat: bool) -> Any:
        check_key(request)
        engine.check_ready()
        body = await read_json(request)
        req = parse_request(body, chat)
        check_model(req.model)
        if chat:
            req.tools = check_tools(body)
            for i, m in enumerate(req.messages):
                m.update(history_message(m, f"messages[{i}]"))
        else:
            for key in ("tools", "tool_choice", "functions", "function_call"):
                if body.get(key) not in (None, [], "none"):
                    raise ApiError(400, f"'{key}' applies to /v1/chat/completions only.", param=key)
        engine.prepare(req, body)
        jobs, outs = await engine.jobs(req)
        head = {"id": completion_id(chat), "created": int(time.time()), "model": engine.names[0]}
        t0 = time.perf_counter()
        if req.stream:
            return StreamingResponse(stream_reply(engine, jobs, req, outs, head, t0),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        return await full_reply(engine, jobs, req, outs, request, head, t0)

    def check_model(model: str | None) -> None:
        if model is not None and model not in engine.names:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves "
                           f"'{engine.names[0]}'.", param="model", code="model_not_found")  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        from dflash.serve.responses import respond

        reply = await respond(engine, await checked_body(request), request)
        if isinstance(reply, dict):
            return reply
        return StreamingResponse(reply, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})  # fmt: skip

    def card() -> dict[str, Any]:
        out = {"id": engine.names[0], "object": "model", "created": engine.created,
               "owned_by": "dflash", "root": engine.names[-1], "parent": None}  # fmt: skip
        if engine.pipe is not None:
            out["max_model_len"] = engine.pipe.backend.max_context
        return out

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        check_key(request)
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> Any:
        check_key(request)
        if model not in engine.names:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves "
                           f"'{engine.names[0]}'.", param="model", code="model_not_found")  # fmt: skip
        return card()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        from dflash.serve.tokens import tokenize

        return tokenize(engine, await checked_body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        from dflash.serve.tokens import detokenize

        return detokenize(engine, await checked_body(request))

    async def checked_body(request: Request) -> Any:
        """The JSON body of a request to the loaded model (key, readiness, model name checked)."""
        check_key(request)
        engine.check_ready()
        body = await read_json(request)
        model = body.get("model") if isinstance(body, dict) else None
        check_model(model if isinstance(model, str) else None)
        return body

    @app.get("/health")
    async def health() -> Any:
        if engine.pipe is None:
            state = "failed" if engine.error else "loading"
            return JSONResponse({"status": state}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Any:
        text = engine.metrics.render() + (engine.latency.render() if engine.latency else "")
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def _check_port_free(host: str, port: int) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise InputError(f"--host {host} cannot be resolved.") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as err:
            raise InputError(f"Cannot listen on {host}:{port} ({err.strerror}).",
                             hint="pick another --port or stop what uses it") from None  # fmt: skip


def _check_pair(model: str | None, draft: str | None, width: int | None, backend: str = "transformers",
                device: str = "auto", dtype: str = "auto", kernels: str = "auto") -> None:  # fmt: skip
    """The checks of ``dflash.load`` that read no weights, before the server binds its port: the
    ``--device`` and ``--dtype`` names (for ``backend``), ``--kernels`` and the kernel settings'
    environment overrides (:class:`~dflash.kernels.settings.KernelSettings`), the target path
    exists, the draft resolves to a folder (a hub id is downloaded now rather than after
    binding) and ``--block-size`` fits the draft's trained block size.

    Raises:
        CheckpointError: a missing model path or draft; InputError: a bad device, dtype or
            setting, or a block size too large.
    """
    from dflash.api import check_device_name, check_dtype_name
    from dflash.kernels.settings import KernelSettings
    from dflash.models.config import DraftConfig
    from dflash.models.target_torch import check_model_path, resolve_draft  # torch-free helpers

    check_device_name(device, backend)
    check_dtype_name(dtype)
    KernelSettings.resolve(kernels)  # torch-free

    if model is not None:
        check_model_path(model)
    folder = resolve_draft(draft, model)
    trained = DraftConfig.load(folder).block_size
    if width is not None and width > trained:
        raise InputError(f"--block-size {width} exceeds the draft's trained block size {trained}.",
                         hint=f"use --block-size {trained} or less, or auto")  # fmt: skip


def serve(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Target: hub id, folder or .gguf (default: demo SmolLM2-135M-Instruct).")] = None,
    draft: Annotated[str | None, typer.Option("--draft", "-d", help="DFlash draft: hub id or folder (default: the shipped demo draft).")] = None,
    backend: Annotated[str, typer.Option(help="Local backend: transformers or mlx.")] = "transformers",
    host: Annotated[str, typer.Option(help="Interface to bind; 0.0.0.0 exposes the server to the network.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (30000, as SGLang; the openai backend's default --base-url).")] = 30000,
    api_key: Annotated[str | None, typer.Option(help="Require 'Authorization: Bearer KEY' on /v1 (default: $DFLASH_API_KEY; none = open).", show_default=False)] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Model name in the API (default: the --model name).")] = None,
    block_size: Annotated[str | None, typer.Option(help="auto (default: chosen per step from measured costs and acceptance) or the verify width incl. the anchor; 1 = no drafting.")] = None,
    device: Annotated[str, typer.Option(help="auto, cuda, cuda:N or cpu (mlx: auto, gpu or cpu).")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16, float32.")] = "auto",
    cuda_graphs: Annotated[bool | None, typer.Option("--cuda-graphs/--no-cuda-graphs", help="Static caches + CUDA graphs (default: on for CUDA with Llama/Qwen-style targets).")] = None,
    kernels: Annotated[str, typer.Option(help="transformers: auto runs this project's Triton kernels in the CUDA graphs where they fit; off runs torch ops there (if a kernel fails on your GPU).")] = "auto",
    recalibrate: Annotated[bool, typer.Option("--recalibrate", help="Measure the --block-size auto step costs again at startup instead of reading them from the dflash cache.")] = False,
    warmup: Annotated[int, typer.Option(help="transformers, CUDA graphs: untimed warm-up tokens per block size at startup (0 = none).")] = WARMUP_DEFAULT,
    log_level: Annotated[str, typer.Option(help="uvicorn log level: warning, info (access log), debug.")] = "info",
    prefix_cache_mb: Annotated[int, typer.Option(help="Prefix cache size in MiB (target K/V rows and features of earlier requests, reused by one that starts alike; plain transformers path); 0 = off.")] = 2048,
    tool_call_parser: Annotated[str | None, typer.Option(help="Tool-call format: hermes, qwen3_coder, llama3_json, openai (gpt-oss), gemma4 (default: from the chat template).")] = None,
) -> None:  # fmt: skip
    """Serve a target/draft pair over an OpenAI-compatible HTTP API (one generation at a time)."""
    from dflash.backend_names import LOCAL_BACKENDS, one_of

    if backend not in LOCAL_BACKENDS:
        raise BackendError(f"dflash serve runs a local backend ({one_of(LOCAL_BACKENDS)}); got {backend!r}.",
                           hint="use " + " or ".join(f"--backend {b}" for b in LOCAL_BACKENDS))  # fmt: skip
    if not 0 < port < 65536:
        raise InputError(f"--port must be in 1..65535, got {port}.")
    from dflash.options import (
        check_recalibrate,
        check_warmup,
        parse_block_size,
        refuse_foreign_options,
    )

    refuse_foreign_options(backend, {"--kernels": kernels != "auto", "--warmup": warmup != WARMUP_DEFAULT},
                           {"--kernels": ("transformers",), "--warmup": ("transformers",)})  # fmt: skip
    chosen = parse_block_size(block_size)  # "auto" (also for None) or an int, as for generate
    width = None if chosen == "auto" else int(chosen)  # the Engine takes None for auto
    check_warmup(warmup)
    check_recalibrate(recalibrate, [chosen])
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise BackendError("dflash serve needs fastapi and uvicorn.",
                           hint='pip install "dflash[serve]"') from None  # fmt: skip
    from uvicorn.config import LOG_LEVELS

    if log_level.lower() not in LOG_LEVELS:
        raise InputError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}.",
                         hint="info (the default) logs each request; warning only problems")  # fmt: skip
    from dflash.serve.tools import ALIASES, PARSER_NAMES

    if tool_call_parser is not None and tool_call_parser not in ALIASES:
        raise InputError(f"Unknown --tool-call-parser {tool_call_parser!r}.",
                         hint="use one of " + ", ".join(PARSER_NAMES))  # fmt: skip
    _check_pair(model, draft, width, backend, device, dtype, kernels)  # before binding: fails at once
    _check_port_free(host, port)
    api_key = api_key or os.environ.get("DFLASH_API_KEY") or None
    names = [served_model_name or (DEMO_NAME if model is None else Path(model).name or model)]
    if model and model not in names:
        names.append(model)

    def load() -> Any:
        import dflash

        pipe = dflash.load(model, draft, backend=backend, device=device, dtype=dtype,
                           cuda_graphs=cuda_graphs, kernels=kernels)  # fmt: skip
        pipe.recalibrate = recalibrate  # read by the calibration at startup
        return pipe

    engine = Engine(load, names, width, warmup)
    engine.tool_parser_name = tool_call_parser
    if prefix_cache_mb < 0:
        raise InputError(f"--prefix-cache-mb must be >= 0, got {prefix_cache_mb}.", hint="0 turns it off")
    engine.prefix_cache_bytes = prefix_cache_mb * 2**20
    app = build_app(engine, api_key)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                           timeout_graceful_shutdown=5))  # fmt: skip
    engine.on_failure = lambda: setattr(server, "should_exit", True)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"dflash serve: warning: listening on {host} without --api-key", file=sys.stderr)
    print(f"dflash serve: loading {names[0]}; OpenAI API at http://{host}:{port}/v1 "
          f"(one generation at a time{', API key required' if api_key else ''})",
          file=sys.stderr, flush=True)  # fmt: skip
    server.run()
    if engine.error is not None:
        raise engine.error
