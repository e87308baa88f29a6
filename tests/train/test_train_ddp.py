"""Data-parallel ``dflash train`` on CPU (gloo): two processes under torchrun take the same
optimizer steps as one process with the doubled (global) batch; the per-rank split, the
zero-weight part and the resume guard."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dflash.bench.distributed import DistInfo
from dflash.errors import InputError
from dflash.train.data import ShardWriter, make_batches
from dflash.train.distributed import rank_part
from dflash.train.masks import sample_anchors
from dflash.train.train import TrainConfig, Trainer
from tests.helpers.paths import REPO
from tests.helpers.tiny import train_target, write_draft

# Each torchrun worker trains through the real CLI; only the target loader is replaced by the
# tiny random Llama of tests.helpers.tiny.train_target (the same weights in every process: a fixed seed).
# Invocations are separated by "::" (one process group for all: torchrun's store does not
# take a second one); after each, rank 0 copies --out to <out>.<k>.
SCRIPT = textwrap.dedent(
    """
    import os, shutil, sys
    sys.path.insert(0, {repo!r})
    import dflash.bench.distributed as bench_dist
    import dflash.train.train as tt
    from tests.helpers.tiny import train_target
    tt.load_training_target = lambda target, device="auto": (train_target().to(device), None)
    finish, bench_dist.finish_distributed = bench_dist.finish_distributed, lambda info, failed=False: None
    from dflash.cli import app
    runs = " ".join(sys.argv[1:]).split(" :: ")
    for k, run in enumerate(runs):
        args = ["train", *run.split()]
        app(args, standalone_mode=False)
        if k == len(runs) - 1:
            finish(bench_dist.DistInfo(int(os.environ["RANK"]), 2))
        out = args[args.index("--out") + 1]
        if os.environ["RANK"] == "0":
            shutil.copytree(out, f"{{out}}.{{k}}")
    """
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Ten random sequences of 24..60 tokens (prompt 8), five of 64 (--max-len) and a random
    draft; with seed 0 the third global batch holds one sequence (an empty part on rank 0)."""
    root = tmp_path_factory.mktemp("ddp")
    rng = random.Random(0)
    records = []
    for i in range(10):
        n = rng.randint(16, 52)
        records.append({"id": f"r{i}", "prompt_ids": [rng.randrange(1, 190) for _ in range(8)],
                        "response_ids": [rng.randrange(1, 190) for _ in range(n)]})  # fmt: skip
    for i in range(5):
        records.append({"id": f"long{i}", "prompt_ids": [rng.randrange(1, 190) for _ in range(8)],
                        "response_ids": [rng.randrange(1, 190) for _ in range(60)]})  # fmt: skip
    ShardWriter(root / "data", {"test": True}).append(records, len(records))
    write_draft(train_target(), root / "init")
    return root


def options(root, out, batch_tokens: int, steps: int, arch: str = "dflash") -> list[str]:
    return ["--arch", arch, "--data", str(root / "data"), "--out", str(out), "--init", str(root / "init"),
            "--block-size", "8", "--anchors", "6", "--max-steps", str(steps), "--lr", "1e-3",
            "--max-len", "64", "--batch-tokens", str(batch_tokens), "--save-dtype", "float32",
            "--device", "cpu", "--eval-every", "1000", "--save-every", "1000"]  # fmt: skip


def one_process(root, out, batch_tokens: int, steps: int, arch: str = "dflash") -> Trainer:
    cfg = TrainConfig(target=None, data=str(root / "data"), out=str(out), init=str(root / "init"),
                      block_size=8, anchors=6, max_steps=steps, lr=1e-3, max_len=64,
                      batch_tokens=batch_tokens, save_dtype="float32", device="cpu",
                      eval_every=1000, save_every=1000, arch=arch)  # fmt: skip
    trainer = Trainer(cfg, train_target())
    trainer.run()
    return trainer


def torchrun(tmp_path, args: list[str]) -> subprocess.CompletedProcess:
    script = tmp_path / "train_worker.py"
    script.write_text(SCRIPT.format(repo=str(REPO)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script), *args], capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def weights(folder) -> dict:
    from dflash.models.draft_load import load_draft

    return load_draft(folder, dtype=torch.float32).state_dict()


def read_log(folder) -> list[dict]:
    lines = (Path(folder) / "train_log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def moments(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "state" / "optimizer.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_two_processes_take_the_steps_of_one_process_with_the_global_batch(setup, tmp_path, arch):
    """Two steps, then a resume under torchrun for a third (where rank 0 has no sequence):
    the same weights, AdamW moments
    (float32, atol 1e-5), loss, accuracy, training τ and gradient norm as one process with
    twice the batch tokens. (The cosine schedule ends at lr 0, so weights move at step 1 only;
    the moments carry every step's gradient.) DFlash2: the v1 init turned into a DFlash2
    draft, its selector loss and selector weights included."""
    root = setup
    one, two = tmp_path / "one", tmp_path / "two"
    single = one_process(root, one, batch_tokens=256, steps=2, arch=arch)
    shutil.copytree(one, f"{one}.0")
    one_process(root, one, batch_tokens=256, steps=3, arch=arch)  # resumed
    sizes = [len(b) for b in single.epoch_batches[0][:3]]
    assert sizes == [4, 5, 1], sizes  # step 3: rank 0 runs a zero-weight part
    proc = torchrun(tmp_path, [*options(root, two, batch_tokens=128, steps=2, arch=arch), "::",
                               *options(root, two, batch_tokens=128, steps=3, arch=arch)])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("wrote ") == 2  # rank 0 alone reports
    assert "samples/s" in proc.stderr and "2 process(es)" in proc.stderr
    init = weights(root / "init")
    for k, v in weights(f"{one}.0").items():
        assert k not in init or not torch.equal(v, init[k]), f"{k} did not train"
        torch.testing.assert_close(weights(f"{two}.0")[k], v, atol=1e-5, rtol=0, msg=k)
    for a, b in ((f"{one}.0", f"{two}.0"), (one, two)):
        want, got = moments(a), moments(b)
        assert want.keys() == got.keys()
        for k, v in want.items():
            assert v.abs().max() > 0, k
            torch.testing.assert_close(got[k], v, atol=1e-5, rtol=1e-4, msg=k)
    log1, log2 = read_log(one), read_log(two)
    assert [r["step"] for r in log1] == [r["step"] for r in log2] == [2, 3]
    for r1, r2 in zip(log1, log2, strict=True):
        for key in ("loss", "accuracy", "accept", "grad_norm"):  # the grad norm sees a scale
            assert r2[key] == pytest.approx(r1[key], rel=1e-5, abs=1e-6), key  # AdamW hides
        assert r2["samples_per_s"] > 0 and r2["tokens_per_s"] > r2["samples_per_s"]
    state = json.loads((two / "state" / "trainer_state.json").read_text())
    assert state["settings"]["world"] == 2 and state["step"] == 3
    assert sorted(p.name for p in tmp_path.glob("two*")) == ["two", "two.0", "two.1"]


def test_resume_refuses_another_world_size(setup, tmp_path):
    one_process(setup, tmp_path / "one", batch_tokens=256, steps=1)
    cfg = TrainConfig(target=None, data=str(setup / "data"), out=str(tmp_path / "one"),
                      init=str(setup / "init"), block_size=8, anchors=6, max_steps=1, lr=1e-3,
                      max_len=64, batch_tokens=128, save_dtype="float32", device="cpu")  # fmt: skip
    with pytest.raises(InputError, match="run of 1 process"):
        Trainer(cfg, train_target(), dist=DistInfo(rank=0, world=2))


def test_rank_parts_cover_the_batch_once_and_empty_parts_are_flagged():
    idx = [4, 9, 1, 7, 3]
    parts = [rank_part(idx, DistInfo(r, 2)) for r in range(2)]
    assert parts == [([4, 9], False), ([1, 7, 3], False)]
    parts = [rank_part([5], DistInfo(r, 2)) for r in range(2)]
    assert parts == [([5], True), ([5], False)]
    lengths = [30, 50, 20, 64, 40, 33, 61, 28]
    for batch in make_batches(lengths, 2 * 128, seed=0, epoch=0):
        got = [i for r in range(2) for i in rank_part(batch, DistInfo(r, 2))[0]]
        assert got == batch


def test_anchors_of_a_sequence_do_not_depend_on_its_batch():
    def gen(i):
        return torch.Generator().manual_seed(1000 + i)

    mask = torch.zeros(3, 40, dtype=torch.bool)
    mask[0, 5:20], mask[1, 3:40], mask[2, 10:31] = True, True, True
    a_all, k_all = sample_anchors(mask, 6, [gen(i) for i in range(3)])
    a_one, k_one = sample_anchors(mask[2:, :31], 6, [gen(2)])  # alone, padded to its length
    assert torch.equal(a_all[2][k_all[2]], a_one[0][k_one[0]])


def test_a_zero_weight_part_gives_zero_loss_and_zero_gradients(setup, tmp_path):
    from dflash.train.objective import batch_loss

    trainer = one_process(setup, tmp_path / "z", batch_tokens=256, steps=1)
    batch = trainer._batch([0], 0, empty=True)
    out = batch_loss(trainer.draft, trainer.target, batch)
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and float(out.weight) == 0.0 and out.blocks == 0
    grads = [p.grad for p in trainer.draft.parameters()]
    assert all(g is not None and not g.any() for g in grads)  # reached, all zero


@pytest.mark.parametrize(("device", "error"), [("cuda:1", "each rank uses cuda:LOCAL_RANK"),
                                               ("cuda", "no CUDA device")])  # fmt: skip
def test_torchrun_device_errors_come_before_the_process_group(monkeypatch, device, error):
    from dflash.bench.distributed import init_distributed
    from dflash.errors import DflashError

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DflashError, match=error):
        init_distributed(device)
    assert not torch.distributed.is_initialized()
