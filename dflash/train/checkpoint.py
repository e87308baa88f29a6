"""Training checkpoints: the exact-resume state (float32 weights, AdamW moments, cursor), the
weights-only resume from an exported draft, and the acceptance file written beside a draft."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflash.errors import CheckpointError

if TYPE_CHECKING:
    from dflash.train.train import TrainConfig


def save_state(state_dir: Path, draft, opt, cursor: dict) -> None:
    """Write float32 weights, AdamW moments (safetensors) and the cursor (JSON), atomically."""
    from dflash.models.safetensors_io import save_safetensors

    tmp = state_dir.with_name(state_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    draft.save(tmp / "draft")
    names = {id(p): n for n, p in draft.named_parameters()}
    moments, steps = {}, {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                moments[f"exp_avg.{names[id(p)]}"] = st["exp_avg"].detach().cpu().contiguous()
                moments[f"exp_avg_sq.{names[id(p)]}"] = st["exp_avg_sq"].detach().cpu().contiguous()
                steps[names[id(p)]] = float(st["step"])
    save_safetensors(moments, tmp / "optimizer.safetensors")
    (tmp / "trainer_state.json").write_text(json.dumps({**cursor, "adam_steps": steps}, indent=1))
    if state_dir.exists():
        import shutil

        shutil.rmtree(state_dir)
    tmp.rename(state_dir)


def load_state(state_dir: Path, draft, opt) -> dict:
    """Restore AdamW moments into ``opt`` (the weights are loaded by the caller); returns the cursor.

    Raises:
        CheckpointError: missing or unreadable files.
    """
    from safetensors.torch import load_file

    try:
        cursor = json.loads((state_dir / "trainer_state.json").read_text())
        moments = load_file(str(state_dir / "optimizer.safetensors"))
    except (OSError, json.JSONDecodeError, ValueError) as e:
        raise CheckpointError(f"Cannot read the training state in {state_dir}: {e}.",
                              hint="delete the state folder to start over") from e  # fmt: skip
    on_device = bool(opt.defaults.get("fused") or opt.defaults.get("capturable"))
    for name, p in draft.named_parameters():
        if name in cursor["adam_steps"]:
            opt.state[p] = {  # fused/capturable AdamW keeps its step counters on the device
                "step": torch.tensor(
                    cursor["adam_steps"][name],
                    dtype=torch.float32,
                    device=p.device if on_device else "cpu",
                ),
                "exp_avg": moments[f"exp_avg.{name}"].to(p.device, p.dtype),
                "exp_avg_sq": moments[f"exp_avg_sq.{name}"].to(p.device, p.dtype),
            }
    return cursor


def _weights_only(cfg: TrainConfig):
    """Load a weights-only checkpoint (a draft folder) and its step count from its log.

    Returns:
        (draft float32, steps already trained, the folder's log records).

    Raises:
        CheckpointError: the folder holds no draft.
    """
    from dflash.models.draft_load import load_draft
    from dflash.train.config import match_arch

    folder = Path(cfg.resume_from)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"--resume-from {folder} holds no draft (config.json).",
                              hint="pass a folder written by 'dflash train'")  # fmt: skip
    draft = match_arch(load_draft(folder, dtype=torch.float32), cfg.arch, str(folder), cfg.seed)
    log_path = folder / "train_log.jsonl"
    log = [json.loads(x) for x in log_path.read_text().splitlines() if x.strip()] \
        if log_path.is_file() else []  # fmt: skip
    steps = max((int(r.get("step", 0)) for r in log), default=0)
    if draft.config.block_size != cfg.block_size:
        draft.config.block_size = cfg.block_size
    return draft, steps, log


def write_acceptance(folder: Path, heldout: dict, block_size: int, step: int) -> None:
    """Write ``acceptance.json``: the draft's held-out per-position acceptance rates.

    ``per_position[k-1]`` = P(slot k accepted | slots 1..k-1 accepted), k = 1..L-1, estimated by
    replaying greedy decoding over target responses (``estimate_acceptance``); ``per_dataset``
    holds the same per evaluation dataset. A prior for choosing the block size at run time.
    """
    doc = {"block_size": block_size, "step": step, "tau": heldout.get("tau"),
           "per_position": heldout.get("per_position"), "responses": heldout.get("responses"),
           "source": "held-out estimate (teacher-forced greedy replay), dflash train"}  # fmt: skip
    if heldout.get("per_dataset"):
        doc["per_dataset"] = {n: {"tau": t, "per_position": heldout["per_dataset_position"][n]}
                              for n, t in heldout["per_dataset"].items()}  # fmt: skip
    (Path(folder) / "acceptance.json").write_text(json.dumps(doc, indent=1) + "\n")
