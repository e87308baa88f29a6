"""The settings of a ``dflash train`` run and what its loop starts from.

:class:`TrainConfig` (the ``dflash train`` options and their cheap checks), the settings a resume
must match (``RESUME_KEYS``, ``DATA_KEYS``), the learning-rate schedule (:func:`lr_at`) and the
fresh draft of a new run. The loop itself is :class:`dflash.train.train.Trainer`;
:mod:`dflash.train.train` re-exports every name here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dflash.errors import InputError

# settings that must match for a resume to continue the same run (max_steps may grow)
RESUME_KEYS = ("block_size", "layers", "anchors", "epochs", "lr", "max_len", "batch_tokens",
               "seed", "gamma", "warmup", "resume_from")  # fmt: skip
DATA_KEYS = ("target", "data", "eval_data")  # what the run reads (absolute paths or hub ids)


def _where(value: str | None) -> str | None:
    """A path or hub id as stored in the resume settings: local paths made absolute."""
    if value is None:
        return None
    p = Path(value).expanduser()
    return str(p.resolve()) if p.exists() else value


@dataclass
class TrainConfig:
    """Settings of one training run (the ``dflash train`` options).

    Attributes:
        target: target hub id, folder or .gguf (None: the demo target).
        data: folder of regenerated JSONL shards.
        out: output draft folder.
        init: draft folder to start from (None: a fresh draft as ``dflash init-draft`` makes).
        layers, block_size: draft shape for a fresh draft.
        anchors: blocks per sequence (cap).
        epochs: passes over the data; max_steps caps the optimizer steps (None: no cap).
        lr, warmup, clip, weight_decay: AdamW and schedule (warmup = fraction of steps).
        max_len: sequences are cut to this many tokens.
        batch_tokens: padded sequence tokens per batch.
        gamma: loss decay (None: 7/5/4 for L = 16/10/8).
        time_limit: seconds; the schedule then anneals by max(step, time) progress (not
            deterministic) and the run ends at the limit.
        eval_data: folder of responses for the held-out τ (None: a holdout of ``data``); with
            benchmark ids (``gsm8k/..``, ``math500/..``, ...) τ is also reported per dataset,
            ``eval_per_dataset`` responses each.
        eval_every, save_every, log_every: in optimizer steps.
        resume_from: a draft folder written by ``dflash train`` (weights only, e.g. brought back
            from another machine): training continues from its weights and step count with a
            fresh optimizer and schedule; ``max_steps`` then counts all steps, old ones included.
        attention: auto (flex on CUDA, dense on CPU), flex or dense.
        save_dtype: dtype of the exported draft (bfloat16 or float32).
        arch: "dflash" or "dflash2" (brief §4) for a fresh draft; None: the --init /
            --resume-from draft's own, else "dflash". ``dflash2`` with a v1 --init starts from
            that draft (:meth:`DFlash2Draft.from_v1 <dflash.models.draft2_torch.DFlash2Draft.from_v1>`).
        selector_weight: weight of a DFlash2 draft's selector loss next to the token loss
            (:func:`dflash.train.objective.selector_loss`).
    """

    target: str | None
    data: str
    out: str
    init: str | None = None
    layers: int = 5
    block_size: int = 16
    anchors: int = 512
    epochs: int = 6
    max_steps: int | None = None
    lr: float = 6e-4
    warmup: float = 0.04
    clip: float = 1.0
    weight_decay: float = 0.0
    max_len: int = 2048
    batch_tokens: int = 16384
    gamma: float | None = None
    seed: int = 0
    time_limit: float | None = None
    eval_data: str | None = None
    eval_every: int = 200
    eval_max: int = 64
    save_every: int = 500
    log_every: int = 10
    attention: str = "auto"
    device: str = "auto"
    save_dtype: str = "bfloat16"
    state_dir: str | None = None
    mask_token_id: int | None = None
    resume_from: str | None = None
    eval_per_dataset: int = 16
    arch: str | None = None
    selector_weight: float = 1.0
    extra: dict = field(default_factory=dict)

    def check(self) -> None:
        """Raise InputError for out-of-range numbers (cheap, before loading anything)."""
        rules = [(self.layers >= 1, "--layers must be >= 1"), (self.block_size >= 2, "--block-size must be >= 2"),
                 (self.anchors >= 1, "--anchors must be >= 1"), (self.epochs >= 1, "--epochs must be >= 1"),
                 (self.lr > 0, "--lr must be > 0"), (self.max_len >= 4, "--max-len must be >= 4"),
                 (self.batch_tokens >= self.max_len or self.batch_tokens >= 4, "--batch-tokens must be >= 4"),
                 (0 <= self.warmup < 1, "warmup must be in [0, 1)"),
                 (self.max_steps is None or self.max_steps >= 1, "--max-steps must be >= 1"),
                 (min(self.log_every, self.eval_every, self.save_every) >= 1,
                  "--log-every, --eval-every and --save-every must be >= 1"),
                 (self.attention in ("auto", "flex", "dense"), "--attention must be auto, flex or dense"),
                 (self.save_dtype in ("bfloat16", "float32"), "--save-dtype must be bfloat16 or float32"),
                 (self.arch in (None, "dflash", "dflash2"), "--arch must be dflash or dflash2"),
                 (self.selector_weight >= 0, "selector_weight must be >= 0")]  # fmt: skip
        for ok, msg in rules:
            if not ok:
                raise InputError(msg + ".")
        out = Path(self.out).expanduser()
        if out.exists() and not out.is_dir():
            raise InputError(f"--out {self.out} is a file; pass a folder for the trained draft.")
        from dflash.models.config import holds_other_model

        other = holds_other_model(out)
        if other is not None:
            raise InputError(f"--out {self.out} holds a model ({other}), not a DFlash draft; training "
                             "never writes over it.", hint="choose a new or empty folder for the draft")  # fmt: skip
        state = Path(self.state_dir) if self.state_dir else out / "state"
        if (out / "config.json").is_file() and not (state / "trainer_state.json").is_file() \
                and self.resume_from is None:  # a draft that no run of ours is training
            raise InputError(f"--out {self.out} already holds a draft that training would replace.",
                             hint=f"start from it with --init {self.out} --out NEW_FOLDER, or continue a "
                                  "'dflash train' output with --resume-from, or choose another --out")  # fmt: skip


def lr_at(progress: float, base: float, warmup: float) -> float:
    """Learning rate at run progress in [0, 1]: linear warmup, then cosine down to 0."""
    if warmup > 0 and progress < warmup:
        return base * progress / warmup
    rest = (progress - warmup) / max(1e-12, 1.0 - warmup)
    return base * 0.5 * (1.0 + math.cos(math.pi * min(1.0, rest)))


def _fresh_draft(cfg: TrainConfig, state_dir: Path):
    """A new draft from --init, or shaped for the target like ``dflash init-draft`` (of
    ``cfg.arch``); a v1 --init with ``--arch dflash2`` becomes a DFlash2 draft that starts as it."""
    from dflash.models.draft_load import load_draft
    from dflash.models.init_draft import init_draft

    if cfg.init is not None:
        draft = match_arch(load_draft(cfg.init, dtype=torch.float32), cfg.arch, cfg.init, cfg.seed)
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            folder = init_draft(cfg.target, tmp, layers=cfg.layers, block_size=cfg.block_size,
                                seed=cfg.seed, mask_token_id=cfg.mask_token_id, dtype="float32",
                                arch=cfg.arch or "dflash")  # fmt: skip
            draft = load_draft(folder, dtype=torch.float32)
    if draft.config.block_size != cfg.block_size:
        draft.config.block_size = cfg.block_size  # a draft may be re-trained for another L
    return draft


def match_arch(draft, arch: str | None, where: str, seed: int = 0):
    """``draft`` as the architecture ``arch`` asks (None: as it is): a v1 draft becomes a
    DFlash2 draft that starts as it; a DFlash2 draft is never turned back into v1.

    Raises:
        InputError: ``arch`` "dflash" for a DFlash2 draft.
    """
    is2 = bool(getattr(draft, "is_dflash2", False))
    if arch == "dflash" and is2:
        raise InputError(f"{where} holds a DFlash2 draft and --arch is dflash.",
                         hint="drop --arch (the draft's own is used) or pass --arch dflash2")  # fmt: skip
    if arch == "dflash2" and not is2:
        from dflash.models.draft2_torch import DFlash2Draft

        return DFlash2Draft.from_v1(draft, seed=seed)
    return draft


def config_dict(cfg: TrainConfig) -> dict:
    """The run settings as JSON-able dict (for logs and model cards)."""
    return asdict(cfg)
