"""The framework-free parts of ``dflash serve``: request checking, stop strings, meta_info and
the Prometheus counters (read back by the client's own parser)."""

from __future__ import annotations

import pytest

from dflash.backends.openai_stats import SpecCounters, meta_stats, parse_prometheus
from dflash.serve.protocol import ApiError, StopMatcher, meta_info, parse_request

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_parse_request_defaults_and_fields():
    r = parse_request(CHAT, chat=True)
    assert r.sampling.temperature == 1.0 and r.max_tokens is None and not r.stream
    assert not parse_request({**CHAT, "stream": None}, chat=True).stream  # null as absent (OpenAI)
    r = parse_request({**CHAT, "max_completion_tokens": 5, "top_k": -1, "seed": 7, "stop": "x",
                       "stream": True, "stream_options": {"include_usage": True},
                       "chat_template_kwargs": {"enable_thinking": False},
                       "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]},
                                    {"role": "user", "content": "q"}]}, chat=True)  # fmt: skip
    assert r.max_tokens == 5 and r.sampling.top_k == 0 and r.sampling.seed == 7
    assert r.stop == ["x"] and r.stream and r.include_usage
    assert r.messages[0] == {"role": "system", "content": "ab"}
    assert r.template_kwargs == {"enable_thinking": False}
    assert parse_request({"prompt": ["once"]}, chat=False).prompt == "once"
    for prompt, prompts in (([504, 3575, 282], [[504, 3575, 282]]), ([[1, 2]], [[1, 2]]),
                            (["a", [3], "b"], ["a", [3], "b"])):  # fmt: skip
        assert parse_request({"prompt": prompt}, chat=False).prompts == prompts
    for prompt, got in (([], "an empty list"), ([[1], []], "a list holding a list, an empty list"),
                        (["a", 2], "a list holding a string, int"), ("", "an empty string"),
                        (None, "null"), ([[1, -2]], "a list holding a list"), (3, "int")):  # fmt: skip
        with pytest.raises(ApiError, match=f"; got {got}[.]$"):
            parse_request({"prompt": prompt}, chat=False)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], "body"),
        ({}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({**CHAT, "temperature": -0.1}, "temperature"),
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "top_p": 0}, "top_p"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "max_tokens": True}, "max_tokens"),
        ({**CHAT, "n": 17}, "n"),
        ({**CHAT, "logprobs": 1}, "logprobs"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**CHAT, "presence_penalty": 0.5}, "presence_penalty"),
        ({**CHAT, "stop": [""]}, "stop"),
        ({**CHAT, "stream": "yes"}, "stream"),
        ({**CHAT, "stream": 0}, "stream"),
        ({**CHAT, "model": 3}, "model"),
        # user trial: options that change the output were accepted and ignored
        ({**CHAT, "logit_bias": {"42": 100}}, "logit_bias"),
        ({**CHAT, "min_tokens": 5}, "min_tokens"),
        ({**CHAT, "repetition_penalty": 1.2}, "repetition_penalty"),
        ({**CHAT, "min_p": 0.1}, "min_p"),
        ({**CHAT, "stop_token_ids": [2, -1]}, "stop_token_ids"),
        ({**CHAT, "stop_token_ids": 2}, "stop_token_ids"),
        ({**CHAT, "ignore_eos": "yes"}, "ignore_eos"),
        ({**CHAT, "return_meta_info": 1}, "return_meta_info"),
        ({**CHAT, "stream": True, "stream_options": {"include_usage": "false"}}, "stream_options"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),  # no stream
        ({**CHAT, "stream": False, "stream_options": {}}, "stream_options"),
        # second user trial: more output-changing fields, template-call args, tool calls
        ({**CHAT, "include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ({**CHAT, "skip_special_tokens": 0}, "skip_special_tokens"),
        ({**CHAT, "spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        ({**CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
        ({**CHAT, "documents": [{"text": "x"}]}, "documents"),
        ({**CHAT, "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({**CHAT, "typical_p": 0.9}, "typical_p"),
        ({**CHAT, "mirostat": 2}, "mirostat"),
        ({**CHAT, "verbosity": "low"}, "verbosity"),
        ({**CHAT, "logit_bias": {"504": 0, "13": -5}}, "logit_bias"),
        ({**CHAT, "reasoning_effort": 3}, "reasoning_effort"),
        ({**CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        (
            {**CHAT, "chat_template_kwargs": {"add_generation_prompt": False, "messages": []}},
            "chat_template_kwargs",
        ),
        (
            {**CHAT, "continue_final_message": True},
            "continue_final_message",
        ),  # generation prompt too
        (
            {**CHAT, "continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message",
        ),  # the last message is the user's
        ({**CHAT, "add_generation_prompt": "no"}, "add_generation_prompt"),
        ({**CHAT, "max_tokens": 8.5}, "max_tokens"),
        ({**CHAT, "seed": 2**63}, "seed"),
    ],
)
def test_bad_requests_are_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as err:
        parse_request(body, chat=True)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_vllm_lax_values_and_the_assistant_prefill():
    """Whole floats as integers (pydantic's lax mode in vLLM), negative seeds modulo 2^63,
    logit biases of 0, completions' logprobs=0 (it asks for the chosen tokens'), and the
    assistant prefill: continue_final_message with add_generation_prompt false, top level or in
    chat_template_kwargs (which win, as in vLLM)."""
    r = parse_request({**CHAT, "max_tokens": 8.0, "n": 1.0, "seed": -1, "logit_bias": {"504": 0}},
                      chat=True)  # fmt: skip
    assert r.max_tokens == 8 and r.sampling.seed == 2**63 - 1
    assert parse_request({**CHAT, "seed": 5.0}, chat=True).sampling.seed == 5
    assert parse_request({"prompt": "x", "logprobs": 0}, chat=False).logprobs == 0  # asks for them
    assert parse_request({"prompt": "x", "logprobs": None}, chat=False).logprobs is None
    assert parse_request({**CHAT, "logprobs": True, "top_logprobs": 3}, chat=True).logprobs == 3
    assert parse_request({**CHAT, "logprobs": False}, chat=True).logprobs is None
    prefill = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]
    }
    r = parse_request(
        {**prefill, "continue_final_message": True, "add_generation_prompt": False}, chat=True
    )
    assert r.template_kwargs == {"add_generation_prompt": False, "continue_final_message": True}
    r = parse_request({**prefill, "continue_final_message": True,
                       "chat_template_kwargs": {"add_generation_prompt": False, "enable_thinking": False}},
                      chat=True)  # fmt: skip
    assert r.template_kwargs == {"continue_final_message": True, "add_generation_prompt": False,
                                 "enable_thinking": False}  # fmt: skip
    assert parse_request(CHAT, chat=True).template_kwargs == {}
    r = parse_request({**CHAT, "reasoning_effort": "low", "include_stop_str_in_output": True,
                       "stream": True, "stream_options": {"continuous_usage_stats": True}}, chat=True)  # fmt: skip
    assert r.reasoning_effort == "low" and r.include_stop_str and r.continuous_usage
    assert not r.include_usage


def test_neutral_values_of_output_changing_options_and_vllm_stop_fields_are_taken():
    """The values that leave the output unchanged pass (clients send them as defaults);
    ``stop_token_ids`` and ``ignore_eos`` (vLLM's) are read, not dropped."""
    neutral = {"logit_bias": {}, "min_tokens": 0, "repetition_penalty": 1.0, "min_p": 0,
               "response_format": {"type": "text"}, "tool_choice": "none", "ignore_eos": None,
               "stream_options": None}  # fmt: skip
    r = parse_request({**CHAT, **neutral}, chat=True)
    assert r.stop_token_ids == [] and not r.ignore_eos and not r.include_usage
    r = parse_request({**CHAT, "stop_token_ids": [13, 2], "ignore_eos": True}, chat=True)
    assert r.stop_token_ids == [13, 2] and r.ignore_eos


def test_stop_matcher_holds_back_possible_starts_and_cuts_at_the_first_match():
    m = StopMatcher(["</s>", "STOP"])
    out = []
    for piece in ["Hello </", "x> wor", "ld ST", "OP tail"]:
        text, hit = m.feed(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "Hello </x> world " and hit
    m = StopMatcher(["zz"])
    assert m.feed("abz") == ("ab", False) and m.feed("", final=True) == ("z", False)
    assert StopMatcher([]).feed("abc") == ("abc", False)


def test_meta_info_and_metrics_agree_and_round_trip_through_the_client_parsers():
    accepted, proposed = [3, 1, 16, 2, 1], [15, 15, 15, 15, 0]  # last step: budget left 1
    meta = meta_info(accepted, proposed, 16, prompt_tokens=10, completion_tokens=24, e2e_s=1.0)
    assert meta["spec_verify_ct"] == 5 and meta["spec_accept_length"] == sum(accepted) / 5
    assert (
        meta["spec_correct_drafts_histogram"][:3] == [2, 1, 1]
        and meta["spec_correct_drafts_histogram"][15] == 1
    )
    assert meta["spec_num_correct_drafts"] == 2 + 0 + 15 + 1 + 0
    assert meta_stats(meta)["tau"] == pytest.approx(23 / 5)
    pytest.importorskip("prometheus_client")
    from dflash.serve.metrics import ServerMetrics

    metrics = ServerMetrics('m"x', 16)
    for a, p in zip(accepted, proposed, strict=True):
        metrics.step(a, p)
    metrics.tokens(24)  # counted as the steps commit them
    metrics.request_done("length")
    counters = SpecCounters.from_text(metrics.render())
    assert (counters.drafts, counters.draft_tokens, counters.accepted) == (4, 60, 18)
    assert counters.per_pos[:4] == [3, 2, 1, 1] and sum(counters.per_pos) == 18
    assert counters.stats()["tau"] == pytest.approx(1 + 18 / 4)
    assert meta["spec_accept_length_per_step"] == accepted
    assert meta["spec_proposed_drafts_per_step"] == proposed
    # one width: drafts reaching a position = drafts that accepted the one before (vLLM's reading)
    assert counters.reached[:4] == [4, 3, 2, 1] and counters.reached[4:] == [1] * 11
    vllm_reading = SpecCounters(counters.drafts, counters.draft_tokens, counters.accepted,
                                counters.per_pos).stats()["per_position_acceptance"]  # fmt: skip
    assert counters.stats()["per_position_acceptance"] == pytest.approx(vllm_reading)
    assert vllm_reading[:4] == pytest.approx([3 / 4, 2 / 3, 1 / 2, 1.0])
    rows = parse_prometheus(metrics.render())
    assert rows["vllm:generation_tokens_total"][0][1] == 24
    assert rows["vllm:request_success_total"][0][0]["finished_reason"] == "length"


class _CharTokenizer:
    """Token id i is the character chr(i); "#" (35) is a special token."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 35))


@pytest.mark.parametrize(
    "stops, text, tokens, finish, include",
    [
        (
            [" 6"],
            "1, 2, 3, 4, 5,",
            16,
            "stop",
            False,
        ),  # the stop string ends at the 16th token of step 2
        ([" 6"], "1, 2, 3, 4, 5, 6", 16, "stop", True),  # vLLM's include_stop_str_in_output
        ([", 6", " 6,"], "1, 2, 3, 4, 5, 6", 16, "stop", True),  # the first match wins
        ([], "1, 2, 3, 4, 5, 6, 7, 8", 22, "length", False),
        (["9"], "1, 2, 3, 4, 5, 6, 7, 8", 22, "length", True),
    ],
)
def test_usage_counts_tokens_up_to_the_stop_string(stops, text, tokens, finish, include):
    """completion_tokens ends at the token that completed a stop string (as vLLM counts), not
    at the end of the verify step that committed it (that made the count depend on the block
    size)."""
    pytest.importorskip("torch")
    from dflash.serve.chat import Output
    from dflash.types import RoundResult

    ids = [ord(c) for c in "1, 2, 3, 4, 5, 6, 7, 8"]  # 22 tokens in 3 steps
    steps = [RoundResult(tokens=ids[:10], accepted=10, proposed=15),
             RoundResult(tokens=ids[10:20], accepted=10, proposed=15),
             RoundResult(tokens=ids[20:], accepted=2, proposed=15, finish_reason="length")]  # fmt: skip
    req = parse_request(
        {**CHAT, "stop": stops or None, "include_stop_str_in_output": include}, chat=True
    )
    out, sent = Output(_CharTokenizer(), req), ""
    for step in steps:
        sent += "".join(v for k, v in out.add(step) if k == "content")
        if out.finish:
            break
    assert (sent, out.tokens, out.finish) == (text, tokens, finish)


@pytest.mark.parametrize("skip, text", [(None, "ab"), (True, "ab"), (False, "a#b#")])
def test_skip_special_tokens_false_keeps_their_text(skip, text):
    pytest.importorskip("torch")
    from dflash.serve.chat import Output
    from dflash.types import RoundResult

    out = Output(_CharTokenizer(), parse_request({**CHAT, "skip_special_tokens": skip}, chat=True))
    sent = "".join(v for _, v in out.add(RoundResult(tokens=[97, 35], accepted=2, proposed=3)))
    sent += "".join(
        v
        for _, v in out.add(
            RoundResult(tokens=[98, 35], accepted=2, proposed=3, finish_reason="stop")
        )
    )
    assert sent == text and out.tokens == 4


def test_serve_listens_where_the_openai_backend_looks_by_default():
    """`dflash serve` then `dflash generate openai` (or `benchmark openai`) needs no --base-url
    (found by a user trial: the server listened on 8000, the clients asked 30000)."""
    import inspect

    from dflash import commands
    from dflash.backends.openai import DEFAULT_BASE_URL
    from dflash.bench import command as bench_command
    from dflash.serve import command as serve

    port = inspect.signature(serve.serve).parameters["port"].default
    port = getattr(port, "default", port)  # a typer.Option default or a plain one
    for url in (DEFAULT_BASE_URL, commands.BASE_URL_DEFAULT, bench_command.BASE_URL_DEFAULT):
        assert url == f"http://127.0.0.1:{port}"
