"""``generate``'s untimed warm-up (CUDA-graph path): what it runs, and that it changes nothing."""

from __future__ import annotations

import pytest

from tests.helpers.fakes import WarmupPipe
from tests.helpers.tiny import PROMPT, FakeTokenizer, greedy_reference


class CountingBackend:
    """Wraps a backend and records the capacity asked at each reset and every verify width."""

    def __init__(self, inner):
        self.inner, self.resets, self.verifies = inner, [], []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reset(self, max_positions=None):
        self.resets.append(max_positions)
        return self.inner.reset(max_positions)

    def verify(self, anchor, proposals, start, keep):
        self.verifies.append(1 + (0 if proposals is None else len(proposals)))
        return self.inner.verify(anchor, proposals, start, keep)


def test_warm_up_runs_the_request_at_block_1_and_l_then_generation_is_unchanged(
    tiny_backend, tiny_target
):
    from dflash.api import Pipeline

    be = CountingBackend(tiny_backend)
    pipe = Pipeline(be, FakeTokenizer(), [], "tiny", cost_key={"test": "tiny"})
    assert pipe.warm_up(PROMPT, max_new_tokens=40, tokens=0) == pytest.approx(0.0, abs=0.05)
    assert be.resets == [] and be.verifies == []
    seconds = pipe.warm_up(PROMPT, max_new_tokens=40, tokens=8)
    assert seconds > 0 and pipe.last_policy is None
    # caches sized for the request itself (prompt + budget + verify width), the wider pass first
    assert be.resets == [len(PROMPT) + 40 + 16, len(PROMPT) + 40 + 1]
    ones = be.verifies[-7:]  # block 1: the prefill's token, then 7 one-token verify steps
    wide = be.verifies[:-7]
    assert ones == [1] * 7 and wide and set(wide) == {16}
    assert len(wide) <= 7  # stopped once 8 tokens were committed at block 16
    res = pipe.generate(PROMPT, max_new_tokens=40, block_size=16)
    assert res.token_ids == greedy_reference(tiny_target, PROMPT, 40)


def test_warmup_option_is_checked():
    from dflash.errors import InputError
    from dflash.options import WARMUP_DEFAULT, check_warmup

    assert WARMUP_DEFAULT == 64
    check_warmup(0)
    with pytest.raises(InputError, match="--warmup must be a whole number of tokens >= 0"):
        check_warmup(-1)


@pytest.mark.parametrize("use_graphs", [True, False])
def test_serve_warms_up_at_load_on_the_graph_path_only(use_graphs):
    from dflash.serve.engine import Engine

    pipe = WarmupPipe(use_graphs)
    engine = Engine(lambda: pipe, ["demo"], block_size=16, warmup=32)
    engine._load_now()
    assert engine.error is None and engine.pipe is pipe
    assert pipe.calls == ([([1, 2, 3], {"max_new_tokens": 97, "tokens": 32})] if use_graphs else [])


def test_serve_starts_when_the_warm_up_fails(capsys):
    from dflash.serve.engine import Engine

    pipe = WarmupPipe(True)

    def boom(ids, **kwargs):
        raise RuntimeError("CUDA out of memory")

    pipe.warm_up = boom
    engine = Engine(lambda: pipe, ["demo"], block_size=16)
    engine._load_now()
    assert engine.error is None and engine.pipe is pipe
    assert "warning: warm-up skipped (RuntimeError: CUDA out of memory)" in capsys.readouterr().err


@pytest.mark.parametrize("use_graphs", [True, False])
def test_cli_generate_warms_up_on_the_graph_path_before_seeding(monkeypatch, use_graphs):
    import json

    import torch
    from typer.testing import CliRunner

    import dflash
    from dflash.cli import app
    from dflash.types import GenerationResult

    events = []

    class Pipe(WarmupPipe):
        def chat_prompt(self, messages, **kwargs):
            return [1, 2, 3]

        def warm_up(self, ids, **kwargs):
            events.append(("warm_up", kwargs["max_new_tokens"], kwargs["tokens"]))
            return 0.25

        def generate(self, ids, **kwargs):
            events.append(("generate",))
            return GenerationResult(token_ids=[7], text="x", prompt_tokens=3, acceptance_lengths=[1],
                                    proposed=[15], block_size=16)  # fmt: skip

    monkeypatch.setattr(dflash, "load", lambda *a, **k: Pipe(use_graphs))
    monkeypatch.setattr(torch, "manual_seed", lambda seed: events.append(("seed", seed)))
    res = CliRunner().invoke(app, ["generate", "transformers", "hi", "--block-size", "16",
                                   "--max-new-tokens", "40", "--seed", "5", "--json", "--warmup", "16"])  # fmt: skip
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    warm = [("warm_up", 40, 16)] if use_graphs else []
    assert events == warm + [("seed", 5), ("generate",)]
    assert out["warmup_s"] == (0.25 if use_graphs else 0.0)
