"""The mlx backend's pipelined greedy step (dflash.backends.mlx_loop): the same ids as mlx-lm's
greedy decoding, scripted accept schedules give exact per-step counts, one host read per step,
the draft cache ends as the host loop leaves it, and the mlx CLI path never imports torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from dflash.backends.mlx_loop import accept_step  # noqa: E402
from dflash.loop import speculative_generate  # noqa: E402
from tests.helpers.mlx_models import build_draft, build_target, greedy_reference, random_prompt  # noqa: E402

PROMPT = random_prompt(12)
N = 60


@pytest.fixture(scope="module", params=["qwen3", "qwen3_next"])
def pair(request, tmp_path_factory):
    """(pipeline, target folder, greedy truth) for a dense and a hybrid family."""
    import dflash

    root = tmp_path_factory.mktemp(request.param)
    target = build_target(root / "target", request.param)
    draft = build_draft(root / "draft", target)
    pipe = dflash.load(str(target), str(draft), backend="mlx")
    return pipe, target, greedy_reference(target, PROMPT, N + 20)


def script(loop, truth: list[int], schedule: list[int], block: int) -> list[int]:
    """Make the loop's drafts propose the true continuation for k positions, then wrong tokens
    (k from ``schedule``, cycled); returns the list the ks are appended to."""
    ks: list[int] = []
    truth_dev = mx.array(truth + [0] * 32, dtype=mx.int32)

    def hook(props, anchor_pos):
        k = schedule[len(ks) % len(schedule)]
        ks.append(k)
        idx = anchor_pos - len(PROMPT) + 1 + mx.arange(props.shape[0], dtype=mx.int32)
        true = mx.take(truth_dev, idx)
        return mx.where(mx.arange(props.shape[0]) < k, true, (true + 1) % 1000)

    loop.proposals_hook = hook
    return ks


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_device_loop_runs_and_matches_mlx_lm(pair, block_size):
    pipe, _, truth = pair
    loop = pipe.backend.device_loop
    before = (loop.launched, loop.reads)
    got = pipe.generate(PROMPT, block_size=block_size, max_new_tokens=N, stop_ids=[])
    assert got.token_ids == truth[:N]
    steps = len(got.acceptance_lengths)
    assert loop.launched - before[0] == steps  # every verify went through the device loop
    assert loop.reads - before[1] == steps  # one host read per step


@pytest.mark.parametrize("schedule", [[15, 0, 3, 0, 0, 15], [0], [15], [2, 7, 1, 11]])
def test_scripted_schedules_exact_counts_and_draft_cache(pair, schedule):
    pipe, _, truth = pair
    be = pipe.backend
    ks = script(be.device_loop, truth, schedule, 16)
    try:
        rounds = list(speculative_generate(be, PROMPT, block_size=16, max_new_tokens=N))
    finally:
        del be.device_loop.proposals_hook
    assert [t for r in rounds for t in r.tokens] == truth[:N]
    n = 1
    for r, k in zip(rounds[1:], ks, strict=False):
        assert r.accepted == min(k + 1, N - n, 16)
        n += r.accepted
    assert n == N
    # the draft cache holds committed rows only (rejected ones dropped), as the host loop's
    ours = snapshot(be.draft_cache)
    saved, be.device_loop = be.device_loop, None
    try:
        list(speculative_generate(be, PROMPT, block_size=16, max_new_tokens=N))
    finally:
        be.device_loop = saved
    host = snapshot(be.draft_cache)
    for (f1, k1), (f2, k2) in zip(ours, host, strict=True):
        assert f1 == f2 == 0 and k1.shape[2] <= len(PROMPT) + N - 1
        m = min(k1.shape[2], k2.shape[2])
        assert m >= len(PROMPT) + N - 1 - 2 * 16
        np.testing.assert_allclose(np.array(k1[:, :, :m]), np.array(k2[:, :, :m]), atol=1e-4)


def snapshot(cache) -> list:
    return [(cache.first[i], cache.keys[i]) for i in range(len(cache.keys))]


def test_one_host_read_per_step(pair, monkeypatch):
    """Per verify step exactly one device-to-host read; no other mx.eval than the first token's."""
    pipe, _, truth = pair
    loop = pipe.backend.device_loop
    script(loop, truth, [3, 0, 15], 16)
    reads: list[int] = []
    evals: list[int] = []
    original = type(loop).host_read
    monkeypatch.setattr(loop, "host_read", lambda row: reads.append(1) or original(loop, row))
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: evals.append(1) or real_eval(*a))
    try:
        rounds = list(speculative_generate(pipe.backend, PROMPT, block_size=16, max_new_tokens=N))
    finally:
        del loop.proposals_hook
    steps = len(rounds) - 1
    assert steps > 3 and len(reads) == steps
    assert len(evals) == 2  # prefill: its first chunk, and the read of the first token


def test_accept_step_matches_host_rule():
    from dflash.accept import accept_greedy

    rng = np.random.default_rng(0)
    for width in (1, 2, 5, 16):
        for _ in range(20):
            target = rng.integers(0, 5, size=width)
            props = np.where(
                rng.random(width - 1) < 0.7, target[:-1], rng.integers(0, 5, size=width - 1)
            )
            logits = np.full((width, 5), -1.0, dtype=np.float32)
            logits[np.arange(width), target] = 1.0
            row, bonus = accept_step(mx.array(logits), mx.array(props.astype(np.int32)))
            a, b = accept_greedy(props.tolist(), target.tolist())
            row = row.tolist()
            assert row[0] == a + 1 and row[1 : 1 + a + 1] == props[:a].tolist() + [b]
            assert bonus.tolist() == [b]


def test_mlx_cli_does_not_import_torch(tmp_path):
    """`dflash generate mlx` and `dflash benchmark mlx` run without torch in the process."""
    target = build_target(tmp_path / "target", "qwen3")
    draft = build_draft(tmp_path / "draft", target)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w5 w6 w7"}) + "\n")
    code = (
        "import sys, runpy\n"
        "sys.argv = ['dflash'] + sys.argv[1:]\n"
        "try:\n"
        "    runpy.run_module('dflash', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "print('TORCH', sys.modules.get('torch') is not None, 'mlx_lm' in sys.modules)\n"
    )
    common = ["--model", str(target), "--draft", str(draft), "--max-new-tokens", "8"]
    for args in (["generate", "mlx", "w5 w6", *common],
                 ["benchmark", "mlx", "--dataset", str(prompts), *common]):  # fmt: skip
        out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                             timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert "TORCH False True" in out.stdout, out.stdout[-500:]


def test_step_bench_script_runs_on_the_tiny_shape():
    """scripts/mlx_step_bench.py (the GPU per-step figures) runs on CPU at --shape tiny."""
    from pathlib import Path

    script_path = Path(__file__).resolve().parents[3] / "scripts" / "mlx_step_bench.py"
    out = subprocess.run([sys.executable, str(script_path), "--shape", "tiny", "--steps", "4",
                          "--context", "32", "--reps", "2"], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["dflash_steps"] == 4 and res["ratio"] > 0
    assert set(res["draft_ms"]) == {"none", "8", "4"} and res["verify_ms"] > 0


@pytest.mark.parametrize(
    "layer_types,is_causal,window,draft_window",
    [(["full_attention", "full_attention"], None, None, None),
     (["sliding_attention", "full_attention", "sliding_attention"], None, 5, None),
     (["full_attention", "sliding_attention"], True, 3, None),
     (["full_attention", "full_attention"], None, None, 7)],
)  # fmt: skip
def test_ahead_draft_equals_the_host_draft(layer_types, is_causal, window, draft_window):
    """The pipelined draft over W verify rows with `valid` committed (the rest masked, dropped
    after the read) gives the host draft's hidden states over the `valid` rows, and leaves the
    same context cache."""
    from mlx.utils import tree_flatten

    from dflash.models.config import DraftConfig
    from dflash.models.draft_mlx import DFlashDraftMLX, random_draft_mlx

    h, w, block = 64, 8, 8
    cfg = DraftConfig(hidden_size=h, intermediate_size=128, num_hidden_layers=len(layer_types),
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                      mask_token_id=299, target_layer_ids=[1, 3], block_size=block,
                      layer_types=layer_types, sliding_window=window, is_causal=is_causal,
                      rope={"rope_theta": 10000.0})  # fmt: skip
    base = random_draft_mlx(cfg, std=0.1)
    host, ahead = DFlashDraftMLX(cfg, window=draft_window), DFlashDraftMLX(cfg, window=draft_window)
    host.load_weights(tree_flatten(base.parameters()))
    ahead.load_weights(tree_flatten(base.parameters()))
    hc, ac = host.new_cache(), ahead.new_cache()
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.normal(size=(1, 11, 2 * h)).astype(np.float32))
    emb0 = mx.array(rng.normal(size=(1, block, h)).astype(np.float32))
    np.testing.assert_array_equal(
        np.array(host(emb0, prompt, 11, hc)), np.array(ahead(emb0, prompt, 11, ac))
    )
    start = 11  # the anchor of the verify whose rows come next
    for valid in (1, 8, 3, 5, 2):
        rows = mx.array(rng.normal(size=(1, w, 2 * h)).astype(np.float32))
        emb = mx.array(rng.normal(size=(1, block, h)).astype(np.float32))
        want = host(emb, rows[:, :valid], start + valid, hc)
        got = ahead.ahead(emb, rows, start, mx.array(valid, dtype=mx.int32), ac)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=0)
        ac.drop_tail(w - valid)
        for i in range(len(layer_types)):
            assert (ac.first[i], ac.length(i)) == (hc.first[i], hc.length(i))
            np.testing.assert_allclose(np.array(ac.keys[i]), np.array(hc.keys[i]), atol=1e-6)
        start += valid


def test_stop_inside_a_block_and_exact_budgets(pair):
    pipe, _, truth = pair
    be = pipe.backend
    i = next(j for j in range(3, N) if truth[j] not in truth[:j])
    script(be.device_loop, truth, [15], 16)
    try:
        rounds = list(
            speculative_generate(be, PROMPT, block_size=16, max_new_tokens=N, stop_ids=[truth[i]])
        )
        assert [t for r in rounds for t in r.tokens] == truth[: i + 1]
        assert rounds[-1].finish_reason == "stop"
        for max_new in (1, 2, 16, 17, 31):
            rounds = list(speculative_generate(be, PROMPT, block_size=16, max_new_tokens=max_new))
            assert [t for r in rounds for t in r.tokens] == truth[:max_new]
            assert rounds[-1].finish_reason == "length"
    finally:
        del be.device_loop.proposals_hook
