"""Draft vocabulary (draft_vocab.json): the draft scores only Vd target tokens; outputs stay the
target's (greedy parity) and proposals are exactly the argmax over the kept tokens."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from dflash.backends.plain import TransformersBackend
from dflash.backends.static.backend import StaticBackend
from dflash.cli import app
from dflash.errors import CheckpointError, InputError
from dflash.loop import speculative_generate
from dflash.models.draft_torch import DFlashDraft
from dflash.models.draft_vocab import VOCAB_FILE, choose, count_tokens, coverage, load_draft_vocab
from dflash.models.target_torch import DEMO_DRAFT_DIR
from tests.helpers.cli import assert_one_line_error, run
from tests.helpers.tiny import PROMPT, greedy_reference, make_draft

VOCAB = sorted(int(i) for i in torch.randperm(256, generator=torch.Generator().manual_seed(3))[:64])


def test_choose_keeps_the_most_frequent_and_reports_coverage():
    counts = count_tokens([{"response_ids": [5, 5, 5, 7, 7, 9]}, {"response_ids": [9, 9, 9, 9, 2]}])
    assert counts == Counter({9: 5, 5: 3, 7: 2, 2: 1})
    assert choose(counts, 2, 100) == [5, 9]
    assert choose(counts, 6, 100) == [0, 1, 2, 5, 7, 9]  # topped up with the lowest unseen ids
    assert coverage([5, 9], counts) == 8 / 11
    with pytest.raises(InputError, match="outside 1..99"):
        choose(counts, 101, 100)
    with pytest.raises(InputError, match="outside 1..99"):  # all V ids would change nothing
        choose(counts, 100, 100)


def test_save_load_roundtrip_and_bad_files(tiny_target, tmp_path):
    draft = make_draft(tiny_target)
    draft.draft_vocab = VOCAB
    draft.save(tmp_path / "d")
    assert DFlashDraft.load(tmp_path / "d").draft_vocab == VOCAB
    path = tmp_path / "d" / VOCAB_FILE
    for bad in ('{"token_ids": [1, 1]}', '{"token_ids": [256]}', '{"ids": [1]}', "not json"):
        path.write_text(bad)
        with pytest.raises(CheckpointError, match="draft_vocab.json"):
            DFlashDraft.load(tmp_path / "d")
    path.write_text('{"token_ids": [true, 2]}')  # a bool is not a token id
    with pytest.raises(CheckpointError, match="it has True"):
        DFlashDraft.load(tmp_path / "d")
    path.unlink()
    assert load_draft_vocab(tmp_path / "d", 256) is None


def _backends(tiny_target, kind, vocab=VOCAB, settings=None):
    cls = TransformersBackend if kind == "plain" else StaticBackend
    kw = {"plain": {}, "static": {"use_graphs": False}, "device": {"use_graphs": False, "device_loop": True}}[kind]
    kw["settings"] = settings
    with_vocab, without = make_draft(tiny_target), make_draft(tiny_target)
    with_vocab.draft_vocab = vocab
    return (cls(tiny_target, with_vocab, torch.device("cpu"), **kw),
            cls(tiny_target, without, torch.device("cpu"), **kw))  # fmt: skip


def _draft_once(be):
    be.reset(len(PROMPT) + 64)
    with torch.inference_mode():
        _, ctx = be.prefill(PROMPT, True)
        props, logits = be.draft(PROMPT[-1], ctx, len(PROMPT), 16)
    return props.clone(), logits.clone()


@pytest.mark.parametrize("kind", ["plain", "static"])
def test_proposals_are_the_argmax_over_the_draft_vocabulary(tiny_target, kind):
    _, ref = _backends(tiny_target, kind)
    _, full = _draft_once(ref)
    top = set(full.topk(3, dim=-1).indices.flatten().tolist())  # leave out the draft's favourites
    vocab = [i for i in VOCAB if i not in top] + [sorted(top)[0]]
    be, _ = _backends(tiny_target, kind, sorted(vocab))
    assert be.draft_head.size == len(vocab) and ref.draft_head.size == 256
    props, logits = _draft_once(be)
    keep = torch.zeros(256, dtype=torch.bool)
    keep[vocab] = True
    expected = full.masked_fill(~keep, float("-inf")).argmax(-1)
    assert props.tolist() == expected.tolist()
    assert full.argmax(-1).tolist() != expected.tolist()  # the vocabulary changed some proposals
    assert torch.isinf(logits[:, ~keep]).all()
    torch.testing.assert_close(logits[:, keep], full[:, keep])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plain", "static", "device"])
def test_greedy_output_is_the_targets_with_a_draft_vocabulary(tiny_target, kind):
    be, _ = _backends(tiny_target, kind)
    proposed = []
    if kind == "device":  # the device loop's own draft call (logits=False): proposals in the vocab
        be.device_loop.proposals_hook = lambda p: proposed.append(p.tolist()) or p
    truth = greedy_reference(tiny_target, PROMPT, 50)
    for block_size in (4, 16):
        toks = [t for r in speculative_generate(be, PROMPT, block_size=block_size, max_new_tokens=50)
                for t in r.tokens]  # fmt: skip
        assert toks == truth
    assert kind != "device" or (proposed and set(sum(proposed, [])) <= set(VOCAB))


def test_records_and_cost_keys_name_the_vocabulary(tiny_target):
    from dflash.pipeline import Pipeline

    be, ref = _backends(tiny_target, "plain")
    assert Pipeline(be, None, []).describe()["draft_vocab"] == len(VOCAB)
    assert "draft_vocab" not in Pipeline(ref, None, []).describe()  # older records stay comparable


@pytest.mark.parametrize("kind", ["plain", "static"])
def test_setting_off_ignores_the_vocabulary(tiny_target, kind):
    from dflash.kernels.settings import KernelSettings

    off = KernelSettings.resolve(environ={"DFLASH_DRAFT_VOCAB": "0"})
    be, _ = _backends(tiny_target, kind, settings=off)
    assert be.draft_head.ids is None and be.describe()["kernel_settings"]["draft_vocab"] is False
    with pytest.raises(InputError, match="DFLASH_DRAFT_VOCAB"):
        KernelSettings.resolve(environ={"DFLASH_DRAFT_VOCAB": "maybe"})


@pytest.mark.slow
def test_cli_data_vocab_writes_reports_and_removes(tiny_target, tmp_path):
    make_draft(tiny_target).save(tmp_path / "d")
    (tmp_path / "data").mkdir()
    rows = [{"id": f"a/{i}", "prompt_ids": [1], "response_ids": [3, 3, 4, 200]} for i in range(5)]
    (tmp_path / "data" / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["data", "vocab", "--data", str(tmp_path / "data"), "--draft", str(tmp_path / "d"), "--size"]
    res = CliRunner().invoke(app, [*args, "2"])
    assert res.exit_code == 0, res.output
    assert "2 of 256 tokens; covers 75.00% of 20 response tokens" in res.output
    assert DFlashDraft.load(tmp_path / "d").draft_vocab == [3, 4]
    assert_one_line_error(run(*args, "300"), "outside 1..255")
    res = CliRunner().invoke(app, [*args, "0"])
    assert res.exit_code == 0 and not (tmp_path / "d" / VOCAB_FILE).exists()
    res = CliRunner().invoke(app, [*args, "5"])  # more than the 3 distinct tokens seen: said so
    assert res.exit_code == 0 and "only 3 distinct tokens seen" in res.output, res.output
    bad = {"eval": ('{"eval_only": true}', [3]), "range": (None, [3, 256]), "float": (None, [3.5])}
    for name, (meta, resp) in bad.items():
        (tmp_path / name).mkdir()
        if meta:
            (tmp_path / name / "meta.json").write_text(meta)
        (tmp_path / name / "s.jsonl").write_text(json.dumps({"id": "a/0", "prompt_ids": [1], "response_ids": resp}) + "\n\n")
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "s.jsonl.gz").write_bytes(gzip.compress(b'{"id": "a/0"}\n' * 50)[:30])
    (tmp_path / "utf").mkdir()
    (tmp_path / "utf" / "s.jsonl").write_bytes(b"\xff\xfe\n")
    for folder, fragment in (("eval", "--eval-only"), ("range", "outside the draft's vocabulary"),
                             ("float", "s.jsonl:1 is not a training record"), ("gz", "Cannot read shard"),
                             ("utf", "Cannot read shard"), ("data/s.jsonl", "is a file, not a folder")):  # fmt: skip
        assert_one_line_error(run("data", "vocab", "--data", str(tmp_path / folder), "--draft", str(tmp_path / "d"),
                                  "--size", "2"), fragment)  # fmt: skip


def _one_shard(tmp_path):
    (tmp_path / "data").mkdir(parents=True)
    row = {"id": "a/0", "prompt_ids": [1], "response_ids": [3]}
    (tmp_path / "data" / "s.jsonl").write_text(json.dumps(row) + "\n")
    return tmp_path / "data"


def _vocab(data, draft, size: str):
    return run("data", "vocab", "--data", str(data), "--draft", str(draft), "--size", size)


def test_cli_data_vocab_refuses_the_whole_vocabulary(tiny_target, tmp_path):
    """--size V was accepted: a draft vocabulary of every id changes nothing but the file."""
    make_draft(tiny_target).save(tmp_path / "d")
    data = _one_shard(tmp_path)
    for size in ("256", "257"):
        p = _vocab(data, tmp_path / "d", size)
        assert_one_line_error(p, f"--size {size} is outside 1..255")
        assert "use a smaller size, or --size 0 to remove one" in p.stderr
    assert not (tmp_path / "d" / VOCAB_FILE).exists()
    assert _vocab(data, tmp_path / "d", "255").returncode == 0


def test_a_folder_named_draft_vocab_json_is_an_error(tiny_target, tmp_path):
    """A folder called draft_vocab.json was skipped without a word (full vocabulary)."""
    make_draft(tiny_target).save(tmp_path / "d")
    path = tmp_path / "d" / VOCAB_FILE
    path.mkdir()
    with pytest.raises(CheckpointError, match=f"{path} is a folder"):
        load_draft_vocab(tmp_path / "d", 256)
    with pytest.raises(CheckpointError, match="is a folder"):
        DFlashDraft.load(tmp_path / "d")
    for size in ("2", "0"):  # writing or removing: the same line, not an OSError
        p = _vocab(_one_shard(tmp_path / size), tmp_path / "d", size)
        assert_one_line_error(p, f"{path} is a folder")
    path.rmdir()
    path.symlink_to(tmp_path / "d" / "missing")  # a dangling link
    with pytest.raises(CheckpointError, match="not a readable file"):
        load_draft_vocab(tmp_path / "d", 256)


def test_cli_data_vocab_refuses_the_shipped_draft(tmp_path):
    """It wrote draft_vocab.json into the installed package's assets (the shipped demo draft)."""
    shipped = DEMO_DRAFT_DIR / VOCAB_FILE
    assert not shipped.exists()
    data = _one_shard(tmp_path)
    (tmp_path / "link").symlink_to(DEMO_DRAFT_DIR)
    try:
        for draft, size in ((DEMO_DRAFT_DIR, "2"), (tmp_path / "link", "2"), (tmp_path / "link", "0")):  # fmt: skip
            p = _vocab(data, draft, size)
            assert_one_line_error(p, f"--draft {draft} is a draft shipped inside the dflash")
            assert "copy the draft folder elsewhere first, e.g. cp -r" in p.stderr
            assert not shipped.exists()
    finally:
        shipped.unlink(missing_ok=True)  # never leave a file in the package, even on failure


def test_mlx_backend_uses_the_draft_vocabulary(tmp_path):
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    import dflash
    from dflash.models.draft_vocab import save_draft_vocab
    from tests.helpers.mlx_models import VOCAB as V
    from tests.helpers.mlx_models import build_draft, build_target, random_prompt
    from tests.helpers.mlx_models import greedy_reference as mlx_greedy

    target = build_target(tmp_path / "target", "qwen3")
    draft = build_draft(tmp_path / "draft", target)
    prompt = random_prompt(12)
    ref = dflash.load(str(target), str(draft), backend="mlx")
    kept = sorted(int(i) for i in torch.randperm(V, generator=torch.Generator().manual_seed(1))[: V // 4])
    save_draft_vocab(draft, kept)
    pipe = dflash.load(str(target), str(draft), backend="mlx")
    be, rb = pipe.backend, ref.backend
    assert be.draft_vocab is not None and rb.draft_vocab is None
    outs = []
    for b in (be, rb):
        b.reset(len(prompt) + 64)
        _, ctx = b.prefill(prompt, True)
        outs.append(b.draft(prompt[-1], ctx, len(prompt), 16))
    (props, logits), (_, full) = outs
    mask = mx.full(full.shape, -mx.inf)
    mask[:, mx.array(kept)] = 0
    expected = mx.argmax(full + mask, axis=-1)
    assert props.tolist() == expected.tolist() != mx.argmax(full, axis=-1).tolist()
    assert bool(mx.all(mx.isinf(logits + mask) == mx.isinf(mask)))
    got = pipe.generate(prompt, block_size=16, max_new_tokens=40, stop_ids=[])
    assert got.token_ids == mlx_greedy(target, prompt, 40)
    # a quantized head (as a GGUF target's): its kept rows stay quantized, the same proposals
    import mlx.nn as nn

    from dflash.backends.mlx import MLXBackend
    from dflash.models.draft_mlx import load_draft_mlx

    qouts = []
    for vocab in (True, False):
        model, _ = __import__("mlx_lm").load(str(target))
        nn.quantize(model, group_size=32, bits=4, class_predicate=lambda _p, m: isinstance(m, nn.Embedding))
        d = load_draft_mlx(draft)
        d.draft_vocab = d.draft_vocab if vocab else None
        qb = MLXBackend(model, d)
        assert callable(qb.draft_weight) == vocab
        qb.reset(len(prompt) + 64)
        _, ctx = qb.prefill(prompt, True)
        qouts.append(qb.draft(prompt[-1], ctx, len(prompt), 16))
    (qprops, _), (_, qfull) = qouts
    assert qprops.tolist() == mx.argmax(qfull + mask, axis=-1).tolist()


@pytest.mark.parametrize("vocab", [None, VOCAB])
def test_folded_final_norm_gives_the_same_argmax(vocab):
    """DraftHead.fold_norm: argmax(h (W * w)^T) over un-normed rows == argmax(norm(h) W^T)."""
    from dflash.backends.draft_head import DraftHead
    from dflash.models.draft_torch import RMSNorm

    torch.manual_seed(0)
    lm_head, norm = torch.nn.Linear(32, 256, bias=False), RMSNorm(32)
    norm.weight.data = torch.rand(32) + 0.5
    h = 5 * torch.randn(15, 32)
    head = DraftHead(lm_head, vocab)
    head.fold_norm(norm.weight)
    want, _ = head(norm(h))
    assert head.argmax_folded(h, lambda x: x.argmax(-1)).tolist() == want.tolist()
    assert len(set(want.tolist())) > 3  # varied rows: the check can fail
    biased = DraftHead(torch.nn.Linear(32, 256), vocab)
    biased.fold_norm(norm.weight)
    assert biased.folded is None  # a bias does not scale with the norm: no fold
