"""``dflash serve --max-batch``: 8 concurrent requests through 4 batched rows (tiny float32 pair on
the CPU, in-process) get each one's single-request text; options and fall-backs."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")

from dflash.backends.plain import TransformersBackend  # noqa: E402
from dflash.pipeline import Pipeline  # noqa: E402
from dflash.serve.batch_engine import BatchEngine, default_max_batch  # noqa: E402
from tests.helpers.serve_scripted import CharTokenizer, client_for  # noqa: E402
from tests.helpers.tiny import make_draft, tiny_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
QUESTIONS = ["hi", "What is 2+2?", "Tell me a story about a cat", "x", "Count: 1 2 3",
             "Why is the sky blue?", "ok", "Name three colours."]  # fmt: skip


@pytest.fixture(scope="module")
def pipe():
    target = tiny_llama(max_position_embeddings=1024)
    backend = TransformersBackend(target, make_draft(target, block_size=8), torch.device("cpu"))
    return Pipeline(backend, CharTokenizer(), stop_ids=[ord("!")])


def batch_client(pipe, max_batch: int, block_size=8):
    from starlette.testclient import TestClient

    from dflash.serve.server import build_app

    engine = BatchEngine(lambda: pipe, ["tiny"], block_size, max_batch=max_batch)
    client = TestClient(build_app(engine))
    client.__enter__()
    deadline = time.monotonic() + 300
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline and engine.error is None, engine.error
        time.sleep(0.02)
    client.engine = engine
    return client


def ask(client, i: int, stream: bool = False) -> str:
    body = {"messages": [{"role": "user", "content": QUESTIONS[i]}], "max_tokens": 6 + 5 * i,
            "temperature": 0}  # fmt: skip
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


@pytest.fixture(scope="module")
def want(pipe):
    """Each question's reply served alone (the one-at-a-time Engine, plain path)."""
    alone = client_for(pipe, ("tiny",), block_size=8)
    try:
        return [ask(alone, i) for i in range(8)]
    finally:
        alone.__exit__(None, None, None)


def test_concurrent_requests_get_their_single_request_text(pipe, want):
    assert {f for _, f in want} >= {"length"}
    client = batch_client(pipe, max_batch=4)
    try:
        assert client.engine.spec is not None and client.engine.max_batch == 4
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: ask(client, i), range(8)))
        assert got == want
        assert client.engine.spec.steps_run > 0  # (a lone first request may run one-at-a-time)
        assert ask(client, 2) == want[2] and client.engine.solo_runs >= 1  # alone: one-at-a-time
        deadline = time.monotonic() + 10  # the last row ends just after its reply
        running = 'vllm:num_requests_running{model_name="tiny"} 0.0'
        while running not in (metrics := client.get("/metrics").text):
            assert time.monotonic() < deadline, metrics
            time.sleep(0.05)
        assert 'vllm:e2e_request_latency_seconds_count{model_name="tiny"} 9.0' in metrics
        assert 'vllm:num_requests_waiting{model_name="tiny"} 0.0' in metrics
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                       "logprobs": True, "max_tokens": 3})  # fmt: skip
        assert r.status_code == 400 and "--max-batch" in r.json()["error"]["message"]
    finally:
        client.__exit__(None, None, None)


def test_auto_width_batches_give_the_same_text(pipe, want, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))  # the single path's cost table goes here
    client = batch_client(pipe, max_batch=4, block_size=None)
    try:
        assert client.engine.policy is not None
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: ask(client, i), range(8)))
        assert got == want and client.engine.policy.history
    finally:
        client.__exit__(None, None, None)


def test_requests_past_a_rows_capacity_run_alone(pipe, want, monkeypatch):
    """A request whose prompt + max_tokens no batched row holds waits for the rows to drain and
    runs one-at-a-time: its reply and every other's equal the single-request ones (no error)."""
    import dflash.serve.batch_engine as batch_engine

    needs = [len(pipe.chat_prompt([{"role": "user", "content": q}])) + 6 + 5 * i
             for i, q in enumerate(QUESTIONS)]  # fmt: skip
    cap = sorted(needs)[4]  # three of the eight need more than a row holds
    long = sum(n > cap for n in needs)
    assert long == 3
    monkeypatch.setattr(batch_engine, "BATCH_CAPACITY", cap)
    client = batch_client(pipe, max_batch=4)
    try:
        assert client.engine.spec.max_len == cap
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: ask(client, i), range(8)))
        assert got == want and client.engine.solo_runs >= long
    finally:
        client.__exit__(None, None, None)


def test_one_row_and_cpu_default_keep_one_at_a_time(pipe):
    client = batch_client(pipe, max_batch=1)
    try:
        assert client.engine.spec is None
        assert ask(client, 1)[0]
    finally:
        client.__exit__(None, None, None)
    assert (
        default_max_batch(torch.device("cpu")) == 1 and default_max_batch(torch.device("cuda")) == 1
    )


@pytest.mark.parametrize("args", [["--max-batch", "0"], ["--max-batch", "4", "--backend", "mlx"]])
def test_bad_max_batch_is_one_line_error(args):
    from typer.testing import CliRunner

    from dflash.cli import app

    res = CliRunner().invoke(app, ["serve", *args])
    assert res.exit_code != 0 and "--max-batch" in str(res.exception)


def test_max_batch_above_one_is_accepted():
    """``--max-batch 8`` is no longer withheld: the command goes on to its later checks (here a
    bad ``--block-size``, before anything loads)."""
    from typer.testing import CliRunner

    from dflash.cli import app

    res = CliRunner().invoke(app, ["serve", "--max-batch", "8", "--block-size", "bogus"])
    assert res.exit_code != 0 and "block" in str(res.exception).lower()
    assert "--max-batch" not in str(res.exception)
