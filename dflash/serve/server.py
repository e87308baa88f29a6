"""The HTTP routes of ``dflash serve`` (FastAPI): an OpenAI-compatible API around an
:class:`~dflash.serve.engine.Engine` (the command that starts it: :mod:`dflash.serve.command`).

Endpoints: ``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/responses`` (streamed
over SSE or not; tool calls: :mod:`dflash.serve.tools`; Responses: :mod:`dflash.serve.responses`),
``GET /v1/models`` and ``/v1/models/{id}``, vLLM's ``POST /tokenize``, ``/detokenize`` and
``GET /tokenizer_info`` (:mod:`dflash.serve.tokens`), ``/health`` (503 while the model loads)
and ``/metrics`` (Prometheus text from prometheus_client: :mod:`dflash.serve.metrics`).
``"return_meta_info": true`` adds SGLang-style per-choice ``meta_info`` (τ, verify steps,
histogram, and each step's τ and proposals: :func:`dflash.serve.protocol.meta_info`).

FastAPI is imported only when the app is built (``pip install -e ".[serve]"``).
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route functions' annotations
# (``Request``) at runtime, and those are local to build_app.
import hmac
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from dflash.serve.chat import full_reply, stream_reply
from dflash.serve.engine import Engine
from dflash.serve.protocol import ApiError, completion_id, parse_request
from dflash.serve.tools import check_tools, history_message

MAX_BODY_BYTES = 4 * 2**20  # the largest request body taken (413 above)


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

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Any:
        from dflash.serve.tokens import tokenizer_info

        check_key(request)
        engine.check_ready()
        return tokenizer_info(engine)

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
        text = engine.metrics.render()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app
