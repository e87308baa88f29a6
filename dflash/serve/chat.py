"""The replies of ``/v1/chat/completions`` and ``/v1/completions``: one :class:`Output` per
choice turns committed tokens into text (stop strings, tool calls, log-probabilities); choices
(``n`` per prompt, several prompts) are generated one after another and answered in order,
streamed over SSE or as one JSON object.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from dflash.serve.protocol import ApiError, GenRequest, StopMatcher, chunk, meta_info, usage
from dflash.serve.tools import ToolCall, ToolParser


class Output:
    """One choice's text: committed tokens -> text safe to send (stop strings applied), then the
    tool-call parser if any; keeps the statistics and the log-probabilities of counted tokens.

    Args:
        tokenizer: the target's tokenizer (``decode``).
        req: the request (stop strings, special tokens, logprobs).
        parser: a fresh tool-call parser for this reply, or None.
        hidden: token ids kept out of the text when the parser reads special tokens (the
            end-of-sequence ids, which would otherwise show as text).
    """

    def __init__(self, tokenizer: Any, req: GenRequest, parser: ToolParser | None = None,
                 hidden: list[int] | tuple[int, ...] = ()):  # fmt: skip
        from dflash.api import TextStream

        special = parser is not None and parser.special_tokens
        self.tokenizer = tokenizer
        self.text = TextStream(
            tokenizer, skip_special_tokens=req.skip_special_tokens and not special
        )
        self.hidden = set(hidden) if special else set()
        self.stop = StopMatcher(req.stop, include=req.include_stop_str)
        self.parser = parser
        self.want_logprobs = req.logprobs is not None
        self.tokens = 0
        self.accepted: list[int] = []
        self.proposed: list[int] = []
        self.calls: list[ToolCall] = []
        self.finish: str | None = None

    def _text(self, ids: list[int], final: bool) -> str:
        return self.text.feed([i for i in ids if i not in self.hidden], final=final)

    def add(self, step: Any) -> list[tuple[str, Any]]:
        """Events of one verify step: ("logprobs", [TokenLogprob]) for the tokens it counts,
        ("content", text) and ("call", ToolCall). With stop strings the tokens are fed one at a
        time, so that ``tokens`` (the usage's completion_tokens) ends at the token that
        completed the stop string, as vLLM counts, not at the end of the step."""
        if step.accepted is not None:
            self.accepted.append(step.accepted)
            self.proposed.append(step.proposed)
        final = step.finish_reason is not None
        ids = list(step.tokens)
        if not self.stop.stops or not ids:
            counted = len(ids)
            out, hit = self.stop.feed(self._text(ids, final), final=final)
        else:
            out, hit, counted = "", False, 0
            for i, token in enumerate(ids):
                last = final and i == len(ids) - 1
                piece, hit = self.stop.feed(self._text([token], last), final=last)
                out, counted = out + piece, counted + 1
                if hit:
                    break
        self.tokens += counted
        self.finish = "stop" if hit else step.finish_reason
        events: list[tuple[str, Any]] = []
        if self.want_logprobs and step.logprobs:
            events.append(("logprobs", list(step.logprobs[:counted])))
        if self.parser is None:
            events += [("content", out)] if out else []
        else:
            events += self._parsed(self.parser.feed(out) if out else [])
        return events

    def close(self, finish: str) -> list[tuple[str, Any]]:
        """The parser's last events; ``finish`` becomes "tool_calls" when the reply ended
        on its own (not at the budget) with calls in it."""
        events = self._parsed(self.parser.finish()) if self.parser is not None else []
        self.finish = "tool_calls" if self.calls and finish == "stop" else finish
        return events

    def _parsed(self, events: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        self.calls += [v for k, v in events if k == "call"]
        return events

    def token_text(self, token: int) -> str:
        """A token's own text (as vLLM reports it in log-probabilities)."""
        return self.tokenizer.decode([token], skip_special_tokens=False)


@dataclass
class Job:
    """One choice to generate: its index in the reply, prompt ids and (completions) the echoed
    prompt text with its log-probabilities."""

    index: int
    ids: list[int]
    sampling: Any
    echo_text: str = ""
    echo_logprobs: list | None = None
    prompt_first: int | None = None  # the first prompt token (no log-probability) when echoed
    info: dict = field(default_factory=dict)  # the engine's state of the job (cached_tokens)


def chat_logprobs(out: Output, entries: list) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def one(token: int, lp: float) -> dict[str, Any]:
        text = out.token_text(token)
        return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(i, v) for i, v in e.top]}
                        for e in entries]}  # fmt: skip


def completion_logprobs(
    out: Output, entries: list, first: int | None, offset: int
) -> dict[str, Any]:
    """OpenAI completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset);
    ``first``: an echoed prompt's first token (log-probability null); ``offset``: characters
    before the first entry."""
    tokens, lps, tops, offsets = [], [], [], []
    rows = ([(first, None, None)] if first is not None else []) + [
        (e.token, e.logprob, e.top) for e in entries
    ]
    for token, lp, top in rows:
        text = out.token_text(token)
        tokens.append(text)
        lps.append(None if lp is None else _finite(lp))
        tops.append(None if top is None else {out.token_text(i): _finite(v) for i, v in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _finite(x: float) -> float:
    return x if x > -1e30 else -9999.0  # JSON has no -inf; vLLM also reports -9999.0


async def run_job(engine: Any, job: Job, req: GenRequest, out: Output,
                  request: Any = None) -> AsyncIterator[list[tuple[str, Any]]]:  # fmt: skip
    """The events of one choice, step by step, then the parser's last ones (``out.finish`` set:
    stop, length, tool_calls or abort)."""
    if req.max_tokens == 0:  # echo only (lm-eval's loglikelihood sends max_tokens 0 or 1)
        yield out.close("length")
        return
    finish = "abort"
    async with aclosing(engine.steps(job.ids, req, request, sampling=job.sampling,
                                     info=job.info)) as steps:  # fmt: skip
        async for step in steps:
            events = out.add(step)
            if events:
                yield events
            if out.finish:
                break
    if out.finish:
        finish = out.finish
    elif request is None or not await request.is_disconnected():
        finish = "length"
    yield out.close(finish)


def _usage(jobs: list[Job], outs: list[Output], req: GenRequest) -> dict[str, Any]:
    """The reply's usage: each prompt counted once (not per choice), with OpenAI's
    ``prompt_tokens_details.cached_tokens`` (prompt tokens the prefix cache supplied)."""
    first = jobs[:: req.n]
    use: dict[str, Any] = usage(sum(len(j.ids) for j in first), sum(o.tokens for o in outs))
    use["prompt_tokens_details"] = {
        "cached_tokens": sum(j.info.get("cached_tokens", 0) for j in first)
    }
    return use


def _content(events: list) -> str:
    return "".join(v for k, v in events if k == "content")


def _lps(events: list) -> list:
    return [e for k, v in events if k == "logprobs" for e in v]


async def full_reply(engine: Any, jobs: list[Job], req: GenRequest, outs: list[Output],
                     request: Any, head: dict, t0: float) -> dict[str, Any]:  # fmt: skip
    """A non-streamed ``chat.completion`` / ``text_completion`` with every choice."""
    choices = []
    for job, out in zip(jobs, outs, strict=True):
        events: list = []
        try:
            async for part in run_job(engine, job, req, out, request):
                events += part
        finally:
            engine.metrics.request_done(out.finish or "abort")
        choices.append(_choice(engine, job, req, out, events, t0))
    use = _usage(jobs, outs, req)
    return {**head, "object": "chat.completion" if req.chat else "text_completion",
            "choices": choices, "usage": use}  # fmt: skip


def _choice(engine: Any, job: Job, req: GenRequest, out: Output, events: list,
            t0: float) -> dict[str, Any]:  # fmt: skip
    text, lps = _content(events), _lps(events)
    if req.chat:
        calls = [v.openai() for k, v in events if k == "call"]
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        choice: dict[str, Any] = {"index": job.index, "message": message,
                                  "logprobs": chat_logprobs(out, lps) if out.want_logprobs else None,
                                  "finish_reason": out.finish}  # fmt: skip
    else:
        logprobs = None
        if out.want_logprobs:
            logprobs = completion_logprobs(
                out, (job.echo_logprobs or []) + lps, job.prompt_first, 0
            )
        choice = {"index": job.index, "text": job.echo_text + text, "finish_reason": out.finish,
                  "logprobs": logprobs}  # fmt: skip
    if req.return_meta_info:
        choice["meta_info"] = _meta(engine, job, out, t0)
    return choice


def _meta(engine: Any, job: Job, out: Output, t0: float) -> dict[str, Any]:
    meta = meta_info(out.accepted, out.proposed, engine.block_size, len(job.ids), out.tokens,
                     time.perf_counter() - t0)  # fmt: skip
    return {**meta, **engine.choice_meta(job)}


async def stream_reply(engine: Any, jobs: list[Job], req: GenRequest, outs: list[Output],
                       head: dict, t0: float) -> AsyncIterator[str]:  # fmt: skip
    """SSE events of a streamed reply: per choice a role chunk (chat), text / tool-call chunks
    and a final chunk; then the usage (``include_usage``) and ``[DONE]``."""
    obj = "chat.completion.chunk" if req.chat else "text_completion"

    def sse(x: dict) -> str:
        return f"data: {json.dumps(x, ensure_ascii=False)}\n\n"

    def part(job: Job, text: str | None, finish: str | None = None, **kw: Any) -> dict:
        c = chunk(head["id"], req.chat, head["model"], head["created"], text, finish, **kw)
        c["choices"][0]["index"] = job.index
        if req.include_usage or req.continuous_usage:
            c["usage"] = _usage(jobs, outs, req) if req.continuous_usage else None
        return c

    for job, out in zip(jobs, outs, strict=True):
        offset = 0
        try:
            if req.chat:  # the role delta; completions start with text, as OpenAI's and vLLM's
                yield sse(part(job, "", role=True))
            elif job.echo_text or job.echo_logprobs:
                c = part(job, job.echo_text)
                if out.want_logprobs:
                    c["choices"][0]["logprobs"] = completion_logprobs(out, job.echo_logprobs or [],
                                                                      job.prompt_first, 0)  # fmt: skip
                offset = len(job.echo_text)
                yield sse(c)
            index = 0
            try:
                async for events in run_job(engine, job, req, out):
                    text, lps = _content(events), _lps(events)
                    calls = [v for k, v in events if k == "call"]
                    if not (text or lps or calls):
                        continue
                    c = part(job, text)
                    if calls:
                        delta = c["choices"][0]["delta"]
                        delta["tool_calls"] = [
                            call.openai(index + i) for i, call in enumerate(calls)
                        ]
                        index += len(calls)
                        if not text:
                            delta.pop("content", None)
                    if lps and req.chat:
                        c["choices"][0]["logprobs"] = chat_logprobs(out, lps)
                    elif lps:
                        c["choices"][0]["logprobs"] = completion_logprobs(out, lps, None, offset)
                    offset += len(text)
                    yield sse(c)
            except Exception as err:  # noqa: BLE001 - headers are sent: report in the stream
                yield sse(ApiError(500, f"Generation failed: {type(err).__name__}: {err}").body())
                yield "data: [DONE]\n\n"
                return
            meta = _meta(engine, job, out, t0) if req.return_meta_info else None
            yield sse(part(job, None, out.finish, meta=meta))
        finally:
            engine.metrics.request_done(out.finish or "abort")
    if req.include_usage:
        yield sse({"id": head["id"], "object": obj, "created": head["created"],
                   "model": head["model"], "choices": [],
                   "usage": _usage(jobs, outs, req)})  # fmt: skip
    yield "data: [DONE]\n\n"
