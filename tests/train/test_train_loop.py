"""Draft training on CPU with a tiny random target: loss, frozen weights, checkpoints, resume,
and an overfit run that proves the training signal reaches the acceptance length."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from dflash.errors import InputError
from dflash.train.data import ShardWriter
from dflash.train.objective import FrozenTarget, head_cross_entropy
from dflash.train.train import TrainConfig, Trainer
from tests.helpers.tiny import train_target, write_draft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = [5, 17, 33, 2, 90, 41, 7, 66, 12, 3, 150, 77]


def regenerate_one(target, folder, new_tokens=48):
    """The target's greedy response to PROMPT, written as a one-record shard folder."""
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    response = out[0, len(PROMPT) :].tolist()
    ShardWriter(folder, {"test": True}).append(
        [{"id": "r0", "prompt_ids": PROMPT, "response_ids": response}], 1
    )
    return response


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = train_target()
    response = regenerate_one(target, root / "data")
    write_draft(target, root / "init")
    return target, root, response


def config(root, out, **kw):
    base = dict(target=None, data=str(root / "data"), out=str(out), init=str(root / "init"),
                block_size=8, anchors=64, epochs=1000, max_steps=6, lr=1e-3, batch_tokens=256,
                eval_data=str(root / "data"), eval_every=1000, save_every=1000, device="cpu",
                save_dtype="float32")  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def test_head_cross_entropy_matches_reference_loss_and_gradient():
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    head = torch.randn(50, 16)
    labels = torch.randint(0, 50, (37,))
    w = torch.rand(37) + 0.1
    loss, correct = head_cross_entropy(h, head, labels, w, chunk=8)
    loss.backward()
    h2 = h.detach().clone().requires_grad_(True)
    logits = h2 @ head.T
    ref = (F.cross_entropy(logits, labels, reduction="none") * w).sum() / w.sum()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h.grad, h2.grad)
    assert torch.equal(correct, logits.argmax(-1) == labels)


def test_frozen_target_stays_frozen_and_draft_learns(setup, tmp_path):
    target, root, _ = setup
    before = {k: v.clone() for k, v in target.state_dict().items()}
    trainer = Trainer(config(root, tmp_path / "out", max_steps=3), target)
    draft0 = {k: v.clone() for k, v in trainer.draft.state_dict().items()}
    trainer.run()
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), f"target tensor {k} changed"
    assert not any(p.requires_grad for p in target.parameters())
    changed = [k for k, v in trainer.draft.state_dict().items() if not torch.equal(v, draft0[k])]
    assert len(changed) == len(draft0), "every draft tensor is trained"
    # the draft stores no embedding and no LM head (they stay the target's)
    assert not any("embed" in k or "lm_head" in k for k in draft0)


@pytest.mark.parametrize("save_dtype", ["float32", "bfloat16"])
def test_checkpoint_round_trip_gives_identical_logits(setup, tmp_path, save_dtype):
    from dflash.models.draft_torch import DFlashDraft
    from dflash.train.objective import draft_hidden

    target, root, _ = setup
    trainer = Trainer(config(root, tmp_path / "out", max_steps=2, save_dtype=save_dtype), target)
    trainer.run()
    dtype = getattr(torch, save_dtype)
    loaded = DFlashDraft.load(tmp_path / "out", dtype=dtype).eval()
    mem = trainer.draft.to(dtype).eval()
    ft = FrozenTarget(copy.deepcopy(target).to(dtype), loaded.config.target_layer_ids)
    batch = trainer._batch(trainer.epoch_batches[0][0], 0)
    args = [batch[k] for k in ("input_ids", "attention_mask", "loss_mask", "anchors", "keep")]
    with torch.no_grad():
        a = draft_hidden(loaded, ft, *args)[0] @ ft.head.T
        b = draft_hidden(mem, ft, *args)[0] @ ft.head.T
    assert torch.equal(a, b)


def test_resume_continues_exactly(setup, tmp_path):
    target, root, _ = setup
    straight = Trainer(config(root, tmp_path / "a"), target)
    straight.run()
    paused = Trainer(config(root, tmp_path / "b"), target)
    paused.run(until_step=3)
    assert paused.cursor["step"] == 3
    resumed = Trainer(config(root, tmp_path / "b"), target)
    assert resumed.cursor["step"] == 3
    # the last held-out τ of the earlier segment (`dflash train` shows it until the next eval)
    last = resumed.last_heldout()
    assert last is not None and last == paused.last_heldout() and last["tau"] >= 1.0
    resumed.run()
    assert resumed.cursor["step"] == straight.cursor["step"] == 6
    for k, v in straight.draft.state_dict().items():
        assert torch.equal(v, resumed.draft.state_dict()[k]), f"{k} differs after resume"


def test_resume_refuses_other_settings(setup, tmp_path):
    from dflash.errors import InputError

    target, root, _ = setup
    Trainer(config(root, tmp_path / "a", max_steps=2), target).run()
    with pytest.raises(InputError, match="other settings") as err:
        Trainer(config(root, tmp_path / "a", max_steps=2, lr=5e-4), target)
    assert "-> 0.0005" in err.value.message  # names what changed


def test_overfit_one_response_reaches_tau_3(setup, tmp_path):
    """Two hundred CPU steps on one regenerated response: the real greedy loop accepts >= 3."""
    from dflash.backends.plain import TransformersBackend
    from dflash.loop import speculative_generate

    target, root, response = setup
    trainer = Trainer(config(root, tmp_path / "out", max_steps=200, lr=2e-3), target)
    last = trainer.run()
    assert last["heldout"]["tau"] >= 3.0, last
    backend = TransformersBackend(target, trainer.draft.eval(), torch.device("cpu"))
    steps = list(speculative_generate(backend, PROMPT, block_size=8, max_new_tokens=len(response)))
    tokens = [t for r in steps for t in r.tokens]
    assert tokens == response, "speculative output equals the target's greedy response"
    taus = [r.accepted for r in steps if r.accepted is not None]
    assert sum(taus) / len(taus) >= 3.0, taus


def test_weights_only_resume_continues_steps_with_fresh_optimizer(setup, tmp_path):
    """A draft folder brought back from another machine (no optimizer state) continues the run:
    same weights, step count kept, fresh optimizer and schedule logged, --max-steps extendable."""
    from dflash.models.draft_torch import DFlashDraft

    target, root, _ = setup
    first = tmp_path / "first"
    Trainer(config(root, first, max_steps=4, save_dtype="bfloat16"), target).run()
    (first / "state").rename(tmp_path / "elsewhere")  # only the exported weights travel
    second = tmp_path / "second"
    tr = Trainer(config(root, second, init=None, resume_from=str(first), max_steps=7), target)
    assert tr.base_step == 4 and tr.total_steps == 3
    assert all(not st for st in tr.opt.state.values())  # fresh AdamW moments
    start = {k: v.clone() for k, v in tr.draft.state_dict().items()}
    exported = DFlashDraft.load(first, dtype=torch.float32).state_dict()
    assert all(torch.equal(start[k], exported[k]) for k in exported)
    tr.run()
    log = tr.cursor["log"]
    event = [r for r in log if r.get("event") == "resumed from weights only"]
    assert len(event) == 1 and event[0]["step"] == 4 and event[0]["optimizer"] == "fresh"
    steps = [r["step"] for r in log if "loss" in r]
    assert steps[:1] == [4] or steps[-1] == 7  # first segment's records are kept
    assert max(steps) == 7 and [r for r in log if "loss" in r and r["step"] > 4]
    lrs = [r["lr"] for r in log if "loss" in r and r["step"] > 4]
    assert lrs == sorted(lrs, reverse=True)  # a new cosine decay over this segment
    with pytest.raises(InputError, match="larger --max-steps"):
        Trainer(config(root, tmp_path / "third", init=None, resume_from=str(second), max_steps=7),
                target)  # fmt: skip


def test_exact_resume_accepts_a_larger_max_steps(setup, tmp_path):
    target, root, _ = setup
    out = tmp_path / "run"
    Trainer(config(root, out, max_steps=3), target).run()
    tr = Trainer(config(root, out, max_steps=5), target)
    assert tr.cursor["step"] == 3 and tr.total_steps == 5
    tr.run()
    assert tr.cursor["step"] == 5
    assert any(r.get("event") == "max_steps changed" for r in tr.cursor["log"])


def test_eval_every_is_not_skipped_between_log_steps(setup, tmp_path):
    target, root, _ = setup
    tr = Trainer(config(root, tmp_path / "o", max_steps=6, eval_every=2, log_every=5), target)
    tr.run()
    evals = [r["step"] for r in tr.cursor["log"] if r.get("heldout")]
    assert evals == [0, 2, 4, 6]


def test_small_data_still_holds_out_one_sequence(setup, tmp_path):
    target, root, _ = setup
    data = tmp_path / "data"
    recs = [{"id": f"r{i}", "prompt_ids": PROMPT, "response_ids": [3 + i, 4, 5, 6, 7, 8]}
            for i in range(3)]  # fmt: skip
    ShardWriter(data, {"t": 1}).append(recs, 3)
    tr = Trainer(config(root, tmp_path / "o", data=str(data), eval_data=None, max_steps=1), target)
    assert len(tr.eval_seqs) == 1 and len(tr.seqs) == 2


def test_per_dataset_heldout_tau_and_acceptance_file(setup, tmp_path):
    """Eval records named like benchmark prompts give one τ per dataset; the final held-out
    per-position rates are written to acceptance.json for a block-size prior."""
    target, root, response = setup
    ev = tmp_path / "eval"
    recs = [{"id": f"{name}/{i}", "prompt_ids": PROMPT, "response_ids": response[: 20 + i]}
            for name in ("gsm8k", "HumanEval") for i in range(2)]  # fmt: skip
    ShardWriter(ev, {"eval_only": True}).append(recs, 4)
    out = tmp_path / "o"
    tr = Trainer(config(root, out, eval_data=str(ev), max_steps=2, eval_every=2), target)
    tr.run()
    held = tr.cursor["log"][-1]["heldout"]
    assert set(held["per_dataset"]) == {"gsm8k", "humaneval"} and held["responses"] == 4
    doc = json.loads((out / "acceptance.json").read_text())
    assert doc["block_size"] == 8 and len(doc["per_position"]) == 7
    assert doc["per_position"] == held["per_position"] and doc["step"] == 2
    assert set(doc["per_dataset"]) == {"gsm8k", "humaneval"}


def test_flex_bucketing_and_host_rows_leave_loss_and_gradients_unchanged(setup, tmp_path):
    """The CUDA batch shapes (S to 128, N*L > 128, a copied row that keeps nothing) and the
    supervised rows found on the host give the loss and gradients of the plain batch."""
    from dflash.train.objective import batch_loss

    target, root, _ = setup
    trainer = Trainer(config(root, tmp_path / "out", max_steps=1), target)
    idx = trainer.epoch_batches[0][0]
    plain = trainer._batch(idx, 0)
    no_rows = {k: v for k, v in plain.items() if k != "rows"}
    trainer.flex = True  # the bucketing only: batch_loss below still uses dense masks
    padded = trainer._batch(idx, 0)
    assert plain["input_ids"].shape[0] == 1 and padded["input_ids"].shape[0] == 2
    assert padded["input_ids"].shape[1] % 128 == 0 and padded["anchors"].shape[1] * 8 > 128
    assert not padded["keep"][1].any() and not padded["loss_mask"][1].any()
    assert torch.equal(padded["rows"], plain["rows"])  # the copied row adds no supervised slot
    results = []
    for batch in (no_rows, plain, padded):
        trainer.draft.zero_grad(set_to_none=True)
        out = batch_loss(trainer.draft, trainer.target, batch)
        out.loss.backward()
        grads = [p.grad.clone() for p in trainer.draft.parameters()]
        results.append((out, grads))
    (ref, ref_g), (same, same_g), (pad, pad_g) = results
    assert torch.equal(ref.loss, same.loss) and all(map(torch.equal, ref_g, same_g))
    assert int(ref.blocks) == int(pad.blocks) > 0
    torch.testing.assert_close(pad.loss, ref.loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(pad_g, ref_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for key in ("accuracy", "accept", "weight"):
        torch.testing.assert_close(getattr(pad, key), getattr(ref, key))


def test_resume_refuses_other_data_and_guards_the_out_folder(setup, tmp_path):
    """A resume that reads other data is refused (it crashed or trained on the wrong data); --out
    that is a file, or a draft folder no run of ours is training, is refused before any step."""
    from dflash.errors import InputError

    target, root, _ = setup
    Trainer(config(root, tmp_path / "a", max_steps=2), target).run(until_step=1)
    other = tmp_path / "other-data"
    shutil.copytree(root / "data", other)
    with pytest.raises(InputError, match="other settings") as err:
        Trainer(config(root, tmp_path / "a", max_steps=2, data=str(other)), target)
    assert "data" in err.value.message and str(other) in err.value.message
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(InputError, match="is a file"):
        config(root, afile).check()
    with pytest.raises(InputError, match="already holds a draft") as err:
        config(root, root / "init").check()  # the --init draft itself: training would replace it
    assert "--init" in err.value.hint
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(InputError, match="holds a model"):  # even with trainer state beside it
        config(root, model).check()
    config(root, tmp_path / "a").check()  # our own run's folder resumes


def test_first_interrupt_pauses_at_the_step_end_saved(setup, tmp_path):
    """Ctrl-C (SIGINT) during training pauses after the current step with the state saved, as
    --pause-after does; the next run resumes to the same weights as a straight run."""
    import os
    import signal

    target, root, _ = setup
    straight = Trainer(config(root, tmp_path / "s", max_steps=4, log_every=1), target)
    straight.run()
    sent = []

    def on_log(rec):
        if "loss" in rec and not sent:
            sent.append(rec["step"])
            os.kill(os.getpid(), signal.SIGINT)  # the handler only sets a flag

    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when started in the background (nohup)
    tr = Trainer(config(root, tmp_path / "i", max_steps=4, log_every=1), target, on_log=on_log)
    tr.run()
    # the signal came while step n was logged (after its stop check): step n + 1 at the latest
    assert tr.interrupted and sent[0] <= tr.cursor["step"] <= sent[0] + 1 < 4
    assert (tmp_path / "i" / "state" / "trainer_state.json").is_file()
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored
    again = Trainer(config(root, tmp_path / "i", max_steps=4, log_every=1), target)
    again.run()
    assert not again.interrupted and again.cursor["step"] == 4
    for k, v in straight.draft.state_dict().items():
        assert torch.equal(v, again.draft.state_dict()[k]), k


def test_no_step_trains_at_learning_rate_zero(setup, tmp_path):
    target, root, _ = setup
    tr = Trainer(config(root, tmp_path / "lr", max_steps=3, log_every=1, warmup=0.3), target)
    tr.run()
    lrs = [r["lr"] for r in tr.cursor["log"] if "loss" in r]
    assert len(lrs) == 3 and min(lrs) > 0


def test_data_from_another_tokenizer_is_refused(setup, tmp_path, capsys):
    """Training refuses data holding token ids the target cannot embed (regenerated by another
    target), and warns when meta.json names another target (found by a user trial)."""
    from dflash.errors import DatasetError
    from dflash.train.train import Trainer

    target, root, _ = setup
    data = tmp_path / "big-vocab"
    ShardWriter(data, {"target": "some/other-model"}).append(
        [{"id": "r0", "prompt_ids": PROMPT, "response_ids": [5, 500, 7, 9]}], 1)  # fmt: skip
    with pytest.raises(DatasetError, match="token id 500, past the target's vocabulary of 192") as err:
        Trainer(config(root, tmp_path / "a", data=str(data), eval_data=None), target)
    assert "some/other-model" in err.value.message
    named = tmp_path / "named"
    shutil.copytree(root / "data", named)
    meta = json.loads((named / "meta.json").read_text())
    (named / "meta.json").write_text(json.dumps({**meta, "target": "some/other-model"}))
    Trainer(config(root, tmp_path / "b", data=str(named), eval_data=None, max_steps=1), target)
    assert "regenerated by some/other-model" in capsys.readouterr().err
