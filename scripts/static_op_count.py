"""Count what one block-1 target step launches per layer on the static path, on the CPU.

    TRITON_INTERPRET=1 PYTHONPATH=.:<triton 3.6> python scripts/static_op_count.py [--rows 1] [family ...]

Builds tiny random bf16 targets (``tests/helpers/target_families.py``: gpt_oss, gemma3_text,
gemma4_text, qwen3_moe; a dense qwen3; gemma4_31b_like: k = v, no per-layer inputs), a StaticBackend on the CPU configured
as it would be on CUDA in bf16 (the split-KV attention, ``linear`` ``auto``, the norm kernel,
the ``fused`` expert route; :func:`emulate_cuda`), and profiles one forward of ``--rows`` rows
with ``torch.profiler``: the top-level ops (aten ops and this project's Triton kernels,
``dflash::*``, which the interpreter runs), views left out. On CUDA each counted op is one
kernel launch (``aten::linear``: one cuBLAS GEMM; a few composite ops launch two). Prints per
family the ops per forward, per layer, and the per-layer counts by name.

A development aid for docs/cuda-path.md's per-layer table; no GPU needed.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VIEWS = {"aten::view", "aten::reshape", "aten::transpose", "aten::select", "aten::slice", "aten::split",
         "aten::unsqueeze", "aten::expand", "aten::t", "aten::chunk", "aten::narrow", "aten::_unsafe_view",
         "aten::split_with_sizes", "aten::alias", "aten::as_strided", "aten::detach", "aten::lift_fresh",
         "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::squeeze", "aten::permute",
         "aten::contiguous", "aten::resolve_conj", "aten::resolve_neg", "aten::item",
         "aten::_local_scalar_dense", "aten::new_empty"}  # fmt: skip


def emulate_cuda(be) -> None:
    """Configure ``be`` (a CPU StaticBackend) as on CUDA in bf16: the ``configure`` choices that
    test the device are patched to their CUDA answers; the kernels then run in the interpreter."""
    import dflash.backends.static.families as families
    import dflash.backends.static.kernel_choice as backend

    def keep(mode, *_args):
        return mode

    saved = (backend.attention_mode, backend.linear_mode, families.linear_mode)
    backend.attention_mode = backend.linear_mode = families.linear_mode = keep
    try:  # fuse_norm off: its default above a hidden size of 1,024 (every published shape here)
        be.configure(dataclasses.replace(be.settings, fuse_norm=False))
    finally:
        backend.attention_mode, backend.linear_mode, families.linear_mode = saved
    be.norm_kernel = be.family is not None or not be.fuse_norm  # (configure asks for CUDA)
    be.moe_route = "fused"
    _named_moe_kernels()


def _named_moe_kernels() -> None:
    """moe_gemv / moe_glu (plain functions, not custom ops) recorded as one ``dflash::`` launch
    each, so the interpreter's own tensor traffic inside them is not counted."""
    import dflash.backends.static.moe as moe

    def named(fn, name):
        if getattr(fn, "_counted", False):
            return fn

        def wrapper(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        wrapper._counted = True
        return wrapper

    for name in ("moe_gemv", "moe_glu", "moe_topk", "moe_combine"):
        if hasattr(moe, name):
            setattr(moe, name, named(getattr(moe, name), f"dflash::{name}"))


def _small_linear_stub() -> None:
    """small_linear's launch as its torch reference (the interpreter cannot run its bf16 tiles);
    the op still counts as one ``dflash::small_linear*`` launch."""
    import torch.nn.functional as F

    import dflash.kernels.small_linear as sl

    def launch(x, weight, bias, residual, glu=False, rn_eps=None, pdl=False, config=""):
        if rn_eps is not None:
            x = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + rn_eps)).to(
                x.dtype
            )
        y = F.linear(x, weight, bias)
        if glu:
            g, u = y.chunk(2, -1)
            y = F.silu(g) * u
        return y if residual is None else residual + y

    sl._launch = launch


def build(family: str):
    import transformers

    from tests.helpers.target_families import BASE, GEMMA4
    from tests.helpers.target_families import build as build_family

    torch.manual_seed(0)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**BASE, head_dim=16))
    elif (
        family == "gemma4_31b_like"
    ):  # k = v global layers, no per-layer inputs (Gemma-4-31B's layout)
        cfg = transformers.Gemma4TextConfig(**BASE, **dict(GEMMA4, hidden_size_per_layer_input=0),
                                            attention_k_eq_v=True, num_global_key_value_heads=1)  # fmt: skip
        model = transformers.Gemma4ForCausalLM(cfg)
    else:
        model = build_family(family)
    return (
        model.eval()
    )  # float32: the interpreter has no bf16; the choices are bf16's (emulate_cuda)


def count(family: str, rows: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from dflash.backends.static.backend import StaticBackend
    from tests.conftest import make_draft
    from tests.helpers.target_families import prompt_ids

    _small_linear_stub()
    model = build(family)
    be = StaticBackend(model, make_draft(model), torch.device("cpu"), use_graphs=False)
    emulate_cuda(be)
    be.reset(128)
    prompt = prompt_ids()
    ids = torch.full((1, rows), 5)
    pos = torch.arange(len(prompt), len(prompt) + rows)[None]
    with torch.inference_mode():
        be.prefill(prompt, True)
        be._target_forward(ids, pos)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            be._target_forward(ids, pos)
    top = []
    for e in prof.events():
        if (
            not e.name.startswith(("aten::", "dflash::"))
            or e.name in VIEWS
            or e.name.startswith("dflash::_")
        ):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith(("aten::", "dflash::")):
            parent = parent.cpu_parent
        if parent is None:
            top.append(e.name)
    layers = model.config.num_hidden_layers
    c = collections.Counter(top)
    return {"family": family, "ops": len(top), "per_layer": round(len(top) / layers, 1),
            "by_name_per_layer": {k: round(v / layers, 2) for k, v in c.most_common()}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", default=["qwen3", "qwen3_moe", "gpt_oss", "gemma3_text", "gemma4_text",
                                                    "gemma4_31b_like"])  # fmt: skip
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    for family in args.families:
        res = count(family, args.rows)
        print(f"{family}: {res['ops']} ops, {res['per_layer']} per layer")
        print("   ", res["by_name_per_layer"])


if __name__ == "__main__":
    main()
