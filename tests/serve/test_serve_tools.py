"""Tool calls through ``dflash serve`` with the official ``openai`` package: a scripted target
emits a call in each supported format; the reply carries it as ``tool_calls`` (streamed and
not); a ``tool`` message then reaches the template and the target answers. Plus the parsers on
their own: byte-split streaming, malformed calls kept as plain content."""

from __future__ import annotations

import json

import pytest

from dflash.backends.openai_stats import parse_prometheus
from tests.helpers.serve_scripted import ANSWER, ARGS, FORMATS, ScriptedPipe, client_for

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}]  # fmt: skip
CONTENT = {"hermes": "Let me check.\n"}


def scripted(fmt: str) -> ScriptedPipe:
    template, call = FORMATS[fmt]
    return ScriptedPipe(lambda msgs: ANSWER if msgs[-1]["role"] == "tool" else call, template)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip_with_the_openai_package(fmt, stream):
    pipe = scripted(fmt)
    http = client_for(pipe)
    try:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        kw = {"model": "scripted", "messages": messages, "tools": TOOLS, "temperature": 0}
        if stream:
            calls: dict[int, dict] = {}
            content, finish = "", None
            for c in client.chat.completions.create(**kw, stream=True):
                delta = c.choices[0].delta
                content += delta.content or ""
                for tc in delta.tool_calls or []:
                    entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                    entry["name"] += tc.function.name or ""
                    entry["arguments"] += tc.function.arguments or ""
                finish = c.choices[0].finish_reason or finish
            got = [
                (v["id"], v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())
            ]
        else:
            reply = client.chat.completions.create(**kw)
            msg, finish = reply.choices[0].message, reply.choices[0].finish_reason
            content = msg.content or ""
            got = [
                (t.id, t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls
            ]
        assert [(name, args) for _, name, args in got] == [("get_weather", ARGS)]
        assert content == CONTENT.get(fmt, "") and finish == "tool_calls"
        assert pipe.tokenizer.rendered[-1]["tools"] == TOOLS  # the template saw the tools
        call_id = got[0][0]
        history = messages + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "22 C"}]  # fmt: skip
        final = client.chat.completions.create(**{**kw, "messages": history})
        assert (
            final.choices[0].message.content == ANSWER and not final.choices[0].message.tool_calls
        )
        assert final.choices[0].finish_reason == "stop"
        seen = pipe.tokenizer.rendered[-1]["messages"]
        assert seen[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ARGS}
        assert seen[2] == {"role": "tool", "content": "22 C", "tool_call_id": call_id}
    finally:
        http.__exit__(None, None, None)


def test_tool_choice_none_malformed_calls_and_unknown_formats():
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par</tool_call> done'
    pipe = ScriptedPipe(lambda msgs: bad, FORMATS["hermes"][0])
    http = client_for(pipe)
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
        r = http.post("/v1/chat/completions", json=body).json()
        assert r["choices"][0]["message"] == {"role": "assistant", "content": bad}  # as it came
        assert r["choices"][0]["finish_reason"] == "stop"
        good = FORMATS["hermes"][1]
        pipe.reply = lambda msgs: good
        r = http.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).json()
        assert r["choices"][0]["message"]["content"] == good  # not parsed
        assert pipe.tokenizer.rendered[-1]["tools"] == TOOLS  # still shown to the template
        for extra, param in (({"tool_choice": "maybe"}, "tool_choice"),
                             ({"tools": [{"type": "function"}]}, "tools"),
                             ({"tool_choice": {"type": "function", "function": {"name": "x"}}},
                              "tool_choice")):  # fmt: skip
            r = http.post("/v1/chat/completions", json={**body, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        bad_history = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                       "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]}  # fmt: skip
        r = http.post("/v1/chat/completions", json=bad_history)
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    finally:
        http.__exit__(None, None, None)
    plain = client_for(ScriptedPipe(lambda msgs: "hello", "{{ messages }}"))
    try:
        r = plain.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
        r = plain.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello"
    finally:
        plain.__exit__(None, None, None)
    named = client_for(ScriptedPipe(lambda msgs: good, "{{ messages }}"), tool_parser_name="qwen25")
    try:
        r = named.post("/v1/chat/completions", json=body).json()
        assert r["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    finally:
        named.__exit__(None, None, None)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_parsers_give_the_same_events_however_the_text_is_split(fmt):
    from dflash.serve.tools import check_tools, make_parser
    from tests.helpers.serve_scripted import CharTokenizer

    spec = check_tools({"tools": TOOLS})
    tok = CharTokenizer()
    special = make_parser(fmt, spec).special_tokens
    lead = "" if fmt == "llama3_json" else "Hi. "  # a llama3 call is the whole reply
    text = tok.decode(tok.encode(lead + FORMATS[fmt][1]), skip_special_tokens=not special)
    results = []
    for size in (1, 2, 5, len(text)):
        parser, events = make_parser(fmt, spec), []
        for i in range(0, len(text), size):
            events += parser.feed(text[i : i + size])
        events += parser.finish()
        content = "".join(v for k, v in events if k == "content")
        calls = [(v.name, json.loads(v.arguments)) for k, v in events if k == "call"]
        results.append((content, calls))
    assert all(r == results[0] for r in results)
    assert results[0][1] == [("get_weather", ARGS)]


@pytest.mark.parametrize(
    "fmt, text",
    [
        ("hermes", '<tool_call>{"name": 3}</tool_call>'),
        ("hermes", "<tool_call>{not json}</tool_call>"),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}'),  # never closed
        ("qwen3_coder", "<tool_call><function=f><parameter=a>1</function></tool_call>"),
        ("llama3_json", '{"name": "f", "parameters": {"a": 1}} trailing words'),
        ("llama3_json", '{"nom": "f"}'),
        ("gemma4", '<|tool_call>call:f{a:<|"|>unclosed}<tool_call|>'),
        ("openai", '<|channel|>commentary to=functions.f<|message|>{"a": <|call|>'),
    ],
)
def test_malformed_calls_are_plain_content(fmt, text):
    from dflash.serve.tools import check_tools, make_parser

    parser = make_parser(fmt, check_tools({"tools": TOOLS}))
    events = parser.feed(text) + parser.finish()
    assert all(k == "content" for k, _ in events) and events


def test_waiting_and_running_gauges_return_to_zero_after_disconnects():
    """Clients that leave while queued leave the waiting gauge at once (it stayed at 11 after
    11 waiting clients had gone, until the worker reached their jobs); the running gauge
    returns to 0 when the generation in progress is cancelled."""
    import asyncio
    import threading

    from dflash.serve.protocol import parse_request

    gate = threading.Event()

    def reply(msgs):
        gate.wait(30)  # the first generation holds the worker until released
        return "ok"

    http = client_for(ScriptedPipe(reply))
    engine = http.engine
    req = parse_request({"messages": [{"role": "user", "content": "hi"}]}, chat=True)
    gauges = []

    async def main():
        first = engine.steps([1, 2], req)
        task = asyncio.ensure_future(first.__anext__())  # starts the blocked generation
        await asyncio.sleep(0.2)
        queued = [engine.steps([1, 2], req) for _ in range(11)]
        starts = [asyncio.ensure_future(q.__anext__()) for q in queued]
        await asyncio.sleep(0.2)
        gauges.append((engine.metrics.running, engine.metrics.waiting))
        for s in starts:  # as Starlette cancels the response of a client that hung up
            s.cancel()
        await asyncio.gather(*starts, return_exceptions=True)
        gauges.append((engine.metrics.running, engine.metrics.waiting))
        gate.set()
        await task
        await first.aclose()  # its client leaves too: cancelled at its next step
        await asyncio.sleep(0.5)  # the worker runs through the dropped jobs
        gauges.append((engine.metrics.running, engine.metrics.waiting))

    try:
        asyncio.run(main())
        scraped = http.get("/metrics")
    finally:
        gate.set()
        http.__exit__(None, None, None)
    assert gauges == [(1, 11), (1, 0), (0, 0)]
    assert scraped.headers["content-type"].startswith("text/plain")
    rows = parse_prometheus(scraped.text)

    def value(name: str) -> float:
        ((labels, v),) = rows[name]
        assert labels == {"model_name": "scripted"}
        return v

    assert value("vllm:num_requests_waiting") == 0 and value("vllm:num_requests_running") == 0
    # the one generation that ran ("ok" + EOS, cut wherever the cancel found it): its prefill
    # token, then one inter-token latency per token after it
    made = value("vllm:generation_tokens_total")
    assert 1 <= made <= 3 and value("vllm:inter_token_latency_seconds_count") == made - 1
    assert value("vllm:time_to_first_token_seconds_count") == 1
    assert value("vllm:e2e_request_latency_seconds_count") == 1
    assert value("vllm:prompt_tokens_total") == 2  # the queued ones never prefilled
