"""DFlash2 drafts on the MLX backend: the checkpoint torch reads, the candidate selector on the
device. One tiny qwen3 target (written by mlx-lm in the HF layout, so transformers loads it too)
and an untrained DFlash2 draft (non-trivial convolutions, output multiplier, soft cap and
embedding scale) in float32: torch and mlx propose the same tokens at every step, give the same
ids, and those equal plain greedy decoding; the selector's candidates, edge scores, greedy walk
and sampling q equal torch's. mlx runs on its CPU device here (Metal rounds differently from
torch's CPU; the default device is restored afterwards)."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
torch = pytest.importorskip("torch")
pytest.importorskip("mlx_lm")

from dflash.backends.base import SelectorProposal  # noqa: E402
from dflash.loop import speculative_generate  # noqa: E402
from dflash.types import SamplingParams  # noqa: E402
from tests.helpers.mlx_models import build_target, greedy_reference, random_prompt  # noqa: E402

PROMPT = random_prompt(12, seed=5)
N = 24
SETTINGS = {"selector_rank": 8, "selector_top_k": 4, "output_multiplier": 0.5,
            "final_logit_softcapping": 6.0, "input_embedding_scale": 2.0}  # fmt: skip


def save_dflash2_draft(folder, target_dir, seed: int = 0):
    """A random DFlash2 draft for the tiny target, written by the torch draft (float32)."""
    import json
    from types import SimpleNamespace

    from tests.helpers.dflash2 import draft2_for_config

    cfg = SimpleNamespace(**json.loads((target_dir / "config.json").read_text()))
    return draft2_for_config(cfg, seed=seed, mask_token_id=1, **SETTINGS).save(folder)


@pytest.fixture(scope="module", autouse=True)
def mlx_on_cpu():
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


@pytest.fixture(scope="module")
def pipes(tmp_path_factory, mlx_on_cpu):
    """(torch pipeline, mlx pipeline, mlx-lm's greedy ids)."""
    import dflash

    root = tmp_path_factory.mktemp("dflash2")
    target = build_target(root / "target", "qwen3")
    draft = save_dflash2_draft(root / "draft", target)
    tpipe = dflash.load(
        str(target), str(draft), backend="transformers", device="cpu", dtype="float32"
    )
    mpipe = dflash.load(str(target), str(draft), backend="mlx", device="cpu", dtype="float32")
    return tpipe, mpipe, greedy_reference(target, PROMPT, N)


def recorded(pipe, block_size: int, monkeypatch) -> tuple[list[int], list[list[int]]]:
    """(ids, proposals of every step) of a greedy host-loop run."""
    be = pipe.backend
    steps: list[list[int]] = []
    original = be.draft

    def draft(*args, **kwargs):
        tokens, drafted = original(*args, **kwargs)
        assert isinstance(drafted, SelectorProposal) and drafted.q is None
        steps.append([int(t) for t in tokens.tolist()])
        return tokens, drafted

    monkeypatch.setattr(be, "draft", draft)
    if hasattr(be, "device_loop"):
        monkeypatch.setattr(be, "device_loop", None)
    ids = pipe.generate(PROMPT, block_size=block_size, max_new_tokens=N, stop_ids=[]).token_ids
    monkeypatch.undo()
    return ids, steps


@pytest.mark.parametrize("block_size", [4, 16])
def test_same_proposals_and_ids_on_torch_and_mlx(pipes, block_size, monkeypatch):
    tpipe, mpipe, truth = pipes
    assert mpipe.backend.draft_uses_sampling and mpipe.backend.embed_scale == 2.0
    t_ids, t_steps = recorded(tpipe, block_size, monkeypatch)
    m_ids, m_steps = recorded(mpipe, block_size, monkeypatch)
    # the selector's path, step by step (mlx walks the verified rows only: the walk is causal)
    assert len(m_steps) == len(t_steps) >= 5
    bad = [
        (i, m, t)
        for i, (m, t) in enumerate(zip(m_steps, t_steps, strict=True))
        if m != t[: len(m)] or not m
    ]
    assert not bad, bad[:3]
    assert m_ids == t_ids == truth  # lossless: plain greedy (mlx-lm's) on both
    plain = tpipe.generate(PROMPT, block_size=1, max_new_tokens=N, stop_ids=[]).token_ids
    assert plain == truth  # transformers' greedy decoding of the same weights agrees


def test_pipelined_step_with_dflash2(pipes):
    _, mpipe, truth = pipes
    loop = mpipe.backend.device_loop
    drafted = loop.drafted
    assert mpipe.generate(PROMPT, block_size=16, max_new_tokens=N, stop_ids=[]).token_ids == truth
    assert loop.drafted > drafted  # the selector ran inside the pipelined step


def test_seeded_sampling_draws_from_the_selector(pipes):
    _, mpipe, _ = pipes
    be = mpipe.backend
    sp = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3)
    runs = [[t for r in speculative_generate(be, PROMPT, block_size=8, max_new_tokens=30, sampling=sp)
             for t in r.tokens] for _ in range(2)]  # fmt: skip
    assert runs[0] == runs[1] and len(runs[0]) == 30
    tokens, drafted = be.draft(PROMPT[-1], be.prompt_features, len(PROMPT), 16, sampling=sp)
    q, cand = np.array(drafted.q), np.array(drafted.candidates)
    assert q.shape == cand.shape == (15, 4) and np.allclose(q.sum(-1), 1.0, atol=1e-6)
    assert all(t in cand[i] for i, t in enumerate(tokens.tolist()))


def test_selector_equals_torch(tmp_path):
    """Candidates (top-k by logit, descending), edge scores, the greedy walk and the q rows of a
    sampled walk (given its picks) against the torch selector with the same weights."""
    from dflash.models.draft2_mlx import DFlash2DraftMLX, load_any_draft_mlx

    target = build_target(tmp_path / "t", "qwen3")
    folder = save_dflash2_draft(tmp_path / "d", target, seed=1)
    from dflash.models.draft_load import load_draft

    tdraft = load_draft(folder)
    mdraft = load_any_draft_mlx(folder)
    assert isinstance(mdraft, DFlash2DraftMLX)
    rng = np.random.default_rng(0)
    hidden = rng.normal(0, 1, size=(15, 64)).astype(np.float32)
    logits = rng.normal(0, 3, size=(15, 1000)).astype(np.float32)
    tsel, msel = tdraft.candidate_selector, mdraft.candidate_selector
    with torch.no_grad():
        t_cand, t_unary = tsel.candidates(torch.tensor(logits)[None])
        t_first, t_trans = tsel.edges(torch.tensor(hidden)[None], t_cand, torch.tensor([7]))
        t_picks, _ = tsel.walk(t_unary, t_first, t_trans)
    m_cand, m_unary = msel.candidates(mx.array(logits))
    m_first, m_trans = msel.edges(mx.array(hidden), m_cand, mx.array([7]))
    m_picks, _ = msel.walk(m_unary, m_first, m_trans)
    assert np.array(m_cand).tolist() == t_cand[0].tolist()
    np.testing.assert_allclose(np.array(m_first), t_first[0].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(m_trans), t_trans[0].numpy(), rtol=1e-5, atol=1e-5)
    assert np.array(m_picks).tolist() == t_picks[0].tolist()
    picks, q = msel.walk(m_unary, m_first, m_trans, temperature=0.7, key=mx.random.key(2))
    picks, q = np.array(picks), np.array(q)
    unary, first, trans = t_unary[0].numpy(), t_first[0].numpy(), t_trans[0].numpy()
    for i in range(15):
        score = unary[i] + (first if i == 0 else trans[i - 1][picks[i - 1]])
        want = np.exp((score - score.max()) / 0.7)
        np.testing.assert_allclose(q[i], want / want.sum(), rtol=1e-5, atol=1e-6)
