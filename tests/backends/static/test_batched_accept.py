"""The batched step's per-row acceptance and commit equal dflash.accept's rule row by row:
greedy steps (widths trimmed to budgets, stop cuts) and rejection sampling with fixed uniforms."""

from __future__ import annotations

import numpy as np
import torch

from dflash.accept import Uniforms, accept_sampling, greedy_step
from dflash.backends.static.batched_accept import accept_rows, commit_rows, row_probs


def random_rows(seed: int, r: int = 12, w: int = 6, v: int = 9):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(r, w, v, generator=g) * 2
    best = logits.argmax(-1)
    props = torch.randint(0, v, (r, w - 1), generator=g)
    for i in range(r):  # a prefix of i % w right proposals
        k = i % w
        props[i, :k] = best[i, :k]
    return logits, props


def test_greedy_rows_equal_greedy_step():
    for seed in range(20):
        logits, props = random_rows(seed)
        r, w, _ = logits.shape
        g = np.random.default_rng(seed)
        n = torch.tensor(g.integers(1, 5, r))
        limit = n + torch.tensor(g.integers(0, 8, r))  # 0 left: commits nothing
        stops = torch.full((r, 2), -1)
        stops[::3, 0] = int(logits[0, 2].argmax())
        state = {"tok": torch.zeros(r, dtype=torch.long), "pos": torch.full((r,), 10), "n": n.clone(),
                 "limit": limit, "live": torch.ones(r, dtype=torch.bool), "done": torch.zeros(r, dtype=torch.bool),
                 "stops": stops, "last": torch.zeros(r, 1 + w, dtype=torch.long)}  # fmt: skip
        lim = (torch.minimum(limit - n, torch.full_like(n, w)) - 1).clamp(min=0)
        acc, bonus = accept_rows(logits, props, lim)
        commit_rows(acc, bonus, props, w, state)
        for i in range(r):
            want = greedy_step(props[i].tolist(), logits[i].argmax(-1).tolist(), block_size=w,
                               generated=int(n[i]), max_new_tokens=int(limit[i]),
                               stops={s for s in stops[i].tolist() if s >= 0})  # fmt: skip
            count = int(state["last"][i, 0])
            assert state["last"][i, 1 : 1 + count].tolist() == want.tokens, (seed, i)
            assert int(state["n"][i]) == want.generated and int(state["pos"][i]) == 10 + count
            if int(limit[i]) > int(n[i]):  # (a row out of budget is done already: not stepped)
                assert bool(state["done"][i]) == (want.finish is not None)


def test_sampled_rows_equal_accept_sampling():
    for seed in range(20):
        logits, props = random_rows(seed)
        r, w, v = logits.shape
        g = np.random.default_rng(seed)
        temp = torch.tensor(g.uniform(0.5, 1.5, r), dtype=torch.float32)
        top_k = torch.tensor(g.integers(0, 6, r))
        top_p = torch.tensor(g.choice([1.0, 0.8, 0.5], r), dtype=torch.float32)
        unif = torch.tensor(g.random((r, w + 1)), dtype=torch.float32)
        lim = torch.tensor(g.integers(0, w, r))
        acc, bonus = accept_rows(
            logits, props, lim, {"temp": temp, "unif": unif, "top_k": top_k, "top_p": top_p}
        )
        for i in range(r):
            p = (
                row_probs(logits[i], temp[i].repeat(w), top_k[i].repeat(w), top_p[i].repeat(w))
                .double()
                .numpy()
            )
            a = int(lim[i])
            u = unif[i].double().numpy()
            want = accept_sampling(
                props[i, :a].tolist(), p[: a + 1], None, Uniforms(u[:a].tolist(), float(u[w]))
            )
            assert (int(acc[i]), int(bonus[i])) == want, (seed, i)
