"""``--block-size auto``: the chooser against analytic optima, online adaptation with a scripted
draft, greedy parity for every choice, context bookkeeping after plain steps, cost cache."""

from __future__ import annotations

import json

import pytest
import torch

from dflash.auto_block import (
    AcceptancePrior,
    BlockPolicy,
    CostTable,
    expected_tau,
    load_acceptance,
    load_or_measure_costs,
    measure_costs,
    monotone,
    write_acceptance,
)
from dflash.errors import ConfigError
from dflash.loop import speculative_generate
from tests.helpers.tiny import PROMPT, ScriptedBackend

B = 16


pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread (tests/conftest.py)


def linear_costs(verify_base, verify_per_tok, draft_base, draft_per_tok, widths=range(1, B + 1)):
    """A synthetic cost table: verify(L) = a + b L, draft(L) = c + d L (seconds)."""
    return CostTable({w: verify_base + verify_per_tok * w for w in widths},
                     {w: draft_base + draft_per_tok * w for w in widths if w > 1})  # fmt: skip


def analytic_best(p: float, cost) -> int:
    """argmax_L τ(L)/c(L) with τ(L) = (1 - p^L) / (1 - p) for a constant rate p (geometric sum);
    ties go to the smaller L."""
    best, best_rate = 1, 0.0
    for n in range(1, B + 1):
        tau = float(n) if p == 1 else (1 - p**n) / (1 - p)
        rate = tau / cost(n)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = n, rate
    return best


@pytest.mark.parametrize("p", [0.0, 0.3, 0.6, 0.8, 0.95, 1.0])
@pytest.mark.parametrize(
    "shape",
    [(1.0, 0.01, 0.3, 0.0), (1.0, 0.2, 0.5, 0.05), (1.0, 1.0, 0.3, 0.1), (2.0, 0.05, 0.0, 0.0)],
    ids=["gpu-flat", "mid", "cpu-steep", "free-draft"],
)
def test_chooser_picks_the_analytic_optimum(p, shape):
    a, b, c, d = shape
    table = linear_costs(a, b, c, d)
    policy = BlockPolicy(table, AcceptancePrior(B, [p] * (B - 1)), B, probe_every=0)

    def cost(n):
        return a + b * n + (c + d * n if n > 1 else 0.0)

    want = analytic_best(p, cost)
    assert policy.choose(remaining=1000) == want
    assert expected_tau([p] * (B - 1), want) == pytest.approx(
        want if p == 1 else (1 - p**want) / (1 - p)
    )


def test_chooser_known_cases_and_limits():
    flat = linear_costs(1.0, 0.0, 0.1, 0.0)
    perfect = AcceptancePrior(B, [1.0] * (B - 1))
    assert BlockPolicy(flat, perfect, B).choose(1000) == 16  # everything accepted, flat cost
    assert BlockPolicy(flat, perfect, B).choose(5) == 5  # never past the budget
    assert BlockPolicy(flat, AcceptancePrior(B, [0.0] * (B - 1)), B).choose(1000) == 1
    # graph path: only captured widths
    assert BlockPolicy(flat, perfect, B, widths=(1, 4, 8)).choose(1000) == 8
    assert BlockPolicy(flat, perfect, B, widths=(1, 4, 8)).choose(7) == 4
    # a draft dearer than the tokens it can win: plain decoding
    dear = linear_costs(1.0, 0.0, 10.0, 0.0)  # τ(16) = 8.1 tokens for 11 s < 1 tok/s
    assert BlockPolicy(dear, AcceptancePrior(B, [0.9] * (B - 1)), B).choose(1000) == 1
    # p = (0.9, 0.9, 0, ...): τ(3) = 1 + 0.9 + 0.81 = 2.71 and nothing past 3 can pay
    step = BlockPolicy(flat, AcceptancePrior(B, [0.9, 0.9] + [0.0] * 13), B)
    assert step.choose(1000) == 3
    assert step.history[-1].tau == pytest.approx(2.71)
    # the draft always at its trained width: one draft cost for every L > 1
    fixed = BlockPolicy(linear_costs(1.0, 0.0, 0.0, 1.0), perfect, B, draft_width=16)
    assert fixed.step_cost[2] == fixed.step_cost[16] == pytest.approx(1.0 + 16.0)


def test_observe_is_an_ema_of_reached_positions():
    policy = BlockPolicy(linear_costs(1, 0, 0, 0), AcceptancePrior(B, [0.5] * (B - 1)), B,
                         alpha=0.5)  # fmt: skip
    policy.choose(100)
    policy.observe(accepted=2, proposed=7)  # positions 1, 2 passed, 3 failed, 4.. not reached
    assert policy.rates[:4] == [0.75, 0.75, 0.25, 0.5]
    scale = (0.75 + 0.75 + 0.25) / 1.5  # how the reached positions moved from the start
    assert policy.effective_rates()[3:5] == [pytest.approx(0.5 * scale)] * 2
    policy.observe(accepted=7, proposed=7)  # first visits start from the scaled rate
    assert policy.rates[6] == pytest.approx(0.5 * (0.5 * scale) + 0.5)
    assert policy.rates[7] == 0.5 and policy.reached[7] == 0  # position 8 was not proposed


def test_monotone_cost_fit():
    assert monotone({1: 3.0, 2: 1.0, 4: 5.0}) == {1: 2.0, 2: 2.0, 4: 5.0}
    assert monotone({1: 1.0, 2: 2.0}) == {1: 1.0, 2: 2.0}
    table = CostTable({1: 1.0, 4: 4.0})
    assert table.step_s(2) == pytest.approx(2.0) and table.step_s(9) == 4.0


class DropBackend(ScriptedBackend):
    """A scripted draft that is right at every position until ``drop_at`` new tokens, and wrong
    from the first position afterwards."""

    def __init__(self, inner, truth, prompt_len, drop_at):
        super().__init__(inner, truth, prompt_len, [15])
        self.drop_at, self.lengths = drop_at, []

    def draft(self, anchor, context, start, length):
        self.lengths.append(length)
        self.schedule = [15] if start - self.prompt_len < self.drop_at else [0]
        return super().draft(anchor, context, start, length)


def test_chosen_block_follows_a_drop_in_acceptance(tiny_backend, truth):
    costs = linear_costs(1.0, 0.05, 0.3, 0.0)  # GPU-like: a wide verify costs little more
    prior = AcceptancePrior(B, [0.7] * (B - 1))
    be = DropBackend(tiny_backend, truth, len(PROMPT), drop_at=80)
    policy = BlockPolicy(costs, prior, B, probe_every=0)
    rounds = list(speculative_generate(be, PROMPT, block_size=B, max_new_tokens=160, policy=policy))
    assert [t for r in rounds for t in r.tokens] == truth[:160]
    chosen = [c.block_size for c in policy.history]
    steps = [r for r in rounds if r.accepted is not None]
    assert len(chosen) == len(steps)
    produced, before, after = 1, [], []
    for c, r in zip(chosen, steps, strict=True):
        (before if produced < 80 else after).append(c)
        produced += r.accepted
    assert before[0] >= 4 and max(before) >= 12  # a good draft grows the block
    assert after[-5:] == [1] * 5  # once every proposal fails, plain decoding
    # EMA (alpha 0.15) forgets 0.95 -> 0.3 in about 7-14 steps; then, this request having
    # drafted more than SWITCH_EVIDENCE steps, held drafted steps confirm the switch: at L = 2
    # (where it ends) n = floor(3 x c(1) / (c(2) - c(1))) = floor(3 x 1.05 / 0.35) = 9 steps in
    # a row must predict plain, so at most 8 held
    held = [i for i, c in enumerate(policy.history) if c.held]
    assert 1 <= len(held) <= 8 and chosen[held[-1]] == 2 and chosen[held[-1] + 1] == 1
    assert after.index(1) - len(held) <= 16


def test_a_good_draft_grows_a_pessimistic_start(tiny_backend, truth):
    costs = linear_costs(1.0, 0.05, 0.3, 0.0)
    be = DropBackend(tiny_backend, truth, len(PROMPT), drop_at=10**6)
    policy = BlockPolicy(costs, AcceptancePrior(B, [0.35] * (B - 1)), B, probe_every=0)
    rounds = list(speculative_generate(be, PROMPT, block_size=B, max_new_tokens=120, policy=policy))
    assert [t for r in rounds for t in r.tokens] == truth[:120]
    chosen = [c.block_size for c in policy.history]
    assert chosen[0] < 8 and max(chosen) == B


def test_probe_after_plain_steps(tiny_backend, truth):
    costs = linear_costs(1.0, 0.05, 0.3, 0.0)
    be = DropBackend(tiny_backend, truth, len(PROMPT), drop_at=0)  # never right
    policy = BlockPolicy(costs, AcceptancePrior(B, [0.0] * (B - 1)), B, probe_every=10)
    rounds = list(speculative_generate(be, PROMPT, block_size=B, max_new_tokens=60, policy=policy))
    assert [t for r in rounds for t in r.tokens] == truth[:60]
    chosen = [c.block_size for c in policy.history]
    probes = [i for i, c in enumerate(policy.history) if c.probe]
    # no evidence yet: the first probe at the 2nd step; then 10 plain steps, then 20 (doubled)
    assert probes == [1, 11, 31] and all(chosen[i] > 1 for i in probes)
    assert chosen.count(1) == len(chosen) - 3


def test_probe_gap_doubles_while_probes_fail_and_resets_when_drafting_resumes():
    policy = BlockPolicy(linear_costs(1.0, 0.05, 0.3, 0.0), AcceptancePrior(B, [0.0] * 15), B,
                         alpha=1.0, probe_every=4, first_probe=2)  # fmt: skip
    script = {29: True, 30: False}  # step -> the draft right everywhere (True) or nowhere
    for step in range(60):
        width = policy.choose(1000)
        if width > 1:
            policy.observe(width - 1 if script.get(step) else 0, width - 1)
    chosen = [c.block_size for c in policy.history]
    probes = [i for i, c in enumerate(policy.history) if c.probe]
    # the probe is the gap-th step of a plain run: 2 before any evidence, then 4, 8, 16 while
    # probes fail; the probe at 29 succeeds (drafting at 30), 30 fails, then the gap is the
    # regular 4 again (34; not the early 2), 8 (42), 16 (58)
    assert probes == [1, 5, 13, 29, 34, 42, 58]
    assert [i for i, w in enumerate(chosen) if w > 1] == [1, 5, 13, 29, 30, 34, 42, 58]


def scripted_choices(policy, right_until, steps=40):
    """Drive ``policy`` without a model: the draft is right everywhere before step
    ``right_until`` and wrong from its first position afterwards."""
    for step in range(steps):
        width = policy.choose(1000)
        if width > 1:
            policy.observe(width - 1 if step < right_until else 0, width - 1)
    return [c.block_size for c in policy.history]


@pytest.mark.parametrize(
    ("draft_s", "confirm"),
    [(0.7, 4), (1.7, 1)],  # a drafted step 1.7x a plain one (H200-like): floor(3 / 0.7) = 4;
    ids=["gpu-like", "cpu-like"],  # 2.7x (CPU-like): floor(3 / 1.7) = 1, the switch at once
)
def test_switch_to_plain_is_confirmed_where_drafted_steps_are_cheap(draft_s, confirm):
    costs = linear_costs(1.0, 0.0, draft_s, 0.0)
    prior = AcceptancePrior(B, [0.9] * (B - 1))
    policy = BlockPolicy(costs, prior, B, alpha=1.0, probe_every=0)
    chosen = scripted_choices(policy, right_until=20)
    # alpha 1: the first rejection (step 20) makes plain decoding predicted faster; drafting
    # goes on for confirm - 1 held steps (at L = 2: with p_1 = 0 every drafted width predicts
    # τ = 1 at one cost, the narrowest wins the tie), then plain to the end
    assert chosen[:21] == [B] * 21
    assert chosen[21:] == [2] * (confirm - 1) + [1] * (40 - 21 - (confirm - 1))
    assert [i for i, c in enumerate(policy.history) if c.held] == list(range(21, 20 + confirm))
    assert policy.confirm_steps(policy.predict(B)) == confirm
    # before the request has drafted SWITCH_EVIDENCE (16) steps, and with switch_budget 0,
    # the switch is immediate
    early = scripted_choices(BlockPolicy(costs, prior, B, alpha=1.0, probe_every=0), 5)
    assert early == [B] * 6 + [1] * 34
    off = BlockPolicy(costs, prior, B, alpha=1.0, probe_every=0, switch_budget=0)
    assert scripted_choices(off, 20) == [B] * 21 + [1] * 19


def test_held_steps_end_when_the_draft_recovers():
    policy = BlockPolicy(linear_costs(1.0, 0.0, 0.7, 0.0), AcceptancePrior(B, [0.9] * (B - 1)),
                         B, alpha=1.0, probe_every=0)  # fmt: skip
    script = [True] * 20 + [False, False, True] + [False] * 10
    for right in script:
        width = policy.choose(1000)
        if width > 1:
            policy.observe(width - 1 if right else 0, width - 1)
    chosen = [c.block_size for c in policy.history]
    # rejections at 20 and 21, held at 21 and 22, right again at 22: drafting on its own merits
    # at 23, then the doubt counts from zero again (held 24-26, plain from 27)
    assert [c.held for c in policy.history[20:27]] == [False, True, True, False, True, True, True]
    assert chosen[:21] == [B] * 21 and chosen[21:23] == [2, 2] and chosen[23] == B
    assert chosen[24:27] == [2] * 3 and chosen[27:] == [1] * 6


def test_plain_runs_skip_features_until_the_probe(tiny_backend, truth, monkeypatch):
    import dflash.auto_block as ab

    monkeypatch.setattr(ab, "FEATURE_LEAD", 4)
    be = ContextCheck(tiny_backend, strict=False)
    calls = []
    verify = tiny_backend.verify

    def spy(anchor, proposals, start, with_features):
        calls.append(with_features)
        return verify(anchor, proposals, start, with_features)

    monkeypatch.setattr(tiny_backend, "verify", spy)
    policy = BlockPolicy(linear_costs(1.0, 0.05, 0.3, 0.0), AcceptancePrior(B, [0.0] * 15), B,
                         probe_every=10, first_probe=10)  # fmt: skip
    rounds = list(speculative_generate(be, PROMPT, block_size=B, max_new_tokens=40, policy=policy))
    assert [t for r in rounds for t in r.tokens] == truth[:40]
    # until the draft has seen the prompt every step keeps features; the first probe (step
    # 10) fails, so the next comes after 20 plain steps: 15 without features, 4 with
    assert calls[:10] == [True] * 10
    assert calls[10:30] == [False] * 15 + [True] * 4 + [True]
    assert policy.history[9].probe and policy.history[29].probe
    cached, rows, start = be.calls[1]  # the second probe: the 4 latest rows, ending at start
    assert rows == 4 and cached < start - rows


class CyclePolicy:
    """Not a chooser: forces L = schedule[i] (cut to the budget), to test every choice."""

    def __init__(self, schedule):
        self.schedule, self.i, self.seen = schedule, 0, []

    def choose(self, remaining):
        n = min(self.schedule[self.i % len(self.schedule)], remaining)
        self.i += 1
        return n

    def observe(self, accepted, proposed):
        self.seen.append((accepted, proposed))

    def needs_features(self):
        return True


class ContextCheck:
    """Wraps the dynamic backend; asserts the draft always receives every committed row once."""

    draft_head_rows = False  # the wrapped draft returns its whole block

    def __init__(self, inner, strict=True):
        self.inner, self.proposals, self.strict, self.calls = inner, [], strict, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, anchor, context, start, length):
        cache = self.inner.draft_cache
        cached = 0 if cache.keys[0] is None else cache.keys[0].shape[2]
        rows = sum(c.shape[0] for c in context) if isinstance(context, list) else context.shape[0]
        assert cached + rows == start or not self.strict, (cached, rows, start)
        self.calls.append((cached, rows, start))
        out = self.inner.draft(anchor, context, start, length)
        self.proposals.append(out[0].tolist())
        return out


SCHEDULE = [1, 1, 16, 1, 3, 2, 1, 1, 1, 5, 8, 1, 4, 16, 7]


@pytest.mark.parametrize("greedy", [True, False])
def test_every_choice_is_lossless_and_feeds_all_context(tiny_backend, truth, greedy):
    from dflash.types import SamplingParams

    be, policy = ContextCheck(tiny_backend), CyclePolicy(SCHEDULE)
    sp = SamplingParams() if greedy else SamplingParams(temperature=0.9, seed=5)
    rounds = list(speculative_generate(be, PROMPT, block_size=B, max_new_tokens=90,
                                       sampling=sp, policy=policy))  # fmt: skip
    tokens = [t for r in rounds for t in r.tokens]
    assert len(tokens) == 90
    if greedy:
        assert tokens == truth[:90]
    assert [p for _, p in policy.seen] == [r.proposed for r in rounds if r.accepted is not None]


def test_static_path_after_plain_steps_matches_the_dynamic_one(tiny_target, tiny_backend, truth):
    """The static backend re-reads by position; after plain steps it must catch up exactly as
    the dynamic one (same draft weights -> the same proposals at every step)."""
    from dflash.backends.static.backend import StaticBackend

    static = StaticBackend(tiny_target, tiny_backend.draft_model, torch.device("cpu"),
                           use_graphs=False)  # fmt: skip
    runs = []
    for be in (ContextCheck(tiny_backend), static):
        recorded = []
        orig = be.draft

        def draft(anchor, context, start, length, orig=orig, recorded=recorded):
            out = orig(anchor, context, start, length)
            recorded.append(out[0].tolist())
            return out

        be.draft = draft
        toks = [t for r in speculative_generate(be, PROMPT, block_size=B, max_new_tokens=90,
                                                policy=CyclePolicy(SCHEDULE)) for t in r.tokens]  # fmt: skip
        assert toks == truth[:90]
        runs.append(recorded)
    assert runs[0] == runs[1]


def test_measure_costs_and_cache(tiny_backend, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    widths = [1, 2, 4, 16]
    table = measure_costs(tiny_backend, widths, prompt_len=32, repeats=1)
    assert sorted(table.verify_s) == widths and sorted(table.draft_s) == [2, 4, 16]
    values = [table.verify_s[w] for w in widths]
    assert all(v > 0 for v in values) and values == sorted(values)
    key = {"backend": "tiny", "device": "cpu"}
    first = load_or_measure_costs(tiny_backend, key, widths)
    files = list((tmp_path / "costs").glob("*.json"))
    assert first.source == "measured" and len(files) == 1
    assert json.loads(files[0].read_text())["key"]["widths"] == widths
    assert capsys.readouterr().err.count("dflash: measuring step costs at widths 1, 2, 4, 16") == 1
    again = load_or_measure_costs(tiny_backend, key, widths)
    assert again.source == "cache" and again.verify_s == first.verify_s
    assert "measuring" not in capsys.readouterr().err  # read from the cache: silent
    assert (
        load_or_measure_costs(tiny_backend, {**key, "device": "other"}, widths).source == "measured"
    )


def test_acceptance_file_round_trip(tmp_path):
    assert load_acceptance(tmp_path, 16).source == "prior"
    assert load_acceptance(None, 4).rates == [0.5, 0.5, 0.5]
    write_acceptance(tmp_path, [0.8, None, 0.6], 4, "unit test")
    got = load_acceptance(tmp_path, 6)
    assert got.rates == [0.8, 0.8, 0.6, 0.6, 0.6] and got.source == "unit test"
    assert load_acceptance(tmp_path, 3).rates == [0.8, 0.8]
    (tmp_path / "acceptance.json").write_text('{"position_acceptance": [1.5]}')
    with pytest.raises(ConfigError):
        load_acceptance(tmp_path, 4)


def test_acceptance_written_by_train_with_unreached_positions_loads(tmp_path):
    """``dflash train`` writes null for positions its held-out data never reached; such a draft
    must still run with --block-size auto (it was refused as an invalid file)."""
    from dflash.train.checkpoint import write_acceptance as train_write

    train_write(tmp_path, {"tau": 1.2, "per_position": [None, 0.4, None, 0.3, None],
                           "responses": 1}, 6, 3)  # fmt: skip
    got = load_acceptance(tmp_path, 6)
    assert got.rates == [0.5, 0.4, 0.4, 0.3, 0.3] and got.block_size == 6
    assert got.source.endswith("dflash train")


def test_acceptance_source_names_the_rates_used(tmp_path):
    (tmp_path / "acceptance.json").write_text(json.dumps({
        "position_acceptance": [0.7], "position_acceptance_source": "benchmark",
        "per_position": [0.2], "source": "train"}))  # fmt: skip
    got = load_acceptance(tmp_path, 2)
    assert got.rates == [0.7] and got.source == "benchmark"


def test_demo_draft_ships_its_acceptance():
    from dflash.models.target_torch import DEMO_DRAFT_DIR

    prior = load_acceptance(DEMO_DRAFT_DIR, 16)
    assert prior.block_size == 16 and len(prior.rates) == 15 and prior.source
    assert all(0.0 <= r <= 1.0 for r in prior.rates)
    assert 1.0 < expected_tau(prior.rates, 16) < 16.0  # the draft accepts something, not all


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_pipeline_default_is_auto(tiny_backend, truth, tmp_path, monkeypatch):
    from dflash.api import Pipeline

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    pipe = Pipeline(tiny_backend, FakeTokenizer(), [], "tiny", cost_key={"test": "tiny"})
    pipe.costs = linear_costs(1.0, 0.05, 0.3, 0.0)  # skip timing: a GPU-like table
    res = pipe.generate(PROMPT, max_new_tokens=40)
    assert res.token_ids == truth[:40] and res.block_size == "auto"
    steps = res.block_policy["steps"]
    assert len(steps) == res.verify_steps
    assert [s["block_size"] - 1 for s in steps] == res.proposed
    assert res.block_policy["acceptance_source"] == "prior"
    assert pipe.generate(PROMPT, max_new_tokens=10, block_size=4).block_policy is None
    with pytest.raises(Exception, match="auto or an integer"):
        pipe.resolve_block_size("fast")


def test_python_api_misuse_raises_input_errors(tiny_backend, truth, tmp_path, monkeypatch):
    """Common Python API mistakes give one InputError naming the fix, before any work."""
    import numpy as np

    from dflash.api import Pipeline
    from dflash.errors import InputError

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    pipe = Pipeline(tiny_backend, FakeTokenizer(), [], "tiny", cost_key={"test": "tiny"})
    pipe.costs = linear_costs(1.0, 0.05, 0.3, 0.0)
    for bad in (4.5, True, [4]):
        with pytest.raises(InputError, match="auto or an integer"):
            pipe.generate(PROMPT, max_new_tokens=8, block_size=bad)
    with pytest.raises(InputError, match="SamplingParams"):
        pipe.generate(PROMPT, max_new_tokens=8, block_size=4, sampling={"temperature": 0.7})
    with pytest.raises(InputError, match="must be an integer"):
        pipe.generate(PROMPT, max_new_tokens=8.0, block_size=4)
    with pytest.raises(InputError, match="must be >= 1"):
        list(pipe.stream(PROMPT, max_new_tokens=0, block_size=4))
    for bad in ("Hi", ["Hi"], [{"content": "Hi"}]):
        with pytest.raises(InputError, match="list of chat messages"):
            pipe.chat_prompt(bad)
    with pytest.raises(InputError, match="chat_prompt got no messages"):  # not a template error (user trial)
        pipe.chat_prompt([])
    # numpy integers are integers
    assert pipe.generate(PROMPT, max_new_tokens=np.int64(6), block_size=np.int64(4)).token_ids == truth[:6]


def test_auto_does_not_calibrate_for_one_token_or_bad_input(tiny_backend, truth, tmp_path, monkeypatch):
    """One new token comes from the prefill (no step, so no block size to choose), and a bad
    prompt fails before the costs are measured (a minute on a small CPU)."""
    from dflash.api import Pipeline
    from dflash.errors import InputError

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    pipe = Pipeline(tiny_backend, FakeTokenizer(), [], "tiny", cost_key={"test": "tiny"})

    def no_calibration():
        raise AssertionError("calibrated")

    monkeypatch.setattr(pipe, "calibrate", no_calibration)
    res = pipe.generate(PROMPT, max_new_tokens=1)
    assert res.token_ids == truth[:1] and res.verify_steps == 0 and res.block_policy is None
    assert [r.tokens for r in pipe.stream(PROMPT, max_new_tokens=1)] == [truth[:1]]
    with pytest.raises(InputError, match="empty"):
        pipe.generate([], max_new_tokens=8)


def test_benchmark_block_size_list():
    from dflash.bench.command import parse_block_sizes
    from dflash.errors import InputError

    assert parse_block_sizes(None) == [None]
    assert parse_block_sizes("auto, 1,4,16") == ["auto", 1, 4, 16]
    for bad in ("0", "4,4", "x", "4,,8"):
        with pytest.raises(InputError):
            parse_block_sizes(bad)


def test_generate_block_size_option_and_verbose_line(capsys):
    from dflash.commands import parse_block_size, print_step
    from dflash.errors import InputError
    from dflash.types import RoundResult

    assert parse_block_size("auto") == "auto" and parse_block_size(" 8 ") == 8
    for bad in ("0", "-3", "big", "4,8"):
        with pytest.raises(InputError):
            parse_block_size(bad)
    policy = BlockPolicy(linear_costs(0.010, 0.001, 0.002, 0.0), AcceptancePrior(B, [0.0] * 15), B)
    policy.choose(50)
    print_step(1, RoundResult(tokens=[5], accepted=1, proposed=0), policy)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[auto: cost table measured now]"  # where it comes from (issue 51)
    assert lines[1].startswith("[auto: step cost ms by L 1:11.0 2:14.0")
    assert lines[2] == "[step 1: L=1 predicted τ 1.00 cost 11.0 ms (90.9 tok/s) -> committed 1]"


class RowsSpy:
    """Wraps the dynamic backend; records the (width, rows) of every draft call."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, anchor, context, start, length, rows=None):
        self.calls.append((length, rows))
        return self.inner.draft(anchor, context, start, length, rows=rows)


def test_draft_head_runs_on_the_verified_rows_only(tiny_backend, truth):
    """``rows=k`` returns the first k of the full block's proposals; the loop asks for L-1 rows
    of a trained-width draft, the costs are timed the same way, and the output stays greedy."""
    be = tiny_backend
    assert be.draft_head_rows
    full = []
    for rows in (None, 5, 1):
        be.reset(len(PROMPT) + 40)
        _, feats = be.prefill(PROMPT, True)
        ids, logits = be.draft(PROMPT[-1], feats, len(PROMPT), B, rows=rows)
        assert ids.shape[0] == (rows or B - 1) and logits.shape[0] == ids.shape[0]
        full = full or ids.tolist()
        assert ids.tolist() == full[: ids.shape[0]]
    spy, policy = RowsSpy(be), CyclePolicy(SCHEDULE)
    rounds = list(speculative_generate(spy, PROMPT, block_size=B, max_new_tokens=60, policy=policy))
    assert [t for r in rounds for t in r.tokens] == truth[:60]
    drafted = [r.proposed for r in rounds if r.accepted is not None and r.proposed]
    assert spy.calls == [(B, p) for p in drafted]
    spy.calls = []
    measure_costs(spy, [1, 2, 4], prompt_len=16, repeats=1)
    assert sorted(set(spy.calls)) == [(B, 1), (B, 3)]


def test_timed_steps_correct_the_costs_and_the_choice_follows():
    """The table says a drafted step costs 2 plain ones; the steps really take 3. With
    p = 0.6, τ(L) tops out below 2.5: drafting pays at 2x and not at 3x, so a policy that
    times its steps switches to plain decoding, and a later request on the same table starts
    from the corrected costs. Without a clock the table is left alone."""
    costs = linear_costs(1.0, 0.0, 1.0, 0.0)  # plain 1 s, drafted 2 s at every width
    prior = AcceptancePrior(B, [0.6] * (B - 1))
    now = [0.0]

    def run(policy, steps):
        chosen = []
        for _ in range(steps):
            width = policy.choose(1000)
            chosen.append(width)
            now[0] += 3.0 if width > 1 else 1.0  # what the step really took
        return chosen

    assert BlockPolicy(costs, prior, B, probe_every=0).choose(1000) > 1  # the table: draft
    first = run(BlockPolicy(costs, prior, B, probe_every=0, clock=lambda: now[0]), 40)
    assert first[0] > 1 and first[-1] == 1  # learned that drafting does not pay
    switch = first.index(1)
    assert costs.scale["drafted"] == pytest.approx(1.5 - 0.5 * 0.9**switch, rel=1e-6)
    assert costs.scale["plain"] == pytest.approx(1.0)  # plain steps took what the table said
    assert BlockPolicy(costs, prior, B, probe_every=0).choose(1000) == 1  # the next request
    untimed = linear_costs(1.0, 0.0, 1.0, 0.0)
    assert set(run(BlockPolicy(untimed, prior, B, probe_every=0), 10)) != {1}
    assert untimed.scale == {"plain": 1.0, "drafted": 1.0}


def test_timed_plain_steps_end_a_plain_run_only_at_a_probe():
    """Plain steps that take longer than the table says make drafting look better mid-run;
    drafting must still resume only at a probe, after steps that kept target features (the
    draft has nothing to read otherwise)."""
    costs = linear_costs(1.0, 0.0, 2.0, 0.0)  # plain 1 s, drafted 3 s: p = 0.6 never pays
    policy = BlockPolicy(costs, AcceptancePrior(B, [0.6] * (B - 1)), B, probe_every=10,
                         clock=lambda: now[0])  # fmt: skip
    now, widths, features = [0.0], [], []
    for _ in range(60):
        widths.append(policy.choose(1000))
        features.append(policy.needs_features())
        now[0] += 2.0 if widths[-1] == 1 else 3.0  # plain steps take twice the table's cost
        if widths[-1] > 1:
            policy.observe(1, widths[-1] - 1)  # the probe keeps finding p_1 = 1, p_2 = 0
    assert costs.scale["plain"] > 1.5  # plain steps timed at twice the table
    resumed = [i for i in range(1, 60) if widths[i] > 1 and widths[i - 1] == 1]
    assert resumed and all(policy.history[i].probe and features[i - 1] for i in resumed)


def test_seeded_sample_under_auto_repeats_whatever_the_timings(tiny_backend, truth, tmp_path, monkeypatch):
    """User trial (serve): the same seed gave different text from request to request under
    auto, as timed steps moved the shared costs and with them the widths (each width draws its
    own random numbers). A seeded sampled request now prices widths with the calibrated table
    alone: the same widths and tokens after the table's online scale moved; an unseeded or
    greedy request still times its steps."""
    from dflash.api import Pipeline
    from dflash.types import SamplingParams

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    pipe = Pipeline(tiny_backend, FakeTokenizer(), [], "tiny", cost_key={"test": "tiny"})
    pipe.costs = linear_costs(1.0, 0.05, 0.3, 0.0)
    sampling = SamplingParams(temperature=0.8, seed=7)

    def run():
        res = pipe.generate(PROMPT, max_new_tokens=40, sampling=sampling)
        return res.token_ids, [s["block_size"] for s in res.block_policy["steps"]]

    first = run()
    assert pipe.last_policy.clock is None and pipe.costs.scale == {"plain": 1.0, "drafted": 1.0}
    pipe.costs.scale["drafted"] = 4.0  # as if earlier requests timed drafted steps 4x dearer
    assert run() == first
    assert max(first[1]) > 1  # it drafted, where the moved scale would now choose plain
    greedy = pipe.generate(PROMPT, max_new_tokens=40)
    assert greedy.token_ids == truth[:40] and pipe.last_policy.clock is not None
    unseeded = SamplingParams(temperature=0.8, seed=None)
    pipe.generate(PROMPT, max_new_tokens=8, sampling=unseeded)
    assert pipe.last_policy.clock is not None
