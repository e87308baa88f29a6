"""The OpenAI-compatible client against recorded SGLang/vLLM responses replayed over loopback:
SSE parsing under any chunking, meta_info and /metrics statistics, retries, timeouts, and
``dflash benchmark openai`` end to end (no model, no torch needed)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from typer.testing import CliRunner

from dflash.backends.openai import (
    RetryPolicy,
    api_root,
    chat_body,
    chat_completion,
    reasoning_template_kwargs,
)
from dflash.backends.openai_stats import SpecCounters, meta_stats
from dflash.errors import InputError
from dflash.types import SamplingParams
from tests.helpers.openai_replay import (
    ReplayServer,
    Reply,
    fixture,
    json_reply,
    sse_data,
    sse_reply,
)

SGLANG_TEXT = "12 × 7 = 84 — «fertig» 🚀"
VLLM_TEXT = "Die Antwort ist 84 — ç’est ça. 你好"
VLLM_REASONING = "Multiply: 12·7. Das ergibt 84."
MODELS = json_reply({"object": "list", "data": [{"id": "Qwen/Qwen3-8B", "object": "model"}]})


def _split(data: bytes, mode: object) -> list[bytes]:
    if isinstance(mode, int):
        return [data[i : i + mode] for i in range(0, len(data), mode)]
    rng = random.Random(mode)
    out, i = [], 0
    while i < len(data):
        n = rng.randint(1, 13)
        out.append(data[i : i + n])
        i += n
    return out


@pytest.mark.parametrize("name", ["sglang_stream.txt", "vllm_stream.txt"])
def test_sse_parsing_gives_the_same_events_under_any_chunking(name):
    """httpx-sse, as the client reads streams, on the recorded streams cut 1, 2, 5 or 7 bytes
    at a time or at random."""
    data = fixture(name)
    expected = sse_data([data])
    assert expected[-1] == "[DONE]" and len(expected) >= 6
    assert all(json.loads(p) for p in expected[:-1])
    for mode in (1, 2, 7, 0, 1, 2, 3):
        assert sse_data(_split(data, mode or 5)) == expected, mode


def test_sse_parsing_rules():
    raw = ': comment\r\ndata: a\rdata:b\n\nevent: x\nid: 3\ndata: {"é": 1}\n\ndata: tail'
    # a last event without its blank line is not dispatched (the WHATWG rule; servers end
    # with "data: [DONE]\n\n", and a finish_reason seen before it is enough for the client)
    assert sse_data(bytes([ch]) for ch in raw.encode()) == ["a\nb", '{"é": 1}']
    assert sse_data([raw.encode() + b"\r\n\r\n"])[-1] == "tail"  # \r\n split from \r\n too
    # a multi-byte character split across reads is never mangled
    emoji = "data: 🚀中\n\n".encode()
    assert sse_data(emoji[i : i + 1] for i in range(len(emoji))) == ["🚀中"]


def test_urls_and_request_body():
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        assert api_root(url) == "http://h:1/v1"
    with pytest.raises(InputError):
        api_root("127.0.0.1:8000")
    body = chat_body("m", [{"role": "user", "content": "x"}], 8, SamplingParams(top_k=0, seed=3),
                     reasoning="off")  # fmt: skip
    assert "top_k" not in body and body["seed"] == 3 and body["return_meta_info"] is True
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["stream_options"] == {"include_usage": True}
    assert chat_body("m", [], 8, SamplingParams(top_k=5))["top_k"] == 5
    assert reasoning_template_kwargs("high") == {
        "enable_thinking": True, "reasoning_effort": "high", "reasoning_strength": "high"}  # fmt: skip


def test_retry_delay_honours_retry_after_and_caps():
    policy = RetryPolicy(backoff_s=1.0, max_backoff_s=4.0, max_retry_after_s=30.0)
    assert policy.delay(0, {"retry-after": "2"}) == 2.0
    assert policy.delay(0, {"retry-after": "999"}) == 30.0
    when = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 10))
    assert 7.0 <= policy.delay(0, {"retry-after": when}) <= 10.5
    assert 0.5 <= policy.delay(0) <= 1.0 and 2.0 <= policy.delay(2) <= 4.0
    assert 2.0 <= policy.delay(10) <= 4.0


def test_vllm_metrics_counters_give_tau_and_per_position():
    before = SpecCounters.from_text(fixture("vllm_metrics_before.txt").decode())
    after = SpecCounters.from_text(fixture("vllm_metrics_after.txt").decode())
    stats = after.minus(before).stats()
    assert stats["drafts"] == 10 and stats["draft_tokens"] == 150 and stats["accepted_tokens"] == 39
    assert stats["tau"] == pytest.approx(1 + 39 / 10)
    assert stats["acceptance_rate"] == pytest.approx(39 / 150)
    expected = [9 / 10, 8 / 9, 7 / 8, 6 / 7, 5 / 6, 4 / 5]
    assert stats["per_position_acceptance"] == pytest.approx(expected)
    assert SpecCounters.from_text("# nothing\nfoo_total 3\n") is None


def test_meta_stats_shapes():
    chat = json.loads(fixture("sglang_chat.json"))
    top = json.loads(fixture("sglang_generate_toplevel.json"))
    from dflash.backends.openai_stats import extract_meta

    s = meta_stats(extract_meta(chat))
    assert s == {"tau": 3.0, "verify_ct": 3, "histogram": [1, 0, 1, 0, 1] + [0] * 11,
                 "accept_lengths": None, "proposed": None}  # fmt: skip
    assert meta_stats(extract_meta(top)) == {"tau": 2.0, "verify_ct": 2, "histogram": None,
                                             "accept_lengths": None, "proposed": None}  # fmt: skip
    assert meta_stats(None) is None and meta_stats({"spec_verify_ct": 3}) is None


def _chat(url: str, stream: bool = True, timeout: float = 10.0, retry: RetryPolicy | None = None):
    async def go():
        async with httpx.AsyncClient(timeout=timeout) as client:
            body = chat_body("Qwen/Qwen3-8B", [{"role": "user", "content": "12*7?"}], 16,
                             SamplingParams(), stream=stream)  # fmt: skip
            seen: list[tuple[str, str]] = []
            r = await chat_completion(client, api_root(url), body, on_delta=lambda k, t: seen.append((k, t)),
                                      retry=retry or RetryPolicy(backoff_s=0.01))  # fmt: skip
            return r, seen

    return asyncio.run(go())


def test_a_stream_cut_before_its_last_blank_line_or_not_an_event_stream():
    """A stream whose ``[DONE]`` lacks its blank line still counts (the finish_reason came
    before it); a reply that is not text/event-stream is a server error, not a crash."""
    data = fixture("vllm_stream.txt")
    assert data.endswith(b"data: [DONE]\r\n\r\n")
    routes = {"POST /v1/chat/completions": [
        Reply(body=data[:-4], content_type="text/event-stream", chunks=7),
        Reply(body=data, content_type="text/plain")]}  # fmt: skip
    with ReplayServer(routes) as srv:
        r, _ = _chat(srv.url)
        assert r.ok and r.text == VLLM_TEXT and r.finish_reason == "stop"
        r, _ = _chat(srv.url)
        assert not r.ok and r.error_kind == "server" and "not an event stream" in r.error


@pytest.mark.parametrize("chunks", [1, 7, "random", "whole"])
def test_streamed_replies_survive_any_network_chunking(chunks):
    routes = {"POST /v1/chat/completions": [sse_reply("sglang_stream.txt", chunks),
                                            sse_reply("vllm_stream.txt", chunks)]}  # fmt: skip
    with ReplayServer(routes) as srv:
        r, seen = _chat(srv.url)
        assert r.ok, r.error
        assert r.text == SGLANG_TEXT and r.reasoning == "" and r.finish_reason == "stop"
        assert r.completion_tokens == 7 and r.prompt_tokens == 18 and r.ttft_s is not None
        assert meta_stats(r.meta)["histogram"][2:4] == [1, 1]
        r, seen = _chat(srv.url)
        assert r.ok, r.error
        assert r.reasoning == VLLM_REASONING and r.text == VLLM_TEXT
        assert [k for k, _ in seen] == ["reasoning", "reasoning", "content"]
        assert r.completion_tokens == 11 and r.meta is None
        assert 0 <= r.ttft_s <= r.e2e_s


def test_non_streamed_meta_info_per_choice_and_top_level():
    routes = {"POST /v1/chat/completions": [Reply(body=fixture("sglang_chat.json")),
                                            Reply(body=fixture("sglang_generate_toplevel.json"))]}  # fmt: skip
    with ReplayServer(routes) as srv:
        r, _ = _chat(srv.url, stream=False)
        assert r.ok and r.text == "12 times 7 is 84." and meta_stats(r.meta)["tau"] == 3.0
        assert srv.requests[0][3]["stream"] is False and srv.requests[0][3]["return_meta_info"]
        r, _ = _chat(srv.url, stream=False)
        assert r.ok and r.text == "Forty-two." and meta_stats(r.meta)["verify_ct"] == 2


def test_429_twice_then_200_is_retried_with_retry_after():
    busy = json_reply(
        {"error": {"message": "slow down"}}, status=429, headers={"Retry-After": "0.2"}
    )
    routes = {"POST /v1/chat/completions": [busy, busy, sse_reply("sglang_stream.txt")]}
    with ReplayServer(routes) as srv:
        t0 = time.perf_counter()
        r, _ = _chat(srv.url)
        assert r.ok and r.attempts == 3 and r.text == SGLANG_TEXT
        assert time.perf_counter() - t0 >= 0.4  # two Retry-After waits of 0.2 s
        assert len(srv.requests) == 3


def test_503_forever_gives_up_after_bounded_retries_and_400_is_not_retried():
    down = json_reply({"error": {"message": "overloaded"}}, status=503)
    bad = json_reply({"error": {"message": "bad top_p"}}, status=400)
    with ReplayServer({"POST /v1/chat/completions": [down]}) as srv:
        r, _ = _chat(srv.url, retry=RetryPolicy(max_retries=3, backoff_s=0.01))
        assert not r.ok and r.status == 503 and r.attempts == 4 and len(srv.requests) == 4
        assert "overloaded" in r.error and "4 attempts" in r.error
    with ReplayServer({"POST /v1/chat/completions": [bad]}) as srv:
        r, _ = _chat(srv.url)
        assert not r.ok and r.status == 400 and r.attempts == 1 and "bad top_p" in r.error


def test_a_hung_server_times_out():
    with ReplayServer({"POST /v1/chat/completions": [Reply(hang=True)]}) as srv:
        t0 = time.perf_counter()
        r, _ = _chat(srv.url, timeout=0.5)
        assert not r.ok and r.error_kind == "timeout"
        assert time.perf_counter() - t0 < 5


def _prompts(tmp_path, n: int = 3):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"question {i}"}) + "\n"
                            for i in range(n)))  # fmt: skip
    return path


def test_benchmark_reads_vllm_metrics_and_lists_errors_apart(tmp_path):
    def chat(body):
        if "question 1" in json.dumps(body):
            return json_reply({"error": {"message": "prompt rejected"}}, status=400)
        return sse_reply("vllm_stream.txt", 7)

    metrics = [Reply(body=fixture("vllm_metrics_before.txt"), content_type="text/plain"),
               Reply(body=fixture("vllm_metrics_after.txt"), content_type="text/plain")]  # fmt: skip
    routes = {
        "GET /v1/models": [MODELS],
        "POST /v1/chat/completions": chat,
        "GET /metrics": metrics,
    }
    out = tmp_path / "r.jsonl"
    from dflash.cli import app

    with ReplayServer(routes) as srv:
        args = ["benchmark", "openai", "--base-url", srv.url + "/v1", "--dataset", str(_prompts(tmp_path)),
                "--num-prompts", "3", "--concurrency", "2", "--max-new-tokens", "16", "--output", str(out)]  # fmt: skip
        res = CliRunner().invoke(app, args, env={"OPENAI_API_KEY": "sk-secret-123"})
        assert res.exit_code == 0, res.output
        auth = {h.get("authorization") for _, p, h, _ in srv.requests if p.startswith("/v1/chat")}
        assert auth == {"Bearer sk-secret-123"}
    assert "sk-secret" not in res.output and "sk-secret" not in out.read_text()
    summary = json.loads(res.stdout.strip().splitlines()[-1])["datasets"][str(_prompts(tmp_path))]
    fast = summary["dflash"]
    assert (fast["requests"], fast["ok"], fast["errors"]) == (3, 2, 1)
    assert fast["output_tokens"] == 22  # usage of the two good replies only
    assert fast["acceptance_source"] == "/metrics" and fast["tau_mean_of_responses"] is None
    assert fast["metrics_counters"]["tau"] == pytest.approx(4.9)
    assert summary["speedup"] is None and "no speedup can be computed" in res.output
    assert "prompt rejected" in res.output and "1 failed requests" in res.output
    assert "Num prompts: 3" in res.output and "Num requests" not in res.output  # one turn each
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(x["ok"] for x in lines) == [False, True, True]
    assert all(x["config"]["model"] == "Qwen/Qwen3-8B" for x in lines)


def test_benchmark_with_a_baseline_server_reports_a_speedup(tmp_path):
    from dflash.cli import app

    routes = {
        "GET /v1/models": [MODELS],
        "POST /v1/chat/completions": lambda b: sse_reply("sglang_stream.txt"),
    }
    with ReplayServer(routes) as fast, ReplayServer(routes) as slow:
        args = ["benchmark", "openai", "--base-url", fast.url, "--baseline-url", slow.url,
                "--dataset", str(_prompts(tmp_path, 2)), "--max-new-tokens", "8"]  # fmt: skip
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        warmups = 1  # --concurrency 1 warm-up request per server
        assert len([r for r in slow.requests if r[0] == "POST"]) == 2 + warmups
    summary = next(iter(json.loads(res.stdout.strip().splitlines()[-1])["datasets"].values()))
    assert summary["baseline"]["ok"] == 2 and summary["dflash"]["ok"] == 2
    assert summary["speedup"]["decode"] is not None and "speedup vs baseline" in res.output
    assert summary["dflash"]["acceptance_source"] == "meta_info"
    assert summary["dflash"]["tau_mean_of_responses"] == 3.5
    assert summary["baseline"]["acceptance_source"] == "meta_info"


def test_benchmark_counts_multi_turn_prompts_and_requests_apart(tmp_path):
    """Two prompts of two turns each: four requests, and the printed summary says both."""
    from dflash.cli import app

    path = tmp_path / "turns.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "turns": [f"question {i}", "and then?"]}) + "\n"
                            for i in range(2)))  # fmt: skip
    routes = {
        "GET /v1/models": [MODELS],
        "POST /v1/chat/completions": lambda b: sse_reply("sglang_stream.txt"),
    }
    with ReplayServer(routes) as srv:
        res = CliRunner().invoke(app, ["benchmark", "openai", "--base-url", srv.url, "--dataset", str(path),
                                       "--max-new-tokens", "8"])  # fmt: skip
        assert res.exit_code == 0, res.output
    summary = next(iter(json.loads(res.stdout.strip().splitlines()[-1])["datasets"].values()))[
        "dflash"
    ]
    assert (summary["prompts"], summary["requests"]) == (2, 4)
    assert "Num prompts: 2" in res.output and "Num requests: 4" in res.output


def test_benchmark_sends_a_prompt_files_system_message(tmp_path):
    from dflash.cli import app

    path = tmp_path / "sys.jsonl"
    path.write_text(json.dumps({"id": "s", "messages": [{"role": "system", "content": "be brief"},
                                                          {"role": "user", "content": "q"}]}) + "\n")  # fmt: skip
    routes = {"GET /v1/models": [MODELS],
              "POST /v1/chat/completions": lambda b: sse_reply("sglang_stream.txt")}  # fmt: skip
    with ReplayServer(routes) as srv:
        res = CliRunner().invoke(app, ["benchmark", "openai", "--base-url", srv.url, "--dataset",
                                       str(path), "--max-new-tokens", "8"])  # fmt: skip
        assert res.exit_code == 0, res.output
        sent = [body["messages"] for method, _, _, body in srv.requests if method == "POST"]
    assert len(sent) == 2  # warm-up, then the measured request
    assert all(m == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]
               for m in sent)  # fmt: skip


def test_benchmark_fails_with_one_line_when_every_request_fails(tmp_path):
    from dflash.cli import app

    down = json_reply(
        {"error": {"message": "overloaded"}}, status=503, headers={"Retry-After": "0"}
    )
    routes = {"GET /v1/models": [MODELS], "POST /v1/chat/completions": [down]}
    with ReplayServer(routes) as srv:
        args = ["benchmark", "openai", "--base-url", srv.url, "--dataset", str(_prompts(tmp_path, 2)),
                "--max-retries", "2", "--max-new-tokens", "8"]  # fmt: skip
        res = CliRunner().invoke(app, args)
    assert res.exit_code != 0
    assert "Every request" in str(res.exception) and "503" in str(res.exception)
    assert "3 attempts" in res.output and "2 failed requests" in res.output


def test_unreachable_server_error_names_the_flag_that_gave_it():
    """A benchmark's unreachable baseline server is blamed on --baseline-url (found by a user trial)."""
    from dflash.backends.openai import first_model
    from dflash.errors import ServerError

    async def ask(flag):
        async with httpx.AsyncClient(timeout=2.0) as client:
            return await first_model(client, "http://127.0.0.1:9/v1", None, *flag)

    for flag, want in (((), "--base-url"), (("--baseline-url",), "--baseline-url")):
        with pytest.raises(ServerError) as err:
            asyncio.run(ask(flag))
        assert err.value.hint.startswith(
            "start the server (dflash serve"
        ) and err.value.hint.endswith(f"or fix {want}")
