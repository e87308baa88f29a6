"""The batched generator's kv_lengths attention (each row attends over its own filled length, a
FlexAttention block mask) gives the same float32 tokens as the dense path, and its block mask
covers exactly keys 0..pos of every row."""

from __future__ import annotations

import warnings

import pytest
import torch

from dflash.backends.static.batched import (
    BatchedGenerator,
    Job,
    length_block_mask,
    update_blocks,
)


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=160, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, initializer_range=0.3)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def prompts(n: int, seed: int, lo: int = 2, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 160, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]  # fmt: skip


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        yield


def test_kv_lengths_equals_dense_ragged_refilled_mixed_stops(model):
    ps = prompts(9, seed=2, hi=150)  # prompts past one 128-key block and within it
    budgets = [30, 4, 17, 1, 25, 9, 12, 40, 6]
    free = BatchedGenerator(model, max_batch=4, capacity=200, kv_lengths=False).generate(ps, 12)
    stop = free[2][3]  # a token some rows emit: they end there, others run to their budget
    temps = [0.0 if i % 3 else 0.8 for i in range(len(ps))]  # greedy and sampled rows mixed
    jobs = [Job(p, m, t) for p, m, t in zip(ps, budgets, temps, strict=True)]
    runs = {}
    for on in (False, True):
        gen = BatchedGenerator(model, max_batch=4, capacity=200, steps_per_sync=3, kv_bucket=16,
                               kv_lengths=on)  # fmt: skip
        assert gen.kv_lengths is on and not gen.compile
        runs[on] = dict(gen.run(jobs, stop_ids=[stop], seed=11))
    assert sorted(runs[True]) == list(range(len(jobs)))
    assert runs[True] == runs[False]
    ended = [r for r in runs[True].values() if r[-1] == stop]
    assert ended and len(ended) < len(jobs)  # mixed: some rows stopped, some ran to the budget
    assert any(len(runs[True][i]) == m for i, m in enumerate(budgets) if m > 5)


def test_kv_lengths_capacity_rounded_but_budget_bound(model):
    p = prompts(1, seed=4)[0]
    gen = BatchedGenerator(model, max_batch=2, capacity=40, kv_lengths=True)
    assert gen.k[0].shape[2] == 128  # slots rounded up to one 128-key block
    out = gen.generate([p], 100)[0]
    dense = BatchedGenerator(model, max_batch=2, capacity=40, kv_lengths=False)
    assert out == dense.generate([p], 100)[0] and len(out) == 40 - len(p)


@pytest.mark.parametrize("block", [4, 128])
def test_block_mask_covers_exactly_own_length(block):
    pos = torch.tensor([0, block - 1, block, 3 * block - 1, 2 * block + 1])
    cap = 4 * block
    mask, n_blocks = length_block_mask(pos, cap, block)

    def visible():
        blocks = mask.to_dense()[:, 0, 0].bool()  # [B, cap // block]
        keys = blocks.repeat_interleave(block, dim=1)  # block-level -> key-level
        kv = torch.arange(cap)
        return keys & mask.mask_mod(torch.arange(len(pos))[:, None], 0, 0, kv[None]), keys

    vis, keys = visible()
    assert torch.equal(vis, torch.arange(cap)[None] <= pos[:, None])
    assert n_blocks.flatten().tolist() == [1, 1, 2, 3, 3]  # blocks read: only the row's own
    assert keys.sum(1).tolist() == [block * n for n in (1, 1, 2, 3, 3)]
    pos += torch.tensor([1, 1, 0, 1, block])  # in place, as the decode step does
    update_blocks(n_blocks, pos, block)
    vis, _ = visible()
    assert torch.equal(vis, torch.arange(cap)[None] <= pos[:, None])
    assert n_blocks.flatten().tolist() == [1, 2, 2, 4, 4]
    with pytest.raises(ValueError):
        length_block_mask(pos, cap + 1, block)


def test_switches_settings_and_cpu_defaults(model):
    from dflash.kernels.settings import KernelSettings

    gen = BatchedGenerator(model, max_batch=1, capacity=16)
    assert not gen.kv_lengths and not gen.compile and not gen.use_graphs  # CPU: today's path
    assert BatchedGenerator(model, max_batch=1, capacity=16, kv_lengths=True).kv_lengths
    assert not BatchedGenerator(model, max_batch=1, capacity=16, kv_lengths=False).kv_lengths
    on = KernelSettings.resolve(environ={"DFLASH_BATCHED_KV_LENGTHS": "1", "DFLASH_BATCHED_COMPILE": "0"})
    assert (on.batched_kv_lengths, on.batched_compile) == (True, False)
    assert KernelSettings().batched_kv_lengths is None and KernelSettings().batched_compile is None


def test_step_forward_traces_whole_for_compile(model, monkeypatch):
    """Dynamo + AOT autograd trace the kv_lengths step forward as one graph (fullgraph: no
    breaks around the block mask, FlexAttention or the in-place K/V writes), same tokens."""
    ps = prompts(3, seed=6)
    ref = BatchedGenerator(model, max_batch=3, capacity=64, kv_lengths=True).generate(ps, 9)
    real = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: real(fn, backend="aot_eager", fullgraph=True)
    )
    gen = BatchedGenerator(model, max_batch=3, capacity=64, kv_lengths=True)
    gen.compile = True  # CPU has no graphs, so the constructor leaves it off
    assert gen.generate(ps, 9) == ref
    assert list(gen._compiled) == [True]


def test_failing_kv_lengths_step_falls_back_with_same_tokens(model, monkeypatch, capsys):
    """A kv_lengths replay that fails part-way (as a FlexAttention compile error on CUDA would),
    after steps that wrote wrong tokens, warns once, restores the decode state from before the
    replay and finishes on the dense path with its greedy tokens; an error of the dense path
    itself is raised, not hidden."""
    import dflash.backends.static.batched as bt

    ps = prompts(5, seed=8, hi=60)
    ref = BatchedGenerator(model, max_batch=3, capacity=160, kv_lengths=False).generate(ps, 14)
    calls = {"n": 0}
    real = bt._flex_fn

    def flaky(device):  # step 1 right, steps 2-3 wrong (zero attention), step 4 raises
        calls["n"] += 1
        step = (calls["n"] - 1) // len(model.model.layers) + 1
        if step >= 4:
            raise RuntimeError("inductor: no kernel\nsecond line")
        fn = real(device)
        return fn if step == 1 else (lambda q, k, v, **kw: torch.zeros_like(fn(q, k, v, **kw)))

    monkeypatch.setattr(bt, "_flex_fn", flaky)
    gen = BatchedGenerator(model, max_batch=3, capacity=160, steps_per_sync=8, kv_lengths=True)
    gen._untried = lambda: gen.kv_lengths and not gen._eager_ok  # what CUDA eager steps do
    assert gen.generate(ps, 14) == ref
    assert not gen.kv_lengths
    err = capsys.readouterr().err
    assert err.count("batched kv_lengths attention failed (RuntimeError: inductor: no kernel)") == 1
    assert "second line" not in err

    def broken(*a, **kw):
        raise ValueError("dense bug")

    monkeypatch.setattr(gen, "_forward", broken)
    with pytest.raises(ValueError, match="dense bug"):
        gen.generate(ps, 14)
