"""``POST /v1/responses`` with the official ``openai`` package (``client.responses.create``),
streamed and not, text and function calls, on a scripted target; stored state is refused."""

from __future__ import annotations

import json

import pytest

from tests.helpers.serve_scripted import ANSWER, ARGS, FORMATS, ScriptedPipe, client_for

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                          "days": {"type": "integer"}}}}]  # fmt: skip
TEXT = "Hello there, friend."


def reply(msgs):
    if msgs[-1]["role"] == "tool":
        return ANSWER
    return FORMATS["hermes"][1] if "weather" in msgs[-1]["content"] else TEXT


@pytest.fixture
def client():
    http = client_for(ScriptedPipe(reply, FORMATS["hermes"][0]))
    yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http), http
    http.__exit__(None, None, None)


def test_responses_text_streamed_and_not(client):
    oa, http = client
    r = oa.responses.create(model="scripted", input="Say hello", instructions="Be kind.")
    assert r.output_text == TEXT and r.status == "completed" and r.object == "response"
    assert r.usage.output_tokens == len(TEXT) + 1  # the end-of-sequence token counts
    system = http.engine.pipe.tokenizer.rendered[-1]["messages"][0]
    assert system == {"role": "system", "content": "Be kind."}
    events = list(oa.responses.create(model="scripted", input="Say hello", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]  # fmt: skip
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == TEXT
    assert events[-1].response.output_text == TEXT
    assert [e.sequence_number for e in events] == list(range(len(events)))
    short = oa.responses.create(model="scripted", input="Say hello", max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.output_text == TEXT[:3]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_call_round_trip(client, stream):
    oa, _ = client
    kw = {"model": "scripted", "input": [{"role": "user", "content": "weather in Paris?"}],
          "tools": TOOLS}  # fmt: skip
    if stream:
        events = list(oa.responses.create(**kw, stream=True))
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and json.loads(done[0].arguments) == ARGS
        output = events[-1].response.output
    else:
        output = oa.responses.create(**kw).output
    calls = [o for o in output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS)]
    assert [o.content[0].text for o in output if o.type == "message"] == ["Let me check.\n"]
    follow = kw["input"] + [{"type": "function_call", "call_id": calls[0].call_id,
                             "name": "get_weather", "arguments": calls[0].arguments},
                            {"type": "function_call_output", "call_id": calls[0].call_id,
                             "output": "22 C"}]  # fmt: skip
    final = oa.responses.create(**{**kw, "input": follow})
    assert final.output_text == ANSWER


def test_stored_state_is_refused(client):
    oa, http = client
    for extra, param in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"store": True}, "store"),
                         ({"input": [{"type": "image", "url": "x"}]}, "input")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            oa.responses.create(**{"model": "scripted", "input": "hi", **extra})
        assert err.value.body["param"] == param
    assert oa.responses.create(model="scripted", input="hi", store=False).output_text == TEXT
