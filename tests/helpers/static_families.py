"""The static (CUDA-graph) path over the tiny family targets (``target_families``), eager on the
CPU: the backend with a chosen attention, greedy runs, and the scripted-rollback check that after
every step each layer sees exactly the K rows of decoding one token at a time."""

from __future__ import annotations

import torch

from dflash.backends.static.backend import StaticBackend
from dflash.loop import speculative_generate
from tests.helpers.target_families import ScriptedRollback, greedy, one_by_one, prompt_ids
from tests.helpers.tiny import make_draft


def static(model, attention: str = "sdpa") -> StaticBackend:
    """``model`` with a random draft on the static backend, no graphs; ``attention``: "sdpa", or
    "split" for the split-KV kernel's algorithm (its torch reference on CPU)."""
    be = StaticBackend(model, make_draft(model), torch.device("cpu"), use_graphs=False)
    be.attention = attention
    return be


def run(be, prompt: list[int], block: int, n: int) -> list[int]:
    """The n greedy ids ``be`` decodes after ``prompt`` at block size ``block`` (no stop ids)."""
    rounds = speculative_generate(be, prompt, block_size=block, max_new_tokens=n, stop_ids=[])
    return [t for r in rounds for t in r.tokens]


class StaticSnapshots(ScriptedRollback):
    """ScriptedRollback over a static backend: after every rollback, per layer the K rows the
    next query (at the committed length n) can see: positions in (n - W, n) for a sliding
    layer of window W (the query's own row is written by its step), [0, n) for a full one."""

    def rollback(self, length: int) -> None:
        self.inner.rollback(length)
        rows = []
        for i, w in enumerate(self.inner.windows):
            lo = 0 if w is None else max(0, length - w + 1)
            rows.append((lo, self.inner.k[i][:, :, lo:length].clone()))
        self.snapshots.append((length, rows))


def one_by_one_kv(model, ids: list[int], prompt_len: int) -> dict[int, list[torch.Tensor]]:
    """Committed length n -> per layer the keys [1, Hkv, n, D] of every position < n, from a
    forward of the prompt and then one token at a time through an HF cache that keeps all rows
    (so sliding layers' older rows are there too); only the layers that own K/V are cached."""
    from transformers import DynamicCache

    def keys(cache) -> list[torch.Tensor]:
        return [layer.keys.clone() for layer in cache.layers]

    return one_by_one(model, ids, prompt_len, keys, DynamicCache())  # no config: every row kept


def check_scripted_rows(model, prompt_len: int, schedules: list[list[int]]) -> None:
    """Scripted drafts on ``model``'s static backend, right for k positions per step (k from each
    schedule, cycled): the ids are plain greedy; schedule [15, 0, 3, 0, 0, 15] accepts
    [16, 1, 4, 1, 1, 16] first and [0] 1 per step; after every rollback each layer that owns its
    K/V sees exactly :func:`one_by_one_kv`'s rows (float32 rounding), and some window slid."""
    prompt = prompt_ids(prompt_len)
    truth = greedy(model, prompt, 60)
    ref = one_by_one_kv(model, prompt + truth, prompt_len)
    inner = static(model)
    layers = range(len(inner.windows))
    owners = [
        i for i in layers if inner.family is None or inner.family[i].src == i
    ]  # HF caches these
    for schedule in schedules:
        be = StaticSnapshots(inner, truth, prompt_len, schedule)
        rounds = list(
            speculative_generate(be, prompt, block_size=16, max_new_tokens=56, stop_ids=[])
        )
        assert [t for r in rounds for t in r.tokens] == truth[:56], schedule
        accepted = [r.accepted for r in rounds[1:]]
        if schedule == [15, 0, 3, 0, 0, 15]:
            assert accepted[:6] == [16, 1, 4, 1, 1, 16]  # full blocks and zero-accept steps
        elif schedule == [0]:
            assert set(accepted) == {1}
        assert be.snapshots
        for length, rows in be.snapshots:
            got = [rows[i] for i in owners]
            for (lo, keys), want in zip(got, ref[length], strict=True):
                torch.testing.assert_close(keys, want[:, :, lo:length], rtol=1e-4, atol=1e-4)
        assert any(lo > 0 for _, rows in be.snapshots for lo, _ in rows)  # some window slid
