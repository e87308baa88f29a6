"""``dflash train --arch dflash2`` on CPU with a tiny random target: a v1 draft turned into a
DFlash2 draft starts as it, a few steps on a fixed batch lower the token and selector losses,
the saved checkpoint loads and decodes exactly on both torch paths, resume is exact, and the
architecture guards."""

from __future__ import annotations

import os

import pytest
import torch

from dflash.errors import InputError
from dflash.models.draft2_torch import DFlash2Draft
from dflash.models.draft_load import load_draft
from dflash.train.data import ShardWriter
from dflash.train.objective import batch_loss, draft_hidden
from dflash.train.train import TrainConfig, Trainer
from tests.helpers.tiny import greedy_reference, train_target, write_draft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread (tests/conftest.py)
PROMPT = [5, 17, 33, 2, 90, 41, 7, 66, 12, 3, 150, 77]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny training target, one greedy response of it as the data, a random v1 draft."""
    root = tmp_path_factory.mktemp("train2")
    target = train_target()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48,
                              do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    ShardWriter(root / "data", {"test": True}).append(
        [{"id": "r0", "prompt_ids": PROMPT, "response_ids": out[0, len(PROMPT) :].tolist()}], 1
    )
    write_draft(target, root / "init")
    return target, root


def config(root, out, **kw):
    base = dict(target=None, data=str(root / "data"), out=str(out), init=str(root / "init"),
                block_size=8, anchors=64, epochs=1000, max_steps=6, lr=1e-3, batch_tokens=256,
                eval_data=str(root / "data"), eval_every=1000, save_every=1000, device="cpu",
                save_dtype="float32", arch="dflash2")  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def test_v1_init_becomes_a_dflash2_draft_that_starts_as_it(setup, tmp_path):
    target, root = setup
    v1 = Trainer(config(root, tmp_path / "a", arch=None), target)
    v2 = Trainer(config(root, tmp_path / "b"), target)
    assert isinstance(v2.draft, DFlash2Draft) and not isinstance(v1.draft, DFlash2Draft)
    batch = v1._batch(v1.epoch_batches[0][0], 0)
    args = [batch[k] for k in ("input_ids", "attention_mask", "loss_mask", "anchors", "keep")]
    with torch.no_grad():
        h1, h2 = (
            draft_hidden(v1.draft, v1.target, *args)[0],
            draft_hidden(v2.draft, v2.target, *args)[0],
        )
    torch.testing.assert_close(h2, h1)  # identity convolutions: the v1 draft's states


def test_steps_on_a_fixed_batch_lower_both_losses(setup, tmp_path):
    target, root = setup
    trainer = Trainer(config(root, tmp_path / "out"), target)
    batch = trainer._batch(trainer.epoch_batches[0][0], 0)

    def losses():
        with torch.no_grad():
            out = batch_loss(trainer.draft, trainer.target, batch, chunk=1024)
        return float(out.loss), float(out.selector)

    before = losses()
    sel0 = {k: v.clone() for k, v in trainer.draft.candidate_selector.state_dict().items()}
    for _ in range(8):
        out = trainer.step(batch, 1e-3)
        assert out.selector is not None and torch.isfinite(out.loss)
    after = losses()
    assert after[0] < before[0] - 0.1, (before, after)
    trained = {k: v.clone() for k, v in trainer.draft.candidate_selector.state_dict().items()}
    for k, v in trained.items():
        assert not torch.equal(v, sel0[k]), f"selector {k} did not train"
    # the selector's loss over the trained draft's candidates: lower with the trained selector
    # than with its starting weights (the candidate set itself moves as the draft learns)
    trainer.draft.candidate_selector.load_state_dict(sel0)
    untrained = losses()[1]
    trainer.draft.candidate_selector.load_state_dict(trained)
    assert after[1] < untrained - 0.05, (after, untrained)
    conv = trainer.draft.layers[0].attention_conv.kernel_projection.weight
    assert conv.abs().max() > 0  # the dynamic taps left their zero start


def test_checkpoint_loads_and_decodes_exactly_on_both_paths(setup, tmp_path):
    from dflash.backends.plain import TransformersBackend
    from dflash.backends.static.backend import StaticBackend
    from dflash.loop import speculative_generate

    target, root = setup
    trainer = Trainer(config(root, tmp_path / "out", max_steps=3, eval_every=3), target)
    trainer.run()
    heldout = trainer.last_heldout()
    assert heldout is not None and heldout["tau"] >= 1.0  # the selector walk's replay ran
    draft = load_draft(tmp_path / "out", dtype=torch.float32).eval()
    assert isinstance(draft, DFlash2Draft)
    for k, v in trainer.draft.state_dict().items():
        assert torch.equal(draft.state_dict()[k], v), k
    truth = greedy_reference(target, PROMPT, 30)
    for be in (TransformersBackend(target, draft, torch.device("cpu")),
               StaticBackend(target, draft, torch.device("cpu"), use_graphs=False)):  # fmt: skip
        toks = [t for r in speculative_generate(be, PROMPT, block_size=8, max_new_tokens=30)
                for t in r.tokens]  # fmt: skip
        assert toks == truth, type(be).__name__


def test_resume_continues_exactly(setup, tmp_path):
    target, root = setup
    straight = Trainer(config(root, tmp_path / "a"), target)
    straight.run()
    paused = Trainer(config(root, tmp_path / "b"), target)
    paused.run(until_step=3)
    resumed = Trainer(config(root, tmp_path / "b", arch=None), target)  # the state's own arch
    assert isinstance(resumed.draft, DFlash2Draft) and resumed.cursor["step"] == 3
    resumed.run()
    for k, v in straight.draft.state_dict().items():
        assert torch.equal(v, resumed.draft.state_dict()[k]), f"{k} differs after resume"
    with pytest.raises(InputError, match="another architecture"):
        Trainer(config(root, tmp_path / "b", arch="dflash"), target)
    with pytest.raises(InputError, match="holds a DFlash2 draft"):
        Trainer(config(root, tmp_path / "c", init=str(tmp_path / "a"), arch="dflash"), target)
    with pytest.raises(InputError, match="--arch must be"):
        config(root, tmp_path / "d", arch="dflash3").check()


@pytest.mark.slow
def test_cli_bad_arch_is_one_line_error(tmp_path):
    from tests.helpers.cli import assert_one_line_error, run

    p = run("train", "--data", str(tmp_path), "--out", str(tmp_path / "o"), "--arch", "eagle")
    assert_one_line_error(p, "--arch must be dflash or dflash2")
