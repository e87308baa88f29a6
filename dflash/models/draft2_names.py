"""Tensor names of a DFlash2 checkpoint, backend-free (the torch and MLX drafts share them).

The published checkpoints store the candidate selector's two codebooks without the ``.weight``
suffix their embedding modules give them; every other tensor keeps its module name. The maps
take and return a flat ``name -> tensor`` dict of any array type and never copy a tensor.
"""

from __future__ import annotations

from dflash.errors import CheckpointError

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def module_names(state: dict) -> dict:
    """Checkpoint names -> module names: the codebooks gain ``.weight`` (both forms read).

    Raises:
        CheckpointError: a codebook stored under both names.
    """
    state = dict(state)
    for name in CODEBOOKS:
        if name in state:
            if name + ".weight" in state:
                raise CheckpointError(f"Draft weights hold both {name} and {name}.weight; "
                                      "keep one of them.")  # fmt: skip
            state[name + ".weight"] = state.pop(name)
    return state


def checkpoint_names(state: dict) -> dict:
    """Module names -> checkpoint names: the codebooks lose their ``.weight`` suffix."""
    state = dict(state)
    for name in CODEBOOKS:
        if name + ".weight" in state:
            state[name] = state.pop(name + ".weight")
    return state
