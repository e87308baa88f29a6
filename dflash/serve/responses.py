"""OpenAI's Responses API on ``dflash serve``: ``POST /v1/responses``, streamed (the SDK's
event types) or not, for text and function calls.

A request is turned into the equivalent chat request (``instructions`` -> a system message,
``input`` items -> messages: ``function_call`` items -> an assistant message's ``tool_calls``,
``function_call_output`` items -> ``tool`` messages; ``tools`` in the Responses layout ->
chat tools; ``max_output_tokens`` -> ``max_tokens``; ``text.format`` -> ``response_format``)
and generated as one chat choice. Nothing is stored: ``previous_response_id`` and
``store: true`` are refused with 400 (send the whole conversation in ``input``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from dflash.serve.protocol import ApiError

_KEEP = ("model", "temperature", "top_p", "top_k", "seed", "stream", "stop", "user",
         "parallel_tool_calls", "tool_choice", "ignore_eos", "return_meta_info",
         "stop_token_ids", "chat_template_kwargs", "skip_special_tokens", "top_logprobs")  # fmt: skip


def _new_id(prefix: str) -> str:
    return prefix + "_" + uuid.uuid4().hex[:24]


def _text(content: Any, where: str) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):  # fmt: skip
                raise ApiError(400, f"{where}: only input_text/output_text content parts are "
                               "supported.", param="input")  # fmt: skip
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(
        400, f"{where}: 'content' must be a string or a list of text parts.", param="input"
    )


def to_chat(body: Any) -> dict[str, Any]:
    """The chat-completions body equivalent to a Responses request body.

    Raises:
        ApiError: 400 for stored state (``previous_response_id``, ``store: true``,
            ``background``), a malformed ``input`` item or an unsupported one.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", param="body")
    if body.get("previous_response_id") is not None:
        raise ApiError(400, "'previous_response_id' is not supported: dflash serve stores no "
                       "responses; send the whole conversation in 'input'.",
                       param="previous_response_id")  # fmt: skip
    if body.get("store") is True:
        raise ApiError(400, "'store': true is not supported: dflash serve stores no responses; "
                       "send \"store\": false or leave it out.", param="store")  # fmt: skip
    for key in ("background", "conversation", "prompt"):
        if body.get(key) not in (None, False):
            raise ApiError(400, f"'{key}' is not supported by dflash serve.", param=key)
    messages: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        messages.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "'input' must be a non-empty string or a list of input items.",
                       param="input")  # fmt: skip
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if item.get("role") not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where} needs a role among assistant, developer, system, user.",
                               param="input")  # fmt: skip
            messages.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})  # fmt: skip
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the template again
        else:
            raise ApiError(400, f"{where}: input items of type {kind!r} are not supported.",
                           param="input")  # fmt: skip
    chat: dict[str, Any] = {k: body[k] for k in _KEEP if k in body}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        tools = body["tools"]
        if not isinstance(tools, list):
            raise ApiError(400, "'tools' must be a list of function tools.", param="tools")
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else type(t).__name__
                raise ApiError(400, f"tools[{i}]: only function tools are supported (got {kind!r}).",
                               param="tools")  # fmt: skip
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in
                          ("name", "description", "parameters", "strict") if k in t}}
                         for t in tools]  # fmt: skip
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(body.get("reasoning"), dict) and body["reasoning"].get("effort") is not None:
        chat["reasoning_effort"] = body["reasoning"]["effort"]
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}  # fmt: skip
    elif isinstance(fmt, dict) and fmt.get("type") in ("json_object", "text"):
        chat["response_format"] = {"type": fmt["type"]}
    return chat


class ResponseState:
    """Builds the Responses output (items, SSE events) from a chat :class:`~.chat.Output`'s
    events."""

    def __init__(self, body: dict, model: str, req: Any):
        self.id, self.created, self.model, self.body, self.req = (
            _new_id("resp"),
            int(time.time()),
            model,
            body,
            req,
        )
        self.items: list[dict[str, Any]] = []
        self.text_item: dict[str, Any] | None = None
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> str:
        """One SSE event (``event:`` line and JSON data with ``type`` and ``sequence_number``)."""
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def response(self, status: str, out: Any = None, prompt_tokens: int = 0,
                 cached: int = 0) -> dict[str, Any]:  # fmt: skip
        """The ``response`` object (status ``in_progress``, ``completed`` or ``incomplete``)."""
        body, use = self.body, None
        if out is not None:
            use = {"input_tokens": prompt_tokens, "output_tokens": out.tokens,
                   "total_tokens": prompt_tokens + out.tokens,
                   "input_tokens_details": {"cached_tokens": cached},
                   "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": incomplete, "model": self.model,
                "instructions": body.get("instructions"), "output": self.items,
                "max_output_tokens": body.get("max_output_tokens"),
                "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "previous_response_id": None, "store": False, "metadata": body.get("metadata") or {},
                "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
                "text": body.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
                "usage": use}  # fmt: skip

    def add(self, events: list) -> list[str]:
        """Take one step's events; return the SSE events they make."""
        sse: list[str] = []
        for kind, value in events:
            if kind == "content" and value:
                if self.text_item is None:
                    self.text_item = {"type": "message", "id": _new_id("msg"), "status": "in_progress",
                                      "role": "assistant", "content": []}  # fmt: skip
                    self.items.append(self.text_item)
                    index = len(self.items) - 1
                    sse.append(self.event("response.output_item.added", output_index=index,
                                          item={**self.text_item, "content": []}))  # fmt: skip
                    part = {"type": "output_text", "text": "", "annotations": []}
                    self.text_item["content"].append(part)
                    sse.append(self.event("response.content_part.added", item_id=self.text_item["id"],
                                          output_index=index, content_index=0, part=dict(part)))  # fmt: skip
                self.text_item["content"][0]["text"] += value
                sse.append(self.event("response.output_text.delta", item_id=self.text_item["id"],
                                      output_index=self.items.index(self.text_item),
                                      content_index=0, delta=value, logprobs=[]))  # fmt: skip
            elif kind == "call":
                sse += self._close_text()
                item = {"type": "function_call", "id": _new_id("fc"), "call_id": value.id,
                        "name": value.name, "arguments": value.arguments, "status": "completed"}  # fmt: skip
                self.items.append(item)
                index = len(self.items) - 1
                sse.append(self.event("response.output_item.added", output_index=index,
                                      item={**item, "arguments": "", "status": "in_progress"}))  # fmt: skip
                sse.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=value.arguments))  # fmt: skip
                sse.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=value.name, arguments=value.arguments))  # fmt: skip
                sse.append(self.event("response.output_item.done", output_index=index, item=item))
        return sse

    def _close_text(self) -> list[str]:
        item, self.text_item = self.text_item, None
        if item is None:
            return []
        index, text = self.items.index(item), item["content"][0]["text"]
        item["status"] = "completed"
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                           content_index=0, text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index,
                           content_index=0, part=item["content"][0]),
                self.event("response.output_item.done", output_index=index, item=item)]  # fmt: skip

    def finish(
        self, out: Any, prompt_tokens: int, cached: int = 0
    ) -> tuple[list[str], dict[str, Any]]:
        """The closing SSE events and the final response object."""
        sse = self._close_text()
        status = "incomplete" if out.finish == "length" else "completed"
        final = self.response(status, out, prompt_tokens, cached)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return sse + [self.event(kind, response=final)], final


async def respond(engine: Any, body: dict, request: Any) -> Any:
    """Answer ``POST /v1/responses``: the response object, or an async iterator of SSE text."""
    from dflash.serve.chat import run_job
    from dflash.serve.protocol import parse_request
    from dflash.serve.tools import check_tools, history_message

    chat = to_chat(body)
    req = parse_request(chat, chat=True)
    req.tools = check_tools(chat)
    for i, m in enumerate(req.messages):
        m.update(history_message(m, f"input[{i}]"))
    engine.prepare(req, chat)
    jobs, outs = await engine.jobs(req)
    job, out = jobs[0], outs[0]
    state = ResponseState(body, engine.names[0], req)
    if not req.stream:
        try:
            async for events in run_job(engine, job, req, out, request):
                state.add(events)
        finally:
            engine.metrics.request_done(out.finish or "abort")
        return state.finish(out, len(job.ids), job.info.get("cached_tokens", 0))[1]

    async def stream() -> AsyncIterator[str]:
        try:
            yield state.event("response.created", response=state.response("in_progress"))
            yield state.event("response.in_progress", response=state.response("in_progress"))
            try:
                async for events in run_job(engine, job, req, out):
                    for text in state.add(events):
                        yield text
            except Exception as err:  # noqa: BLE001 - headers are sent: report in the stream
                yield state.event("error", code="server_error", param=None,
                                  message=f"Generation failed: {type(err).__name__}: {err}")  # fmt: skip
                return
            for text in state.finish(out, len(job.ids), job.info.get("cached_tokens", 0))[0]:
                yield text
        finally:
            engine.metrics.request_done(out.finish or "abort")

    return stream()
