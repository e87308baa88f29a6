"""Batched speculative decoding (continuous batching, eager on the CPU, float32): every row's ids
equal that row decoded alone and plain greedy decoding, with ragged prompts, scripted accept
schedules (zero accept, full blocks, mixed), stops, budgets, rows joining and leaving mid-run,
widths changing step by step; sampled rows follow the target's distribution and their seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash.auto_block_batch import BatchCosts, BatchPolicy
from dflash.backends.static.batched_spec import BatchedSpec, SpecJob
from dflash.errors import InputError
from dflash.types import SamplingParams
from tests.helpers.batched_spec import ScriptedJob, ScriptedSpec
from tests.helpers.stats import tv
from tests.helpers.tiny import custom_draft, make_draft, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = 8


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama()
    return target, make_draft(target, block_size=BLOCK)


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]  # fmt: skip


def hf_greedy(model, p: list[int], new: int) -> list[int]:
    ids = list(p)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(p) :]


@pytest.fixture(scope="module")
def cases(pair):
    """7 prompts, their 40 greedy tokens (HF), budgets, schedules, a stop id some rows emit."""
    ps = prompts(7)
    truth = [hf_greedy(pair[0], p, 40) for p in ps]
    budgets = [30, 5, 40, 1, 19, 33, 12]
    scheds = [
        [BLOCK - 1],
        [0],
        [3, 0, BLOCK - 1, 1],
        [2],
        [5, 6],
        [BLOCK - 1, BLOCK - 1, 0],
        [1, 4],
    ]
    stop = truth[2][6]
    return ps, truth, budgets, scheds, stop


def jobs_of(cases, stops: bool) -> tuple[list[ScriptedJob], list[list[int]]]:
    ps, truth, budgets, scheds, stop = cases
    jobs, want = [], []
    for i, (p, t, m, s) in enumerate(zip(ps, truth, budgets, scheds, strict=True)):
        own = (stop,) if stops and i % 2 == 0 else ()
        jobs.append(ScriptedJob(p, m, own, truth=p + t, schedule=s))
        full = t[:m]
        want.append(full[: full.index(stop) + 1] if own and stop in full else full)
    return jobs, want


@pytest.mark.parametrize("stops", [False, True])
def test_rows_equal_alone_and_greedy_with_joins_and_leaves(pair, cases, stops):
    jobs, want = jobs_of(cases, stops)
    seen: dict[int, list] = {}
    spec = ScriptedSpec(*pair, max_batch=3, capacity=96, kv_bucket=32)  # 7 jobs through 3 rows
    got = dict(
        spec.run_jobs(jobs, block_size=BLOCK, on_step=lambda i, s: seen.setdefault(i, []).append(s))
    )
    assert sorted(got) == list(range(7))
    alone = ScriptedSpec(*pair, max_batch=1, capacity=96, kv_bucket=32)
    for i, j in enumerate(jobs):
        assert got[i] == want[i], i
        assert dict(alone.run_jobs([j], block_size=BLOCK))[0] == want[i], i
    # the scripts were followed: accepted = min(k, trimmed width - 1) until a stop cuts the step
    for i, steps in seen.items():
        sched = jobs[i].schedule
        for n, s in enumerate(steps[1:]):
            if s.finish != "stop":
                assert s.accepted == min(sched[n % len(sched)], s.proposed), (i, n)
    if stops:
        assert any(w[-1] == cases[4] for w in want) and any(cases[4] not in w for w in want)


def test_zero_accept_full_blocks_and_width_changes_each_step(pair, cases):
    """Widths 1 (plain), 8, 3, 1, 1, ... per step: the draft context catches up after plain
    runs (longer than the draft's block) and ids stay those of greedy decoding."""
    jobs, want = jobs_of(cases, stops=False)
    plan = [1, BLOCK, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, BLOCK, 1, 4]
    step = iter(range(10**6))
    spec = ScriptedSpec(*pair, max_batch=4, capacity=96, kv_bucket=32)
    got = dict(spec.run_jobs(jobs, block_size=lambda rows: plan[next(step) % len(plan)]))
    assert [got[i] for i in range(7)] == want
    plain = dict(
        BatchedSpec(*pair, max_batch=4, capacity=96, kv_bucket=32).run_jobs(jobs, block_size=1)
    )
    assert [plain[i] for i in range(7)] == want
    assert want[0] == hf_greedy(pair[0], jobs[0].prompt_ids, 30)


def test_draft_own_proposals_and_chooser(pair, cases):
    """The random draft's own proposals (acceptance ~0) under the chooser: same ids."""
    ps, truth, budgets, _, _ = cases
    pol = BatchPolicy(BatchCosts({4: {1: 1.0, 2: 1.2, 4: 1.5, BLOCK: 2.0}}), BLOCK)
    spec = BatchedSpec(*pair, max_batch=4, capacity=96, kv_bucket=32)

    def observe(i, s):
        if s.accepted is not None and s.proposed:
            pol.observe(s.row, s.accepted, s.proposed)

    got = dict(spec.run_jobs([SpecJob(p, m) for p, m in zip(ps, budgets, strict=True)],
                             block_size=lambda rows: pol.choose(rows), on_step=observe))  # fmt: skip
    assert [got[i] for i in range(7)] == [t[:m] for t, m in zip(truth, budgets, strict=True)]
    assert pol.history[0] == 2 and pol.history[-1] == 1  # the prior drafts; rejections stop it


def test_sampled_rows_keep_their_seed_in_any_batch(pair, cases):
    ps = cases[0]
    samp = [SamplingParams(temperature=0.8, top_k=20 if i % 2 else 0, top_p=0.9 if i % 3 == 0 else 1.0, seed=100 + i)
            for i in range(4)]  # fmt: skip
    jobs = [ScriptedJob(p, 12, sampling=s, truth=p + t, schedule=[3, 1])
            for p, s, t in zip(ps[:4], samp, cases[1], strict=False)]  # fmt: skip
    jobs.append(
        ScriptedJob(ps[4], 12, truth=ps[4] + cases[1][4], schedule=[2])
    )  # greedy among them
    together = dict(
        ScriptedSpec(*pair, max_batch=5, capacity=96, kv_bucket=32).run_jobs(jobs, block_size=4)
    )
    alone = ScriptedSpec(*pair, max_batch=1, capacity=96, kv_bucket=32)
    for i, j in enumerate(jobs):
        assert dict(alone.run_jobs([j], block_size=4))[0] == together[i], i
    assert together[4] == cases[1][4][:12]
    assert len({tuple(v) for v in together.values()}) == 5


def test_sampling_matches_the_target_distribution(pair):
    """The 2nd and 3rd tokens of 600 seeded rows (drafted at width 4, proposals the greedy
    continuation: accepts and rejections both happen) against the exact marginals."""
    target, draft = pair
    prompt, temp = [5, 17, 42, 7], 1.3
    greedy = hf_greedy(target, prompt, 6)
    n = 600
    jobs = [ScriptedJob(prompt, 3, sampling=SamplingParams(temperature=temp, seed=s), truth=prompt + greedy,
                        schedule=[3]) for s in range(n)]  # fmt: skip
    got = dict(
        ScriptedSpec(target, draft, max_batch=60, capacity=32, kv_bucket=16).run_jobs(
            jobs, block_size=4
        )
    )
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1] / temp, -1)  # [V]
        seqs = torch.tensor([prompt + [x] for x in range(256)])
        p2 = torch.softmax(target(seqs).logits[:, -1] / temp, -1)  # [V, V] p(x2 | x1)
    exact = (p1[:, None] * p2).sum(0).numpy()
    counts = np.bincount([got[i][1] for i in range(n)], minlength=256).astype(float)
    rng = np.random.default_rng(0)
    noise = sorted(
        tv(rng.multinomial(n, exact / exact.sum()).astype(float), exact) for _ in range(200)
    )
    assert (
        tv(counts, exact) < noise[189] * 1.25
    )  # within the 95th percentile of pure sampling noise


def test_bad_jobs_are_refused(pair):
    spec = BatchedSpec(*pair, max_batch=2, capacity=32, kv_bucket=16)
    with pytest.raises(InputError):
        spec.admit([SpecJob(list(range(3, 40)), 4)])
    with pytest.raises(InputError):
        spec.admit([SpecJob([5, 6], 4)] * 3)
    with pytest.raises(InputError):
        BatchedSpec(pair[0], None)


@pytest.mark.parametrize("chunk", [64, 5])
def test_draft_context_after_plain_steps_equals_a_fresh_write(pair, cases, chunk):
    """After 12 plain steps (more than the draft's block) and one drafted step, every row's
    draft context K/V at positions < its anchor equal those written from its features at once
    (the catch-up in one chunk, or in chunks of 5 positions)."""
    ps = cases[0][:3]
    spec = BatchedSpec(*pair, max_batch=3, capacity=96, kv_bucket=32, prefill_chunk=chunk)
    spec.admit([SpecJob(p, 40) for p in ps])
    for _ in range(-(-12 // spec.plain_steps)):  # each call: plain_steps plain steps
        spec.step(1)
    assert spec.h_pos[0] - spec.h_seen[0] >= 12
    before = list(spec.h_pos[:3])
    spec.step(BLOCK)
    fresh = type(spec.dcache)(len(pair[1].layers), 3, spec.dcache.keys[0].shape[1], spec.slots,
                              spec.dcache.keys[0].shape[3], spec.dtype, spec.device)  # fmt: skip
    for r, n in enumerate(before):
        pos = torch.arange(n)[None]
        fresh.rows, fresh.write_pos, fresh.width, fresh.gather = torch.tensor([r]), pos, n, True
        with torch.no_grad():
            pair[1].write_context(spec.feats[r : r + 1, :n], pos, fresh)
        for got, want in zip(
            spec.dcache.keys + spec.dcache.values, fresh.keys + fresh.values, strict=True
        ):
            torch.testing.assert_close(got[r, :, :n], want[r, :, :n], rtol=1e-5, atol=1e-6)


def test_forced_truth_is_committed_with_the_scripted_acceptance(pair):
    """The speed runs' ``force``: rows commit their truth (here not the target's continuation)
    and accept exactly min(k, width - 1) per step."""
    g = torch.Generator().manual_seed(3)
    ps = prompts(3, seed=9)
    truth = [torch.randint(3, 250, (30,), generator=g).tolist() for _ in ps]
    jobs = [
        ScriptedJob(p, 20, truth=p + t, schedule=[2, 7, 0]) for p, t in zip(ps, truth, strict=True)
    ]
    seen: dict[int, list] = {}
    spec = ScriptedSpec(*pair, max_batch=3, capacity=96, kv_bucket=32, force=True)
    got = dict(
        spec.run_jobs(jobs, block_size=BLOCK, on_step=lambda i, s: seen.setdefault(i, []).append(s))
    )
    for i, t in enumerate(truth):
        assert got[i][1:] == t[1:20]  # the first token comes from the prefill (not forced)
        assert [s.accepted for s in seen[i][1:]] == [
            min(k, s.proposed) for k, s in zip([2, 7, 0] * 9, seen[i][1:], strict=False)
        ]


def demo_like_target():
    """A tiny target set like the demo's where the shared one is not: GQA ratio 3 (6:2), tied
    embeddings, a rope base of 100000, eps 1e-5 and random (not all-ones) norm weights (every
    norm applied twice is a no-op at weight one, so the shared target hid a double final norm)."""
    target = tiny_llama(3, num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
                        tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5)  # fmt: skip
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, w in target.named_parameters():
            if name.endswith("norm.weight"):
                w.copy_(0.5 + torch.rand(w.shape, generator=g) * 1.5)
    return target


def test_demo_like_target_rows_and_features_equal_hf():
    """A demo-like target (see :func:`demo_like_target`) whose draft reads the last layer too:
    the features equal HF's ``hidden_states`` (the last one final-normed) and every row's ids,
    plain (width 1) and drafted (scripted), equal HF greedy decoding, alone and together."""
    target = demo_like_target()
    draft = custom_draft(target, target_layer_ids=[0, 3, 5], block_size=BLOCK, mask_token_id=255)
    ps = prompts(3, seed=5)
    truth = [hf_greedy(target, p, 12) for p in ps]
    spec = BatchedSpec(target, draft, max_batch=3, capacity=64, kv_bucket=16)
    spec.admit([SpecJob(ps[0], 12)])
    with torch.no_grad():
        hs = target(torch.tensor([ps[0]]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[i + 1][0] for i in (0, 3, 5)], -1)
    torch.testing.assert_close(spec.feats[0, : len(ps[0])], want, rtol=1e-5, atol=1e-5)
    for width in (1, BLOCK):
        jobs = [ScriptedJob(p, 12, truth=p + t, schedule=[2, BLOCK - 1, 0])
                for p, t in zip(ps, truth, strict=True)]  # fmt: skip
        got = dict(ScriptedSpec(target, draft, max_batch=3, capacity=64, kv_bucket=16)
                   .run_jobs(jobs, block_size=width))  # fmt: skip
        assert [got[i] for i in range(3)] == truth, width
        alone = ScriptedSpec(target, draft, max_batch=1, capacity=64, kv_bucket=16)
        assert dict(alone.run_jobs(jobs[:1], block_size=width))[0] == truth[0], width


@pytest.mark.slow
def test_demo_target_row_alone_equals_greedy(demo_pipe):
    """The demo target (float32, CPU) through one batched row, plain (width 1) and drafted by
    the untrained draft (width 4), gives its greedy ids."""
    target = demo_pipe.backend.target
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = demo_pipe.chat_prompt(messages)[:16]
    truth = hf_greedy(target, prompt, 6)
    draft = demo_pipe.backend.draft_model
    engine = BatchedSpec(target, draft, max_batch=2, capacity=256, use_graphs=False)
    for width in (1, 4):
        assert dict(engine.run_jobs([SpecJob(prompt, 6)], block_size=width))[0] == truth, width


def test_plain_mode_runs_no_draft_and_one_call_per_plain_steps(pair, cases, monkeypatch):
    """Width 1 everywhere (the chooser's "no drafting"): the draft never runs (neither its
    forward nor its context writes, prefill included), each call commits up to ``plain_steps``
    tokens per row in one replay and host read, and greedy and seeded sampled rows give the ids
    of one plain step per call."""
    ps, truth, budgets, _, _ = cases
    samp = [SamplingParams(temperature=0.9, top_k=30 if i % 2 else 0, seed=40 + i) if i % 3 else SamplingParams()
            for i in range(7)]  # fmt: skip
    jobs = [SpecJob(p, m, sampling=s) for p, m, s in zip(ps, budgets, samp, strict=True)]
    one = dict(BatchedSpec(*pair, max_batch=3, capacity=96, kv_bucket=32, plain_steps=1)
               .run_jobs(jobs, block_size=1))  # fmt: skip

    def no_draft(*a, **k):
        raise AssertionError("the draft ran in a plain step")

    monkeypatch.setattr(pair[1], "forward", no_draft)
    monkeypatch.setattr(pair[1], "write_context", no_draft)
    spec = BatchedSpec(*pair, max_batch=3, capacity=96, kv_bucket=32, plain_steps=4)
    assert dict(spec.run_jobs(jobs, block_size=1)) == one
    for i in (0, 3, 6):  # greedy rows: the target's greedy ids
        assert one[i] == truth[i][: budgets[i]]
    alone = BatchedSpec(*pair, max_batch=1, capacity=96, kv_bucket=32, plain_steps=4)
    seen = []
    dict(alone.run_jobs([jobs[2]], block_size=1, on_step=lambda i, s: seen.append(len(s.tokens))))
    assert (
        seen == [1] + [4] * 9 + [3] and alone.steps_run == 10
    )  # 40 tokens: prefill, then 4 a call


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_prefill_gives_the_same_rows(pair, cases, chunk):
    """Prompts prefilled in chunks of 1, 5 or 64 positions (joins padded to their rows bucket
    by other free rows) give the features of HF's hidden states and the greedy ids."""
    jobs, want = jobs_of(cases, stops=False)
    spec = ScriptedSpec(*pair, max_batch=4, capacity=96, kv_bucket=32, prefill_chunk=chunk)
    got = dict(spec.run_jobs(jobs, block_size=BLOCK))
    assert [got[i] for i in range(7)] == want
    fresh = BatchedSpec(*pair, max_batch=4, capacity=96, kv_bucket=32, prefill_chunk=chunk)
    p = cases[0][2]  # 3 rows: padded to 4 by the free row 3
    fresh.admit([SpecJob(p, 4), SpecJob(cases[0][0], 4), SpecJob(cases[0][1], 4)])
    with torch.no_grad():
        hs = pair[0](torch.tensor([p]), output_hidden_states=True).hidden_states
    ids = pair[1].config.target_layer_ids
    want_f = torch.cat([hs[i + 1][0] for i in ids], -1)
    torch.testing.assert_close(
        fresh.feats[0, : len(p)], want_f, rtol=1e-4, atol=2e-4
    )  # GEMM shapes differ
