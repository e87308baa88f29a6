"""Client of OpenAI-compatible servers (SGLang, vLLM, mlx_lm.server, llama.cpp, ``dflash serve``).

Only httpx, httpx-sse and the standard library: the base install alone runs ``dflash generate openai``
and ``dflash benchmark openai`` without torch, transformers or mlx (brief §6, §7.5).

    root = api_root("http://127.0.0.1:30000")            # -> http://127.0.0.1:30000/v1
    body = chat_body("m", [{"role": "user", "content": "Hi"}], 64, SamplingParams())
    result = await chat_completion(client, root, body, on_delta=print)

Acceptance statistics come from whatever the server reports: SGLang's ``meta_info`` (per choice
when ``return_meta_info`` is set, else top level) and vLLM-style ``/metrics`` counters
(``vllm:spec_decode_*``), both of which ``dflash serve`` provides.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import EventSource, SSEError

from dflash.backends.openai_stats import extract_meta
from dflash.errors import InputError, ServerError
from dflash.types import SamplingParams

DEFAULT_BASE_URL = "http://127.0.0.1:30000"
RETRY_STATUSES = frozenset({429, 502, 503, 504})


# ---------------------------------------------------------------------------------------------
# URLs and request bodies


# paths a server answers under its base URL; a --base-url ending in one gets it twice
ENDPOINT_PATHS = ("chat/completions", "completions", "models", "embeddings", "responses",
                  "generate", "health", "metrics")  # fmt: skip


def api_root(base_url: str, flag: str = "--base-url") -> str:
    """The ``.../v1`` root of a server URL given with or without ``/v1`` (trailing ``/`` dropped).

    A URL ending in an endpoint path (``.../v1/chat/completions``, ``.../v1/models``) is refused,
    not trimmed: the client adds the endpoint itself, as openai-python's ``base_url`` does, and
    the error names the base URL to pass. ``flag`` names the option in errors.

    Raises:
        InputError: the URL is not http(s)://host[:port][/path], or ends in an endpoint path.
    """
    url = base_url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise InputError(
            f"{flag} {base_url!r} is not an http(s) URL.",
            hint=f"e.g. {flag} {_with_scheme(base_url)}",
        )
    path = url.split("://", 1)[1].partition("/")[2].lower()
    for endpoint in ENDPOINT_PATHS:
        if path == endpoint or path.endswith("/" + endpoint):
            base = url[: -len(endpoint) - 1]
            raise InputError(f"{flag} {url} ends in the endpoint path /{endpoint}, which dflash adds itself.",
                             hint=f"pass the server's base URL: {flag} {base}")  # fmt: skip
    return url if url.endswith("/v1") else url + "/v1"


def _with_scheme(url: str) -> str:
    """``url`` as an http URL: the host and port typed (``127.0.0.1:30222``, ``ftp://h:1``,
    ``//h:1``) after ``http://``; the default server's URL when no host was typed."""
    url = url.strip()
    rest = (url.split("://", 1)[1] if "://" in url else url).strip("/")
    return f"http://{rest}" if rest and " " not in rest else DEFAULT_BASE_URL


def server_root(base_url: str) -> str:
    """The server URL without ``/v1`` (where ``/metrics`` and ``/health`` live)."""
    return api_root(base_url)[: -len("/v1")]


def reasoning_template_kwargs(reasoning: str | None) -> dict[str, Any]:
    """``--reasoning`` for a remote server, sent as ``chat_template_kwargs`` (brief §6).

    on/off -> ``enable_thinking``; a level -> thinking on plus ``reasoning_effort`` and
    ``reasoning_strength`` (templates read the one they know; Jinja ignores the others).
    """
    if reasoning is None:
        return {}
    value = reasoning.strip().lower()
    if value in ("on", "off"):
        return {"enable_thinking": value == "on"}
    return {"enable_thinking": True, "reasoning_effort": reasoning, "reasoning_strength": reasoning}


def chat_body(
    model: str,
    messages: list[dict],
    max_tokens: int,
    sampling: SamplingParams,
    *,
    reasoning: str | None = None,
    stream: bool = True,
) -> dict[str, Any]:
    """JSON body of ``POST /v1/chat/completions`` (brief §7.5); top_k only when > 0."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "return_meta_info": True,
        "stream": stream,
    }
    if sampling.top_k > 0:
        body["top_k"] = sampling.top_k
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    kwargs = reasoning_template_kwargs(reasoning)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer`` when a key is given (the key is never logged or printed)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# ---------------------------------------------------------------------------------------------
# server-sent events


# ``httpx_sse.EventSource`` parses the stream (WHATWG rules: any chunking of the bytes, ``\r\n``
# or ``\r`` or ``\n`` line ends, comments and other fields ignored, multi-line data joined with
# ``\n``). As the standard says, an event is dispatched at the blank line that ends it: a stream
# cut before its last blank line loses that last event (every server sends it; ``[DONE]`` or a
# ``finish_reason`` seen before is enough for the reply to count as complete).


# ---------------------------------------------------------------------------------------------
# retries


@dataclass
class RetryPolicy:
    """Bounded retries for 429/502/503/504 with exponential backoff and ``Retry-After``.

    Attributes:
        max_retries: retries after the first attempt (0 = none).
        backoff_s: first backoff, seconds; doubles per retry, with 50-100 % jitter.
        max_backoff_s: cap of the computed backoff, seconds.
        max_retry_after_s: cap of a server's ``Retry-After``, seconds.
    """

    max_retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    max_retry_after_s: float = 60.0

    def delay(self, retry: int, headers: httpx.Headers | dict | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (0-based); Retry-After wins when given."""
        value = (headers or {}).get("retry-after")
        if value is not None:
            seconds = _retry_after_seconds(value)
            if seconds is not None:
                return min(max(seconds, 0.0), self.max_retry_after_s)
        base = min(self.backoff_s * 2**retry, self.max_backoff_s)
        return base * random.uniform(0.5, 1.0)


def _retry_after_seconds(value: str) -> float | None:
    """``Retry-After`` as seconds: a number, or an HTTP date (RFC 9110 §10.2.3)."""
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return when.timestamp() - time.time()


# ---------------------------------------------------------------------------------------------
# one chat completion


@dataclass
class ChatResult:
    """Outcome of one request, successful or not.

    Attributes:
        ok: the server answered and the reply was read to the end.
        text, reasoning: answer text and reasoning text (``reasoning_content`` or ``reasoning``).
        finish_reason: the server's finish reason ("stop", "length", ...), None when unknown.
        prompt_tokens, completion_tokens: from ``usage``; None when the server did not say.
        chunks: content/reasoning deltas received (an estimate of tokens without usage).
        ttft_s: seconds from sending to the first delta of any kind (reasoning included);
            None for non-streamed requests.
        e2e_s: seconds from sending (the successful attempt) to the end of the reply.
        meta: the SGLang-style ``meta_info`` (per choice, else top level), None when absent.
        error: one-line reason when not ok; error_kind "http", "timeout", "connect", "server"
            (an error event in the stream) or "protocol" (a reply that cannot be read).
        status: last HTTP status seen (None without a response).
        attempts: requests sent (1 + retries).
    """

    ok: bool = False
    text: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    chunks: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    meta: dict[str, Any] | None = None
    error: str | None = None
    error_kind: str | None = None
    status: int | None = None
    attempts: int = 0
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        """Completion tokens: the server's usage, else the number of deltas."""
        return self.completion_tokens if self.completion_tokens is not None else self.chunks


DeltaCallback = Callable[[str, str], None]  # (kind "content" | "reasoning", text)


async def chat_completion(
    client: httpx.AsyncClient,
    root: str,
    body: dict[str, Any],
    *,
    api_key: str | None = None,
    retry: RetryPolicy | None = None,
    on_delta: DeltaCallback | None = None,
    path: str = "/chat/completions",
) -> ChatResult:
    """Send one (streamed or not, per ``body["stream"]``) completion request; never raises for
    server or network trouble: the reason is in the result.

    Args:
        client: an httpx.AsyncClient (its timeout applies to connect and to each read).
        root: the ``.../v1`` URL (see :func:`api_root`).
        body: request JSON (see :func:`chat_body`).
        on_delta: called with each content/reasoning delta as it arrives.
        path: ``/chat/completions`` or ``/completions``.
    """
    retry = retry or RetryPolicy()
    result = ChatResult()
    headers = auth_headers(api_key)
    for attempt in range(retry.max_retries + 1):
        result = ChatResult(attempts=attempt + 1)
        t0 = time.perf_counter()
        try:
            async with client.stream("POST", root + path, json=body, headers=headers) as resp:
                result.status = resp.status_code
                if resp.status_code >= 400:
                    raw = await resp.aread()
                    result.error_kind = "http"
                    result.error = f"HTTP {resp.status_code}: {_error_message(raw)}"
                    if resp.status_code in RETRY_STATUSES and attempt < retry.max_retries:
                        await asyncio.sleep(retry.delay(attempt, resp.headers))
                        continue
                    if resp.status_code in RETRY_STATUSES and attempt > 0:
                        result.error += f" (gave up after {attempt + 1} attempts)"
                    return result
                streamed = "json" not in resp.headers.get("content-type", "")
                if body.get("stream") and streamed:
                    await _read_stream(resp, result, t0, on_delta)
                else:
                    _read_whole(json.loads(await resp.aread()), result, on_delta)
        except httpx.TimeoutException:
            result.error_kind, result.error = "timeout", "timed out waiting for the server"
            return result
        except httpx.TransportError as err:
            kind = "connect" if isinstance(err, httpx.ConnectError) else "protocol"
            result.error_kind = kind
            result.error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            return result
        except ServerError as err:
            result.error_kind, result.error = "server", str(err)
            return result
        except (
            json.JSONDecodeError,
            UnicodeDecodeError,
            TypeError,
            KeyError,
            AttributeError,
        ) as err:
            result.error_kind, result.error = "protocol", f"unreadable reply: {str(err)[:200]}"
            return result
        result.e2e_s = time.perf_counter() - t0
        result.ok = True
        return result
    return result


async def _read_stream(resp: httpx.Response, result: ChatResult, t0: float,
                       on_delta: DeltaCallback | None) -> None:  # fmt: skip
    """Apply the SSE events of a streamed reply until ``[DONE]``.

    Raises:
        ServerError: the reply is not an event stream, reports an error, or ends before
            ``[DONE]`` without a ``finish_reason``.
    """
    done = False
    try:
        async for event in EventSource(resp).aiter_sse():
            if _handle_event(event.data, result, t0, on_delta):
                done = True
                break
    except SSEError as err:  # a content type other than text/event-stream
        raise ServerError(f"the streamed reply is not an event stream ({err})") from None
    if not done and result.finish_reason is None:
        raise ServerError("the stream ended before [DONE]")


def _handle_event(payload: str, result: ChatResult, t0: float,
                  on_delta: DeltaCallback | None) -> bool:  # fmt: skip
    """Apply one SSE data payload; True at ``[DONE]``."""
    if payload.strip() == "[DONE]":
        return True
    obj = json.loads(payload)
    if isinstance(obj, dict) and obj.get("error"):
        raise ServerError("error in stream: " + _error_message(json.dumps(obj).encode()))
    _take_usage_and_meta(obj, result)
    for choice in obj.get("choices") or []:
        if choice.get("index", 0) != 0:
            continue
        delta = choice.get("delta")
        if delta is None:  # /v1/completions streams "text"
            delta = {"content": choice.get("text")}
        for kind, text in (("reasoning", delta.get("reasoning_content") or delta.get("reasoning")),
                           ("content", delta.get("content"))):  # fmt: skip
            if text:
                if result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - t0
                result.chunks += 1
                if kind == "content":
                    result.text += text
                else:
                    result.reasoning += text
                if on_delta:
                    on_delta(kind, text)
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    return False


def _read_whole(obj: Any, result: ChatResult, on_delta: DeltaCallback | None) -> None:
    if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list) or not obj["choices"]:
        raise ServerError("the reply has no choices")
    _take_usage_and_meta(obj, result)
    choice = obj["choices"][0]
    message = choice.get("message") or {"content": choice.get("text")}
    result.reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    result.text = message.get("content") or ""
    result.finish_reason = choice.get("finish_reason")
    result.chunks = 1 if result.text or result.reasoning else 0
    for kind, text in (("reasoning", result.reasoning), ("content", result.text)):
        if text and on_delta:
            on_delta(kind, text)


def _take_usage_and_meta(obj: dict, result: ChatResult) -> None:
    usage = obj.get("usage")
    if isinstance(usage, dict):
        result.usage = usage
        if isinstance(usage.get("completion_tokens"), int):
            result.completion_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            result.prompt_tokens = usage["prompt_tokens"]
    meta = extract_meta(obj)
    if meta is not None:
        result.meta = meta


def _error_message(raw: bytes) -> str:
    """The ``error.message`` of an OpenAI error body (or FastAPI ``detail``, or the text)."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return text[:200] or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
        for key in ("message", "detail", "error"):
            if obj.get(key):
                return str(obj[key])[:300]
    return text[:200]


def chat_error_hint(status: int | None, error: str, *, one_prompt: bool = True) -> str | None:
    """The hint for a chat request a server refused with HTTP ``status`` and message ``error``.

    401: the API key; 404: --base-url and --model; 400 or 422 (an invalid request): for the
    prompt plus --max-new-tokens past the model's context (the message names the context, as
    vLLM's, SGLang's, llama.cpp's and dflash serve's do), lower --max-new-tokens (or shorten the
    prompt, when ``one_prompt``: ``dflash generate``; a benchmark's prompts are the dataset's), else
    check the options sent.
    """
    if status == 401:
        return "pass --api-key or set OPENAI_API_KEY"
    if status == 404:  # a path the server does not serve, or a model it does not know
        return (
            "check --base-url (the server's base URL, e.g. http://127.0.0.1:30000/v1) and --model"
        )
    if status in (400, 422):
        if "context" in error.lower():
            if one_prompt:
                return (
                    "lower --max-new-tokens or shorten the prompt: the prompt and the new tokens must fit in "
                    "the model's context together"
                )
            return "lower --max-new-tokens: each prompt and its new tokens must fit in the model's context together"
        return ("the server refused the request as invalid: check the options sent with it "
                "(--model, --max-new-tokens, --temperature, --top-p, --top-k, --reasoning)")  # fmt: skip
    return None


# ---------------------------------------------------------------------------------------------
# models and /metrics


async def first_model(client: httpx.AsyncClient, root: str, api_key: str | None,
                      flag: str = "--base-url") -> str:  # fmt: skip
    """The id of the first model of ``GET /v1/models``; ``flag`` names the option that gave
    ``root`` in errors (``--baseline-url`` for a benchmark's baseline server).

    Raises:
        ServerError: the server cannot be reached, refuses, or lists no model.
    """
    try:
        resp = await client.get(root + "/models", headers=auth_headers(api_key))
    except httpx.TimeoutException:
        raise ServerError(
            f"{root}/models timed out.", hint=f"check {flag} and --timeout-s"
        ) from None
    except httpx.TransportError as err:
        raise ServerError(f"Cannot reach the server at {root} ({type(err).__name__}).",
                          hint=f"start the server (dflash serve and SGLang listen on port 30000 by default, vLLM on 8000) or fix {flag}") from None  # fmt: skip
    if resp.status_code >= 400:
        hint = "pass --api-key or set OPENAI_API_KEY" if resp.status_code == 401 else None
        if resp.status_code == 404:
            hint = f"check {flag}: the server's base URL, e.g. http://127.0.0.1:30000/v1"
        raise ServerError(f"{root}/models answered HTTP {resp.status_code}: "
                          f"{_error_message(resp.content)}", hint=hint)  # fmt: skip
    try:
        data = resp.json()["data"]
        return str(data[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerError(f"{root}/models lists no model.", hint="pass --model NAME") from None


async def scrape_metrics(client: httpx.AsyncClient, base_url: str) -> str | None:
    """Text of ``GET /metrics`` (Prometheus format), None when the server has none."""
    try:
        resp = await client.get(server_root(base_url) + "/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200 or "json" in resp.headers.get("content-type", ""):
        return None
    return resp.text
