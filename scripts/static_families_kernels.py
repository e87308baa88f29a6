"""The ``kernel`` part of ``scripts/gpu_check_static_families.py`` (one CUDA GPU): the split-KV
attention kernel with windows and with attention sinks against SDPA / the softmax with the sink
column, and the expert blocks' ``gather`` and ``grouped`` routes against transformers' own
(Qwen3-30B-A3B, gpt-oss and Gemma 4 shaped layers). Each check returns rows with ``ok``."""

from __future__ import annotations

import dataclasses

import torch
from static_families_models import PERF_MOE_LAYERS, QWEN3_30B_A3B, build_target


def check_kernel(dev: torch.device) -> dict:
    """Split-KV attention with a window against masked SDPA; the MoE routes against transformers."""
    import torch.nn.functional as F

    from dflash.backends.static.moe import moe_forward
    from dflash.kernels import split_attention as sa

    out, ok = {"attention": [], "moe": []}, True
    shapes = ((32, 8, 16, 128, 4096, 3000), (32, 8, 1, 128, 4096, 3000), (9, 3, 16, 64, 1024, 600),
              (4, 2, 16, 16, 512, 40))  # fmt: skip
    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float32, 1e-4)):
        for h, hkv, t, d, cap, start in shapes:
            if (
                dtype == torch.float32 and d > 64
            ):  # fp32 tiles of D=128 exceed shared memory (not a window matter)
                continue
            g = torch.Generator(device=dev).manual_seed(0)
            q = torch.randn(1, t, h, d, generator=g, device=dev, dtype=dtype).transpose(1, 2)
            k, v = (
                torch.randn(1, hkv, cap, d, generator=g, device=dev, dtype=dtype) for _ in range(2)
            )
            pos = torch.arange(start, start + t, device=dev)
            heads = sa.heads_per_program(h // hkv, t)  # as the forwards launch it
            for window in (1, 8, 128, 700, 8192):
                keys = torch.arange(cap, device=dev)[None, :]
                mask = ((keys <= pos[:, None]) & (keys > pos[:, None] - window))[None, None]
                want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.1,
                                                      enable_gqa=True)  # fmt: skip
                for split, one, early in (
                    (256, 0, False),
                    (256, 448, True),
                    (64, 0, False),
                    (cap, 0, False),
                ):
                    case = dict(dtype=str(dtype), shape=[h, hkv, t, d, cap, start], window=window, split=split,
                                one_slice=one, early=early)  # fmt: skip
                    try:
                        got = sa.split_attention_kernel(q, k, v, pos, 0.1, split, heads, one_slice=one, early=early,
                                                        window=window)  # fmt: skip
                        err = (got.float() - want).abs().max().item()
                        good = err < tol
                    except Exception as e:  # noqa: BLE001
                        err, good = f"{type(e).__name__}: {e}"[:160], False
                    ok &= good
                    if not good or (split == 256 and one == 0):
                        out["attention"].append(dict(case, err=err, ok=good))
    from static_families_profile import check_family_kernels

    out["family_kernels"] = check_family_kernels(
        dev
    )  # Gemma's head dims, rope_cache_family, the MoE kernels
    ok &= all(r["ok"] for r in out["family_kernels"])
    out["sinks"] = check_sinks(dev)
    ok &= all(r["ok"] for r in out["sinks"])
    out["family_moe"] = check_family_moe(dev)
    ok &= all(r["ok"] for r in out["family_moe"])
    shape = dict(QWEN3_30B_A3B, num_hidden_layers=1)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        block = build_target("Qwen3MoeConfig", shape, dtype, dev, 0.02).model.layers[0].mlp
        hs = torch.randn(1, 16, 2048, device=dev, dtype=dtype)
        with torch.no_grad():
            want = block(hs).float()
            for route in ("gather", "grouped"):
                if route == "grouped" and not hasattr(F, "grouped_mm"):
                    continue
                try:
                    got = moe_forward(block, hs, route).float()
                    err = ((got - want).abs().max() / want.abs().max()).item()
                    good = err < tol
                except Exception as e:  # noqa: BLE001 - grouped_mm may not take float32 on this card
                    err, good = (
                        f"{type(e).__name__}: {e}"[:200],
                        route == "grouped" and dtype == torch.float32,
                    )
                ok &= good
                out["moe"].append(dict(dtype=str(dtype), route=route, rel_err=err, ok=good))
        del block
    out["ok"] = bool(ok)
    return out


def check_sinks(dev: torch.device) -> list:
    """The split-KV kernel with attention sinks (gpt-oss's layout: 64 heads, 8 KV heads, D 64;
    windows 128 and none; 1 and 16 rows; one slice and several) against the softmax over the
    scores and the sink column written out (float32)."""
    from dflash.backends.static.families import attend_sinks
    from dflash.kernels import split_attention as sa
    from dflash.kernels.settings import KernelSettings, Launch

    rows = []
    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float32, 1e-4)):
        for h, hkv, t, d, cap, start in ((64, 8, 16, 64, 4096, 3000), (64, 8, 1, 64, 4096, 3000),
                                         (64, 8, 16, 64, 1024, 200), (4, 2, 3, 16, 512, 40)):  # fmt: skip
            g = torch.Generator(device=dev).manual_seed(0)
            q = torch.randn(1, t, h, d, generator=g, device=dev, dtype=dtype).transpose(1, 2)
            k, v = (
                torch.randn(1, hkv, cap, d, generator=g, device=dev, dtype=dtype) for _ in range(2)
            )
            sinks = torch.randn(h, generator=g, device=dev) * 4
            pos = torch.arange(start, start + t, device=dev)
            keys = torch.arange(cap, device=dev)[None, :]
            for window in (None, 128):
                mask = keys <= pos[:, None]
                if window:
                    mask = mask & (keys > pos[:, None] - window)
                want = attend_sinks(q.float(), k.float(), v.float(), mask[None, None], 0.125, sinks)
                for split in (256, cap):
                    case = dict(
                        dtype=str(dtype),
                        shape=[h, hkv, t, d, cap, start],
                        window=window,
                        split=split,
                    )
                    try:
                        launch = Launch(
                            dataclasses.replace(KernelSettings(), attn_split=split), False
                        )
                        got = sa.split_attention(
                            q, k, v, pos, 0.125, launch=launch, window=window, sinks=sinks
                        )
                        err = (got.float() - want).abs().max().item()
                        good = err < tol
                    except Exception as e:  # noqa: BLE001
                        err, good = f"{type(e).__name__}: {e}"[:200], False
                    rows.append(dict(case, err=err, ok=good))
    return rows


def check_family_moe(dev: torch.device) -> list:
    """gpt-oss's and Gemma 4's expert blocks (one layer of gpt-oss-20b's and Gemma-4-26B-A4B's
    shapes, approximately): the gather and grouped routes against transformers' own block."""
    import torch.nn.functional as F

    from dflash.backends.static.moe import gemma4_moe_forward, gpt_oss_forward

    rows = []
    for name, (cls_name, kwargs) in PERF_MOE_LAYERS.items():
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
            model = build_target(cls_name, kwargs, dtype, dev, 0.02)
            layer = model.model.layers[0]
            hs = torch.randn(1, 16, kwargs["hidden_size"], device=dev, dtype=dtype)
            with torch.no_grad():
                if name == "gpt_oss":
                    want = layer.mlp(hs)[0].float()
                else:
                    flat = hs[0]
                    _, w, idx = layer.router(flat)
                    want = layer.experts(layer.pre_feedforward_layernorm_2(flat), idx, w)[
                        None
                    ].float()
                for route in ("gather", "grouped"):
                    if route == "grouped" and (
                        not hasattr(F, "grouped_mm") or dtype == torch.float32
                    ):
                        continue
                    try:
                        got = (gpt_oss_forward(layer.mlp, hs, route) if name == "gpt_oss"
                               else gemma4_moe_forward(layer, hs, route)).float()  # fmt: skip
                        err = ((got - want).abs().max() / want.abs().max()).item()
                        good = err < tol
                    except Exception as e:  # noqa: BLE001
                        err, good = f"{type(e).__name__}: {e}"[:200], False
                    rows.append(
                        dict(block=name, dtype=str(dtype), route=route, rel_err=err, ok=good)
                    )
            del model
            torch.cuda.empty_cache()
    return rows
