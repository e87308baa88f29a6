"""MLX backend on tiny random dense targets: greedy parity with mlx-lm, scripted schedules,
budget/stop edges, sampling distribution, load-time refusals."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from dflash.loop import speculative_generate  # noqa: E402
from dflash.types import SamplingParams  # noqa: E402
from tests.helpers.mlx_models import MlxScriptedBackend as ScriptedBackend  # noqa: E402
from tests.helpers.mlx_models import build_draft, build_target, greedy_reference, random_prompt  # noqa: E402
from tests.helpers.stats import tv  # noqa: E402

PROMPT = random_prompt(12)
N = 60


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def dense(request, tmp_path_factory):
    """(pipeline, target folder, greedy truth) for one dense family."""
    import dflash

    root = tmp_path_factory.mktemp(request.param)
    target = build_target(root / "target", request.param)
    draft = build_draft(root / "draft", target)
    pipe = dflash.load(str(target), str(draft), backend="mlx")
    return pipe, target, greedy_reference(target, PROMPT, N + 20)


@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_untrained_draft_greedy_parity(dense, block_size):
    pipe, _, truth = dense
    got = pipe.generate(PROMPT, block_size=block_size, max_new_tokens=N, stop_ids=[])
    assert got.token_ids == truth[:N]
    assert sum(got.acceptance_lengths) + 1 == N


@pytest.mark.parametrize("schedule", [[15, 0, 3, 0, 0, 15], [0, 0, 0], [15], [1, 2, 3, 4, 5, 6, 7]])
def test_scripted_schedule_parity_and_stats(dense, schedule):
    pipe, _, truth = dense
    be = ScriptedBackend(pipe.backend, truth, len(PROMPT), schedule)
    rounds = list(speculative_generate(be, PROMPT, block_size=16, max_new_tokens=N))
    assert [t for r in rounds for t in r.tokens] == truth[:N]
    n = 1
    ks = iter(be.expected_k)
    for r in rounds[1:]:
        k = next(ks) if r.proposed > 0 else 0
        assert r.accepted == min(k + 1, N - n)
        n += r.accepted
    assert n == N and rounds[-1].finish_reason == "length"


def test_stop_token_inside_a_block_and_exact_budget(dense):
    pipe, _, truth = dense
    i = next(j for j in range(3, N) if truth[j] not in truth[:j])
    be = ScriptedBackend(pipe.backend, truth, len(PROMPT), [15])
    rounds = list(speculative_generate(be, PROMPT, block_size=16, max_new_tokens=N,
                                       stop_ids=[truth[i]]))  # fmt: skip
    assert [t for r in rounds for t in r.tokens] == truth[: i + 1]
    assert rounds[-1].finish_reason == "stop"
    for max_new in (1, 2, 16, 17):
        rounds = list(speculative_generate(be, PROMPT, block_size=16, max_new_tokens=max_new))
        assert [t for r in rounds for t in r.tokens] == truth[:max_new]


def test_features_are_layer_outputs_and_last_layer_is_normed(dense):
    """Features = outputs of layers[L] (HF hidden_states[L+1]); the last layer's is normed."""
    pipe, _, _ = dense
    from dflash.backends import mlx_hooks

    be = pipe.backend
    saved = be.layer_ids
    try:
        be.layer_ids = [0, len(be.layers) - 1]
        mlx_hooks.hook_layers(be.layers, be.layer_ids)
        be.reset()
        _, feats = be.prefill(PROMPT, with_features=True)
        x = be.embed(mx.array([PROMPT]))
        from mlx_lm.models.base import create_attention_mask

        mask = create_attention_mask(x, None)
        outs = []
        for layer in be.layers:
            x = layer(x, mask, None)
            outs.append(x)
        want = mx.concatenate([outs[0], be.inner.norm(outs[-1])], axis=-1)[0]
        np.testing.assert_allclose(np.array(feats), np.array(want), atol=1e-5)
    finally:
        be.layer_ids = saved
        mlx_hooks.hook_layers(be.layers, saved)


def test_sampling_distribution_matches_target():
    """Tokens emitted by the loop at T > 0 follow the processed target distribution (TV < 0.01)
    at the first position after a verify step, over a 16-word vocabulary."""
    from dflash.accept import accept_sampling
    from dflash.sampling import sample, sampling_probs

    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.95)
    logits = mx.array(rng.normal(0, 2, size=(3, 16)).astype(np.float32))
    p = sampling_probs(np.array(logits), params)  # the MLX logits through the shared transform
    counts = np.zeros(16)
    for _ in range(50_000):
        a, bonus = accept_sampling([int(np.argmax(p[0]))], p[:2], None, rng)
        counts[int(np.argmax(p[0])) if a else bonus] += 1
    assert tv(counts, p[0]) < 0.01
    assert sample(p[0], rng) in range(16)


def test_sampling_through_the_backend_is_seeded(dense):
    pipe, _, _ = dense
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    a = pipe.generate(PROMPT, block_size=8, max_new_tokens=20, sampling=sp).token_ids
    b = pipe.generate(PROMPT, block_size=8, max_new_tokens=20, sampling=sp).token_ids
    assert a == b and len(a) == 20


def test_block_size_above_the_draft_is_refused(dense):
    from dflash.errors import InputError

    pipe, _, _ = dense
    with pytest.raises(InputError, match="exceeds the draft's trained block size"):
        pipe.generate(PROMPT, block_size=17, max_new_tokens=4)


def test_draft_bits_4_loads_and_keeps_parity(dense, tmp_path):
    import dflash

    pipe, target, truth = dense
    draft = build_draft(tmp_path / "d", target)
    q = dflash.load(str(target), str(draft), backend="mlx", draft_bits=4, draft_window=8)
    assert "scales" in q.backend.draft_model.fc
    assert q.generate(PROMPT, max_new_tokens=24, stop_ids=[]).token_ids == truth[:24]
    # --block-size auto reads this draft's acceptance.json; measured costs are cached per
    # device, dtype, target, draft and its quantization (not one table for every mlx pair)
    assert str(q.draft_dir) == str(draft) and str(pipe.draft_dir) != str(draft)
    key, plain = q.cost_key, pipe.cost_key
    assert key["draft_bits"] == 4 and key["draft_window"] == 8 and plain["draft_bits"] is None
    assert key["draft"] == str(draft) and key["target"] and key["dtype"] and key["device"]


def test_reference_generate_is_mlx_lm_greedy_and_benchmark_records_it(dense):
    """The benchmark's mlx_lm baseline yields exactly mlx-lm's greedy ids; the harness stores it
    beside the block-1 baseline and reports the speedup against it."""
    from dflash.bench.harness import BenchConfig, run_benchmark
    from dflash.bench.metrics import summarize
    from dflash.data.datasets import PromptItem

    pipe, _, truth = dense
    ref = pipe.reference_generate(PROMPT, max_new_tokens=N)
    # mlx-lm stops at an EOS id; a random target may emit one (truth was decoded without stops)
    stops = set(pipe.stop_ids)
    cut = next((i + 1 for i, t in enumerate(truth[:N]) if t in stops), N)
    assert ref.token_ids == truth[:cut]
    assert ref.finish_reason == ("stop" if cut < N else "length")
    cfg = BenchConfig(max_new_tokens=24, check_parity=True, warmup=False)
    recs = run_benchmark(pipe, {"t": [PromptItem(id="a", turns=["w5 w6 w7"])]}, cfg)["t"]
    n_ref = recs[0].reference.new_tokens
    assert 1 <= n_ref <= 24 and recs[0].parity is True
    s = summarize(recs)
    assert s["reference_tokens"] == n_ref and s["speedup_vs_reference"] > 0


@pytest.mark.slow
def test_cli_generate_mlx_json_and_one_line_errors(dense, tmp_path):
    """``dflash generate mlx --json`` as a user runs it; bad MLX flags are one-line errors."""
    import json
    import os
    import subprocess
    import sys

    pipe, target, truth = dense
    draft = build_draft(tmp_path / "d", target)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DFLASH_DEBUG": ""}
    base = [sys.executable, "-m", "dflash", "generate", "mlx", "w5 w6 w7", "--model", str(target),
            "--draft", str(draft)]  # fmt: skip
    p = subprocess.run(base + ["--max-new-tokens", "12", "--json", "--draft-bits", "8"],
                       capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    ids = pipe.chat_prompt([{"role": "user", "content": "w5 w6 w7"}])
    assert out["token_ids"] == pipe.reference_generate(ids, max_new_tokens=12).token_ids[:12]
    assert len(out["token_ids"]) <= 12 and out["block_size"] == "auto"  # the default
    p = subprocess.run(base + ["--draft-bits", "3"], capture_output=True, text=True, env=env,
                       timeout=300)  # fmt: skip
    assert p.returncode == 1 and p.stderr.startswith("error: --draft-bits must be 4 or 8"), p.stderr
