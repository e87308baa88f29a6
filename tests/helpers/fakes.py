"""Fake pipelines: scripted benchmark results without a model (``FakePipeline`` and a Typer app
running ``benchmark`` over it), and one that records warm-up calls (``WarmupPipe``)."""

from __future__ import annotations

import time

import typer

from dflash.bench import command
from dflash.types import GenerationResult, SamplingParams


class FakePipeline:
    """Deterministic stand-in for ``dflash.api.Pipeline`` with scripted acceptance lengths.

    Output tokens and τ schedule depend only on the prompt ids, and times are scripted (so
    summaries are reproducible). ``delay`` seconds of sleep per generate call make a run slow
    enough to kill; ``diverge`` makes DFlash differ from the baseline at new token 2 for prompts
    whose first message contains that string.
    """

    block_size = 4
    stop_ids = [0]

    def __init__(self, delay: float = 0.0, diverge: str | None = None):
        self.delay = delay
        self.diverge = diverge
        self.calls: list[tuple[int, int]] = []  # (prompt length, block size)
        self.prompts: list[list[dict]] = []

    def chat_prompt(self, messages, *, system=None, reasoning=None):
        self.prompts.append([dict(m) for m in messages])
        text = "|".join(f"{m['role']}:{m['content']}" for m in messages)
        return [ord(c) % 50 + 1 for c in text]

    def generate(self, prompt_ids, *, block_size=None, max_new_tokens=2048,
                 sampling=SamplingParams(), stop_ids=None):  # fmt: skip
        time.sleep(self.delay)
        bs = block_size or self.block_size
        self.calls.append((len(prompt_ids), bs))
        seed = sum(prompt_ids)
        n = min(max_new_tokens, 6 + seed % 9)
        tokens = [(seed + 7 * i) % 90 + 5 for i in range(n)]
        if self.diverge and bs > 1 and n > 2 and self.diverge in self.prompts[-1][0]["content"]:
            tokens[2] += 1
        taus, proposed, left = [], [], n - 1
        pattern = [bs, 1 + seed % bs, 2 if bs > 1 else 1, 1]
        while left > 0:
            width = min(bs, left + 1)  # the last block shrinks to the budget
            tau = min(pattern[len(taus) % 4], width, left)
            taus.append(tau)
            proposed.append(width - 1)
            left -= tau
        finish = "length" if n == max_new_tokens else "stop"
        return GenerationResult(
            token_ids=tokens, text=f"answer {seed} {bs}", prompt_tokens=len(prompt_ids),
            acceptance_lengths=taus, proposed=proposed, ttft_s=0.001 * (1 + seed % 5),
            decode_s=0.01 * (n - 1) / (1 if bs == 1 else 2.5), finish_reason=finish,
            block_size=bs,
        )  # fmt: skip

    def decode(self, ids):
        return " ".join(map(str, ids))


def make_app(pipeline_factory) -> typer.Typer:
    """A one-command Typer app running ``benchmark`` with the pipeline loader replaced."""
    command._load_pipeline = lambda *args, **kwargs: pipeline_factory()
    app = typer.Typer(pretty_exceptions_enable=False)
    app.command()(command.benchmark)
    return app


class _Backend:
    """A backend that only says whether it runs CUDA graphs."""

    def __init__(self, use_graphs):
        self.use_graphs, self.max_context = use_graphs, 100


class WarmupPipe:
    """A pipeline that records its warm-up calls (``calls``: (ids, keyword arguments))."""

    block_size = 16

    def __init__(self, use_graphs):
        self.backend, self.calls = _Backend(use_graphs), []

    def resolve_block_size(self, value):
        return 16

    def calibrate_for(self, ids, block_size, max_new_tokens):  # a fixed block size: no costs
        pass

    def chat_prompt(self, messages):
        return [1, 2, 3]

    def warm_up(self, ids, **kwargs):
        self.calls.append((ids, kwargs))
