"""Safetensors files of a draft folder (torch): read every file into one dict, write one file
with the umask's mode, write sharded weights in the Hugging Face layout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dflash.errors import CheckpointError

SHARD_BYTES = 15_000_000


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path,
                     metadata: dict[str, str] | None = None) -> None:  # fmt: skip
    """``safetensors.torch.save_file``, then the file mode a plain ``open`` would give.

    save_file writes through a private temporary file (mode 0600); weights should be as
    readable as the config.json beside them, so the mode follows the umask (0644 typically).
    """
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_shards(
    tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int = SHARD_BYTES
) -> None:
    """Write ``tensors`` (contiguous CPU tensors) to the folder ``out`` as safetensors shards of at
    most ``max_shard_bytes`` each, replacing any ``model*.safetensors*`` there: one shard is
    ``model.safetensors``; several are ``model-0000i-of-0000n.safetensors`` with a
    ``model.safetensors.index.json`` (the HF layout). Files get the mode the umask gives."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_safetensors(shards[0], out / "model.safetensors", metadata=meta)
        return
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_safetensors(shard, out / fname, metadata=meta)
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}  # fmt: skip
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Read every ``*.safetensors`` file of a folder into one dict of CPU tensors.

    Raises:
        CheckpointError: no file, or a file that safetensors cannot parse.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"No .safetensors weights in draft folder {folder}.",
            hint="a draft folder needs config.json and model.safetensors",
        )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"Cannot read draft weights {f.name}: {e}.") from e
    return state
