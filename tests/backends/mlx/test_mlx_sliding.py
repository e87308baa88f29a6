"""Sliding-window targets (mlx-lm gemma3_text, gemma4_text with KV sharing and per-layer inputs,
the gemma4 wrapper with K = V and an MoE block, gpt_oss: rotating KV caches) on the MLX backend,
with prompts longer than every window (gemma3_text's and gemma4's, 8, are also shorter than a
16-token block).

After every verify step each rotating cache must be what one-by-one decoding of the committed
tokens leaves: the same ring buffer (every row of keys and values, in the same slots), offset and
write index; full-attention caches the same rows and offset. The first layer's K/V (a function
of the embeddings alone) agree bit for bit; deeper layers' to float32 rounding: one-token
decoding attends over the ring in slot order, a verify over the window in temporal order, and a
permuted sum rounds differently (max difference 4e-5 on values up to 9, CPU; on Metal 1e-3 as in
test_mlx_hybrid.py). The greedy ids equal mlx-lm's greedy decoding.
"""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from dflash.loop import speculative_generate  # noqa: E402
from tests.helpers.mlx_models import (  # noqa: E402
    SLIDING,
    build_draft,
    build_target,
    greedy_reference,
    random_prompt,
)
from tests.helpers.mlx_models import MlxScriptedBackend as ScriptedBackend  # noqa: E402

PROMPT = random_prompt(40, seed=3)  # longer than every window (8, 12, 24)
N = 48
ROTATING = {"gemma3_text": [0, 2], "gemma4_text": [0, 1, 3], "gemma4": [0, 2], "gpt_oss": [0, 2]}
# float32 rounding of a permuted attention sum (see the module docstring); on Metal a 16-row verify
# and one-row steps also tile their matmuls differently (as in test_mlx_hybrid.py)
ON_CPU = mx.default_device().type == mx.cpu
RTOL = 2e-5 if ON_CPU else 1e-3
SCHEDULES = [[15, 0, 3, 0, 0, 15], [0, 0, 0], [15], [2, 7, 1, 11]]


@pytest.fixture(scope="module", params=SLIDING)
def sliding(request, tmp_path_factory):
    """(family, pipeline, target folder, mlx-lm's greedy ids) of one sliding-window family."""
    import dflash

    root = tmp_path_factory.mktemp(request.param)
    target = build_target(root / "target", request.param)
    draft = build_draft(root / "draft", target)
    pipe = dflash.load(str(target), str(draft), backend="mlx")
    return request.param, pipe, target, greedy_reference(target, PROMPT, N + 20)


class Reference:
    """The same target decoding committed tokens one at a time (prompt as mlx-lm prefills it)."""

    def __init__(self, target_dir, prompt: list[int]):
        from mlx_lm import load
        from mlx_lm.models.cache import make_prompt_cache

        self.model, _ = load(str(target_dir))
        self.cache = make_prompt_cache(self.model)
        self.model(mx.array([prompt[:-1]]), cache=self.cache)
        self.model(mx.array([prompt[-1:]]), cache=self.cache)
        self.prompt_len = self.length = len(prompt)

    def feed(self, committed: list[int]) -> None:
        """Decode the committed tokens not fed yet, all but the last (the next anchor)."""
        for t in committed[self.length - self.prompt_len : -1]:
            self.model(mx.array([[t]]), cache=self.cache)
            self.length += 1


def same(a, b, exact: bool) -> bool:
    """Same shape and dtype, and equal: bit for bit, or to float32 rounding (RTOL of the
    largest magnitude; a row in the wrong slot or a stale row differs by O(1))."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if exact:
        return bool(mx.array_equal(a, b))
    return float(mx.abs(a - b).max()) <= RTOL * max(1.0, float(mx.abs(b).max()))


def assert_same_caches(ours: list, ref: list, length: int) -> None:
    """Rotating caches: the whole buffer, offset and write index; KV caches: rows and offset.
    Cache 0 (a rotating cache in every family here: K/V of the embeddings) bit for bit."""
    from dflash.backends.mlx_rotating import is_rotating

    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.offset == b.offset == length, (i, a.offset, b.offset, length)
        if is_rotating(b):
            assert is_rotating(a) and a._idx == b._idx, (i, a._idx, b._idx)
            ka, kb, va, vb = a.keys, b.keys, a.values, b.values
        else:
            rows = (..., slice(0, length), slice(None))
            ka, kb, va, vb = a.keys[rows], b.keys[rows], a.values[rows], b.values[rows]
        exact = i == 0 and ON_CPU
        assert same(ka, kb, exact) and same(va, vb, exact), f"cache {i}"


def test_rotating_caches_are_detected(sliding):
    family, pipe, _, _ = sliding
    assert pipe.backend.rotating_indices == ROTATING[family] and pipe.backend.gdn_indices == []


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_untrained_draft_greedy_parity(sliding, block_size, pipelined, monkeypatch):
    _, pipe, _, truth = sliding
    if not pipelined:
        monkeypatch.setattr(pipe.backend, "device_loop", None)  # the host loop
    got = pipe.generate(PROMPT, block_size=block_size, max_new_tokens=N, stop_ids=[])
    assert got.token_ids == truth[:N]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_scripted_schedules_leave_one_by_one_caches(sliding, schedule, block_size):
    """The host loop (sampling, --block-size auto): after every verify the caches equal those
    of one-by-one decoding."""
    _, pipe, target, truth = sliding
    be = ScriptedBackend(pipe.backend, truth, len(PROMPT), schedule)
    ref = Reference(target, PROMPT)
    committed: list[int] = []
    for r in speculative_generate(be, PROMPT, block_size=block_size, max_new_tokens=N):
        committed += r.tokens
        assert committed == truth[: len(committed)]
        if r.finish_reason is not None:
            break
        ref.feed(committed)
        assert pipe.backend.length == ref.length
        assert_same_caches(pipe.backend.cache, ref.cache, ref.length)
    assert len(committed) == N


def script(loop, truth: list[int], schedule: list[int]) -> None:
    """The pipelined loop's drafts propose the true continuation for k positions, then wrong
    tokens (k from ``schedule``, cycled)."""
    ks: list[int] = []
    truth_dev = mx.array(truth + [0] * 32, dtype=mx.int32)

    def hook(props, anchor_pos):
        k = schedule[len(ks) % len(schedule)]
        ks.append(k)
        idx = anchor_pos - len(PROMPT) + 1 + mx.arange(props.shape[0], dtype=mx.int32)
        true = mx.take(truth_dev, idx)
        return mx.where(mx.arange(props.shape[0]) < k, true, (true + 1) % 1000)

    loop.proposals_hook = hook


@pytest.mark.parametrize("schedule", [[15, 0, 3, 0, 0, 15], [0]])
def test_pipelined_reads_leave_one_by_one_caches(sliding, schedule, monkeypatch):
    """The pipelined step: right after each read (the rollback) the caches equal those of
    one-by-one decoding, before the next verify is queued."""
    _, pipe, target, truth = sliding
    be = pipe.backend
    loop = be.device_loop
    ref = Reference(target, PROMPT)
    committed = truth[:1]  # the prefill's token, yielded before the first read
    checked: list[int] = []
    original = type(loop).read

    def read(slot):
        new = original(loop, slot)
        committed.extend(new)
        ref.feed(committed)
        assert be.length == ref.length
        assert_same_caches(be.cache, ref.cache, ref.length)
        checked.append(len(new))
        return new

    monkeypatch.setattr(loop, "read", read)
    script(loop, truth, schedule)
    try:
        rounds = list(speculative_generate(be, PROMPT, block_size=16, max_new_tokens=N))
    finally:
        del loop.proposals_hook
    assert [t for r in rounds for t in r.tokens] == truth[:N]
    assert len(checked) == len(rounds) - 1 >= 3


def test_growing_ring_with_a_prompt_shorter_than_the_window(tmp_path, monkeypatch):
    """Until a ring reaches its window, one-token decoding grows it ``step`` rows at a time (256 in
    mlx-lm; 4 here): the rollback replays mlx-lm's own one-token write there."""
    from mlx_lm.models.cache import RotatingKVCache

    import dflash

    monkeypatch.setattr(RotatingKVCache, "step", 4)
    target = build_target(tmp_path / "target", "gpt_oss")  # window 24
    pipe = dflash.load(str(target), str(build_draft(tmp_path / "draft", target)), backend="mlx")
    prompt = PROMPT[:6]
    truth = greedy_reference(target, prompt, 40)
    be = ScriptedBackend(pipe.backend, truth, len(prompt), [0, 2, 0, 15])
    ref = Reference(target, prompt)
    committed: list[int] = []
    for r in speculative_generate(be, prompt, block_size=4, max_new_tokens=36):
        committed += r.tokens
        if r.finish_reason is not None:
            break
        ref.feed(committed)
        assert_same_caches(pipe.backend.cache, ref.cache, ref.length)
    assert committed == truth[:36]


@pytest.mark.slow
def test_cli_init_draft_and_generate_match_mlx_lm(sliding, tmp_path):
    """As a new user: ``dflash init-draft`` for the target, then ``dflash generate mlx --json``
    at block sizes 4 and 16 gives mlx-lm's greedy ids."""
    import json
    import os
    import subprocess
    import sys

    family, pipe, target, _ = sliding
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DFLASH_DEBUG": ""}
    draft = tmp_path / "draft"
    init = [sys.executable, "-m", "dflash", "init-draft", "--target", str(target), "--out", str(draft),
            "--layers", "1"]  # fmt: skip
    p = subprocess.run(init, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and (draft / "config.json").exists(), p.stderr
    ids = pipe.chat_prompt([{"role": "user", "content": " ".join(f"w{i}" for i in range(5, 45))}])
    assert len(ids) > 24  # longer than every window
    want = greedy_reference(target, ids, 20)
    for block in (4, 16):
        cmd = [sys.executable, "-m", "dflash", "generate", "mlx", " ".join(f"w{i}" for i in range(5, 45)),
               "--model", str(target), "--draft", str(draft), "--block-size", str(block),
               "--max-new-tokens", "20", "--json"]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr
        got = json.loads(p.stdout)["token_ids"]
        stops = set(pipe.stop_ids)
        cut = next((i + 1 for i, t in enumerate(want) if t in stops), 20)
        assert got == want[:cut] and len(got) >= 8, (got, want)
