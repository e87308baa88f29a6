"""Draft training on CPU with a tiny random target: loss, frozen weights, checkpoints, resume,
and an overfit run that proves the training signal reaches the acceptance length."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from dflash.train.data import ShardWriter
from dflash.train.objective import FrozenTarget, head_cross_entropy
from dflash.train.train import TrainConfig, Trainer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = [5, 17, 33, 2, 90, 41, 7, 66, 12, 3, 150, 77]


def tiny_target(seed: int = 0):
    """A 6-layer random Llama (hidden 64, vocab 192), float32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=192, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, initializer_range=0.3)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()  # a wide init: greedy output does not fall into a loop


def write_draft(target, folder, layers=2, block_size=8, seed=0):
    """A random draft for ``target`` saved in float32 (mask id = the last vocabulary row)."""
    from dflash.models.draft_torch import DFlashDraft
    from dflash.models.init_draft import draft_config_for

    cfg = draft_config_for(target.config, layers=layers, block_size=block_size,
                           mask_token_id=target.config.vocab_size - 1,
                           vocab_rows=target.config.vocab_size)  # fmt: skip
    torch.manual_seed(seed)
    DFlashDraft(cfg).save(folder)
    return folder


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
    target = tiny_target()
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
    batch = trainer._batch(trainer.epoch_batches[0][0], 0, 0)
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
    resumed.run()
    assert resumed.cursor["step"] == straight.cursor["step"] == 6
    for k, v in straight.draft.state_dict().items():
        assert torch.equal(v, resumed.draft.state_dict()[k]), f"{k} differs after resume"


def test_resume_refuses_other_settings(setup, tmp_path):
    from dflash.errors import InputError

    target, root, _ = setup
    Trainer(config(root, tmp_path / "a", max_steps=2), target).run()
    with pytest.raises(InputError, match="other settings"):
        Trainer(config(root, tmp_path / "a", max_steps=2, lr=5e-4), target)


def test_overfit_one_response_reaches_tau_3(setup, tmp_path):
    """Two hundred CPU steps on one regenerated response: the real greedy loop accepts >= 3."""
    from dflash.backends.transformers import TransformersBackend
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
