"""GPU pieces of ``scripts/gpu_check_static_families.py`` for the family forwards' kernels:

- :func:`check_family_kernels` (its ``kernel`` part): the kernels the gpt-oss / Gemma /
  Qwen3-MoE forwards take in bf16 against torch: the split-KV attention at Gemma 4's head dims
  (256 with a window, 512 with k = v), ``rope_cache_family`` against the Gemma modules,
  ``small_linear_glu``'s GELU-tanh epilogue, the MoE router (``moe_topk``) and slot-sum
  (``moe_combine``) kernels;
- :func:`profile_step` (``--profile``): torch.profiler over replays of a captured graph, the
  top CUDA kernels by time per replay;
- :func:`moe_tile_sweep` (``--profile``): the expert GEMV kernels' tiles (output features per
  program, input features per iteration) at gpt-oss-20b's and Qwen3-Coder-30B-A3B's block-1
  shapes, the experts drawn afresh every call (their weights not in L2), microseconds and GB/s.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return (
        (got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6)
    ).item()


def check_family_kernels(dev: torch.device) -> list:
    """One row per check: name, relative error, ok (bf16 tolerances)."""
    from dflash.kernels import split_attention as sa
    from dflash.kernels.moe_gemv import moe_combine, moe_topk, moe_topk_reference
    from dflash.kernels.rms_norm import ONE_PLUS, ROUND_ONCE
    from dflash.kernels.rope_cache import rope_cache_family, rope_cache_family_reference
    from dflash.kernels.small_linear import small_linear_glu
    from dflash.models.draft_torch import rope_cos_sin

    rows = []

    def record(name, fn, tol):
        try:
            err = fn()
            rows.append({"check": name, "rel_err": err, "ok": bool(err < tol)})
        except Exception as e:  # noqa: BLE001 - report and go on
            rows.append({"check": name, "error": f"{type(e).__name__}: {e}"[:300], "ok": False})

    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16

    def attention(h, hkv, t, d, cap, start, window, k_eq_v):
        q = torch.randn(1, t, h, d, generator=g, device=dev, dtype=bf).transpose(1, 2)
        k = torch.randn(1, hkv, cap, d, generator=g, device=dev, dtype=bf)
        v = k if k_eq_v else torch.randn(1, hkv, cap, d, generator=g, device=dev, dtype=bf)
        pos = torch.arange(start, start + t, device=dev)
        keys = torch.arange(cap, device=dev)[None]
        mask = keys <= pos[:, None]
        if window:
            mask = mask & (keys > pos[:, None] - window)
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask[None, None],
                                              scale=1.0 / math.sqrt(d), enable_gqa=True)  # fmt: skip
        got = sa.split_attention(q, k, v, pos, 1.0 / math.sqrt(d), window=window or None)
        return _rel(got, want)

    for t in (
        1,
        16,
    ):  # Gemma-4-31B: sliding 32 x 256 over 16 K/V heads, global 32 x 512 over 4 (k = v)
        record(
            f"split_attention d256 window1024 t{t}",
            lambda t=t: attention(32, 16, t, 256, 2048, 1500, 1024, False),
            2e-2,
        )
        record(
            f"split_attention d512 k=v t{t}",
            lambda t=t: attention(32, 4, t, 512, 2048, 1500, 0, True),
            2e-2,
        )

    def rope(mode, d, h, hkv, k_eq_v):
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
        from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

        cls = Gemma3RMSNorm if mode == ONE_PLUS else Gemma4RMSNorm
        qn, kn = cls(d, 1e-6).to(dev, bf), cls(d, 1e-6).to(dev, bf)
        vn = Gemma4RMSNorm(d, 1e-6, with_scale=False).to(dev, bf) if mode == ROUND_ONCE else None
        with torch.no_grad():
            for n in (qn, kn):
                n.weight.copy_(torch.randn(d, generator=g, device=dev) * 0.5)
        t = 16
        qkv = (
            torch.randn(t, (h + (1 if k_eq_v else 2) * hkv) * d, generator=g, device=dev, dtype=bf)
            * 3
        )
        pos = torch.arange(100, 100 + t, device=dev)
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=dev).float() / d))
        cos, sin = rope_cos_sin(pos[None], inv, 1.0, bf)
        caches = [torch.zeros(1, hkv, 256, d, device=dev, dtype=bf) for _ in range(4)]
        with torch.no_grad():
            want = rope_cache_family_reference(
                qkv, qn, kn, vn, cos, sin, pos, caches[0], caches[1], h, hkv, k_eq_v
            )
            got = rope_cache_family(
                qkv, qn, kn, vn, cos, sin, pos, caches[2], caches[3], h, hkv, mode, k_eq_v
            )
        return max(_rel(got, want), _rel(caches[2], caches[0]), _rel(caches[3], caches[1]))

    record("rope_cache_family gemma3 d128", lambda: rope(ONE_PLUS, 128, 8, 4, False), 3e-2)
    record("rope_cache_family gemma4 d256", lambda: rope(ROUND_ONCE, 256, 32, 16, False), 3e-2)
    record("rope_cache_family gemma4 d512 k=v", lambda: rope(ROUND_ONCE, 512, 32, 4, True), 3e-2)

    def geglu(m):
        x = torch.randn(m, 5376, generator=g, device=dev, dtype=bf)
        w = torch.randn(2 * 4096, 5376, generator=g, device=dev, dtype=bf) / 64
        y = F.linear(x, w).float()
        gate, up = y.chunk(2, -1)
        return _rel(small_linear_glu(x, w, act="gelu_tanh"), F.gelu(gate, approximate="tanh") * up)

    record("small_linear_glu gelu_tanh m1", lambda: geglu(1), 2e-2)
    record("small_linear_glu gelu_tanh m16", lambda: geglu(16), 2e-2)

    def sandwich():  # Gemma-4-31B's post-norm + residual + layer scalar (+ the next norm)
        from dflash.kernels.add_norm import add_norm, add_norm_reference

        a, r = (torch.randn(16, 5376, generator=g, device=dev, dtype=bf) for _ in range(2))
        w1, w2 = (torch.randn(5376, generator=g, device=dev, dtype=bf) for _ in range(2))
        s = torch.tensor([0.5], device=dev, dtype=bf)
        x, h = add_norm(a, r, w1, 1e-6, ROUND_ONCE, s, w2, 1e-6)
        xr, hr = add_norm_reference(a, r, w1, 1e-6, ROUND_ONCE, s, w2, 1e-6)
        return max(_rel(x, xr), _rel(h, hr))

    record("add_norm gemma4 5376", sandwich, 2e-2)

    def topk(e, k, first):
        logits = torch.randn(16, e, generator=g, device=dev, dtype=bf) * 2
        w, i = moe_topk(logits, k, first)
        w_ref, i_ref = moe_topk_reference(logits, k, first)
        same = (i == i_ref).float().mean().item()  # bf16 logits can tie: the picks may swap there
        return max(1.0 - same, _rel(w, w_ref) if same == 1.0 else 0.0)

    record("moe_topk qwen3 128x8", lambda: topk(128, 8, True), 2e-2)
    record("moe_topk gpt_oss 32x4", lambda: topk(32, 4, False), 2e-2)

    def combine():
        y = torch.randn(16 * 8, 2048, generator=g, device=dev)
        r = torch.randn(16, 2048, generator=g, device=dev, dtype=bf)
        return _rel(moe_combine(y, 8, r), r + y.view(16, 8, -1).sum(1).to(bf))

    record("moe_combine 16x8x2048", combine, 1e-2)
    return rows


def profile_step(graph, eager=None, reps: int = 5, top: int = 15) -> dict:
    """The top ``top`` CUDA kernels by time over ``reps`` replays of a captured CUDA graph
    (per replay: microseconds, calls), and the replay's kernel count and summed kernel time.
    Where this profiler sees no kernel inside graph replays, ``eager()`` (the same forward
    outside the graph) is profiled instead (``source`` says which)."""

    res = _profile(graph.replay, reps, top)
    res["source"] = "graph"
    if not res["top"] and eager is not None:
        res = _profile(eager, reps, top)
        res["source"] = "eager"
    return res


def _profile(step, reps: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(reps):
                step()
            torch.cuda.synchronize()
    kernels: dict = {}
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        k = kernels.setdefault(e.name, [0.0, 0])
        k[0] += e.time_range.elapsed_us()  # a kernel's own span on the device
        k[1] += 1
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for v in kernels.values())
    return {
        "kernels_per_replay": round(sum(v[1] for v in kernels.values()) / reps, 1),
        "kernel_us_per_replay": round(total / reps, 1),
        "top": [{"kernel": name[:120], "us": round(t / reps, 2), "calls": round(n / reps, 2),
                 "share": round(t / total, 3) if total else None} for name, (t, n) in ranked[:top]],
    }  # fmt: skip


def moe_tile_sweep(dev: torch.device, hbm_gbps: float) -> list:
    """The expert GEMV kernels' tiles at block-1 shapes (see the module docstring)."""
    from dflash.kernels.moe_gemv import moe_gemv, moe_glu

    bf = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = {  # name: (experts, hidden, intermediate, top-k, transposed (gpt-oss's x @ W), act)
        "gpt_oss_20b": (32, 2880, 2880, 4, True, "gpt_oss"),
        "qwen3_coder_30b_a3b": (128, 2048, 768, 8, False, "silu"),
    }
    tiles = ((0, 0), (16, 128), (64, 64), (128, 32), (16, 256))  # each a compile: few
    rows = []
    for name, (e, hidden, inter, k, transposed, act) in shapes.items():
        if transposed:
            gu = torch.randn(e, hidden, 2 * inter, generator=g, device=dev, dtype=bf)
            down = torch.randn(e, inter, hidden, generator=g, device=dev, dtype=bf)
        else:
            gu = torch.randn(e, 2 * inter, hidden, generator=g, device=dev, dtype=bf)
            down = torch.randn(e, hidden, inter, generator=g, device=dev, dtype=bf)
        x = torch.randn(1, hidden, generator=g, device=dev, dtype=bf)
        a = torch.randn(k, inter, generator=g, device=dev, dtype=bf)
        picks = [torch.randperm(e, device=dev)[:k] for _ in range(40)]  # fresh experts per call
        per_call = k * (2 * inter * hidden + inter * hidden) * 2  # bytes of the K experts' weights
        for bn, bk in tiles:
            try:
                for ex in picks[:3]:  # compile
                    moe_glu(x, gu, ex, None, act, act == "gpt_oss", transposed, 1.702, 7.0, x_div=k, block_n=bn,
                            block_k=bk)  # fmt: skip
                    moe_gemv(a, down, ex, None, transposed, block_n=bn, block_k=bk)
                torch.cuda.synchronize()
                times = {}
                for part in ("glu", "down"):
                    start, end = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    start.record()
                    for ex in picks:
                        if part == "glu":
                            moe_glu(x, gu, ex, None, act, act == "gpt_oss", transposed, 1.702, 7.0, x_div=k,
                                    block_n=bn, block_k=bk)  # fmt: skip
                        else:
                            moe_gemv(a, down, ex, None, transposed, block_n=bn, block_k=bk)
                    end.record()
                    torch.cuda.synchronize()
                    times[part] = start.elapsed_time(end) / len(picks) * 1e3
                us = times["glu"] + times["down"]
                rows.append({"shape": name, "block_n": bn or "default", "block_k": bk or "default",
                             "glu_us": round(times["glu"], 2), "down_us": round(times["down"], 2),
                             "gbps": round(per_call / us / 1e3, 1), "of_hbm": round(per_call / us / 1e3 / hbm_gbps, 3)})  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit
                rows.append(
                    {
                        "shape": name,
                        "block_n": bn,
                        "block_k": bk,
                        "error": f"{type(e).__name__}: {e}"[:200],
                    }
                )
        del gu, down
        torch.cuda.empty_cache()
    return rows
