"""GPU check of the static (CUDA-graph) path on sliding-window, interleaved and MoE targets.

    PYTHONPATH=. python3 scripts/gpu_check_static_families.py [--only kernel,tiny,big,parity] [--out DIR]
        [--families gpt_oss,gemma3_text,...] [--shapes gpt_oss_20b,...] [--profile]

Prints one JSON object (also written to ``DIR/gpu_check_static_families.json``, DIR = --out,
else $OUT, else ./gpu_check_out) and exits 1 when a check fails:

- ``kernel``: the split-KV attention kernel with a sliding window (float32 and bf16; 1- and
  16-row queries; windows 1 to past the filled length; caches of several slices) against SDPA
  with the window mask; and the MoE block's ``gather`` and ``grouped`` routes against
  transformers' own expert block (a Qwen3-30B-A3B-shaped layer, bf16 and float32); the kernel
  with attention sinks (gpt-oss's head layout) against the softmax with the sink column; gpt-oss's
  and Gemma 4's expert blocks against transformers' (one layer of their shapes).
- ``tiny``: random float32 targets of each family the static path now runs (Mistral with a
  window of 8, Qwen2 with ``use_sliding_window``, Qwen3 with interleaved ``layer_types``,
  Qwen3-MoE with and without windows; gpt-oss, Gemma 3 text, Gemma 4 text with MoE and with
  shared K/V layers: the test helpers' configs), prompts of 40 tokens: the static path's greedy ids with
  CUDA graphs (device loop; SDPA and the split-KV kernel; blocks 1, 4, 16; a scripted draft that
  proposes the truth: full blocks) equal HF ``generate`` and the plain path.
- ``big``: step times of gpt-oss-20b, Qwen3-Coder-30B-A3B (24 of 48 layers) and Gemma-4-31B text
  (30 of 60 layers) shaped random bf16 targets against the HBM floor, block 16 against block 1,
  and HF ``generate`` on the same shape (``scripts/static_families_perf.py``; reported, not checked).
- ``parity``: random targets of published shapes, fewer layers where memory asks (Mistral-7B with
  a 256-token window, 600-token prompts; Qwen3-30B-A3B with 8 of its 48 layers): float32 (SDPA
  with the window masks), the static path's ids against the plain path's (expected equal); bf16
  (every kernel: the split-KV kernel with windows, grouped_mm experts),
  where rounding may part them, the first differing position (``diverged_at``, None: never) and
  seconds per request of both paths (not a benchmark: one run each, after a warm-up).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from static_families_kernels import check_kernel  # noqa: E402
from static_families_models import (  # noqa: E402
    BASE,
    BIG,
    FAMILY_TINY,
    TINY,
    Scripted,
    build_draft,
    build_target,
    family_config,
    first_difference,
    generate,
    hf_greedy,
)
from static_families_perf import check_perf  # noqa: E402


def check_tiny(dev: torch.device, families=tuple(TINY) + tuple(FAMILY_TINY)) -> dict:
    """Every family, float32: static (graphs) == plain path == HF generate."""
    from dflash.backends.plain import TransformersBackend
    from dflash.backends.static.backend import StaticBackend
    from dflash.kernels.settings import KernelSettings

    prompt = torch.randint(4, 250, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    res, ok = {}, True
    cases = [(f, TINY[f]) for f in TINY if f in families] + [
        (f, None) for f in FAMILY_TINY if f in families
    ]
    for family, spec in cases:
        if spec is None:  # gpt-oss, Gemma 3/4 text: the test helpers' configs
            target = build_target("", {}, torch.float32, dev, 0.0, cfg=family_config(family))
        else:
            target = build_target(spec[0], {**BASE, **spec[1]}, torch.float32, dev, 0.3)
        draft = build_draft(target, dev)
        truth = hf_greedy(target, prompt, 48)
        row = {"varied": len(set(truth)) > 4}
        row["plain"] = generate(TransformersBackend(target, draft, dev), prompt, 16, 48) == truth
        for attention in (
            "auto",
            "split",
        ):  # float32 auto = SDPA with masks; split: the Triton kernel
            settings = dataclasses.replace(
                KernelSettings(), attention=attention, linear="torch", pdl="0"
            )
            be = StaticBackend(target, draft, dev, settings=settings)
            row[f"{attention}_windows"] = be.windows
            row[f"{attention}_moe_route"] = be.moe_route
            for block in (1, 4, 16):
                got = generate(be, prompt, block, 48)
                row[f"{attention}_block{block}"] = got == truth
                if got != truth:
                    row[f"{attention}_block{block}_diverged_at"] = first_difference(got, truth)
            row[f"{attention}_attention_after"] = (
                be.attention
            )  # "sdpa" after split: the kernel fell back
            loopless = StaticBackend(target, draft, dev, settings=settings, device_loop=False)
            row[f"{attention}_full_blocks"] = (
                generate(Scripted(loopless, truth, len(prompt)), prompt, 16, 48) == truth
            )
        # bf16 with every kernel on (the split-KV kernel with windows, RoPE/linear kernels, PDL):
        # ids against the plain path in bf16 (rounding may part them: the first difference)
        t16, d16 = target.to(torch.bfloat16), draft.to(torch.bfloat16)
        plain16 = generate(TransformersBackend(t16, d16, dev), prompt, 16, 48)
        be = StaticBackend(t16, d16, dev)
        for block in (1, 16):
            row[f"bf16_block{block}_diverged_at"] = first_difference(
                generate(be, prompt, block, 48), plain16
            )
        row["bf16_kernels"] = {
            "attention": be.attention,
            "linear": be.linear,
            "rope": be.target_rope,
        }
        row["ok"] = all(v for k, v in row.items() if isinstance(v, bool))
        ok &= row["ok"]
        res[family] = row
        print(
            family,
            {k: v for k, v in row.items() if isinstance(v, bool) or "diverged" in k},
            flush=True,
        )
        del target, draft
        torch.cuda.empty_cache()
    res["ok"] = bool(ok)
    return res


def check_big(dev: torch.device) -> dict:
    """Published shapes: float32 (split kernel forced) static == plain; bf16 agreement + seconds."""
    from dflash.backends.plain import TransformersBackend
    from dflash.backends.static.backend import StaticBackend
    from dflash.kernels.settings import KernelSettings

    res, ok, n = {}, True, 64
    for name, (cls_name, kwargs) in BIG.items():
        vocab = kwargs["vocab_size"]
        prompt = torch.randint(
            4, vocab - 1, (600,), generator=torch.Generator().manual_seed(1)
        ).tolist()
        for dtype in (torch.float32, torch.bfloat16):
            target = build_target(cls_name, kwargs, dtype, dev, 0.02)
            with (
                torch.no_grad()
            ):  # wide greedy margins: random bf16 logits are near-uniform otherwise
                target.lm_head.weight.mul_(40.0)
            draft = build_draft(target, dev)
            settings = KernelSettings()  # float32: SDPA with masks (exact); bf16: every kernel
            row = {}
            for path in ("plain", "static"):
                be = (TransformersBackend(target, draft, dev) if path == "plain"
                      else StaticBackend(target, draft, dev, settings=settings))  # fmt: skip
                if path == "static":
                    row["windows"] = sorted({str(w) for w in be.windows})
                    row["moe_route"] = be.moe_route
                generate(be, prompt, 16, 8)  # warm-up (graphs captured)
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                row[f"{path}_ids"] = generate(be, prompt, 16, n)
                torch.cuda.synchronize(dev)
                row[f"{path}_seconds"] = round(time.perf_counter() - t0, 3)
                if path == "static":
                    row["kernels"] = {
                        "attention": be.attention,
                        "linear": be.linear,
                        "rope": be.target_rope,
                    }
                del be
            row["diverged_at"] = first_difference(row["static_ids"], row["plain_ids"])
            row["varied"] = len(set(row["plain_ids"])) > 4
            if dtype == torch.float32:
                row["ok"] = row["diverged_at"] is None
                ok &= row["ok"]
            row["plain_ids"], row["static_ids"] = (
                row["plain_ids"][:16],
                row["static_ids"][:16],
            )  # shorter JSON
            res[f"{name}_{str(dtype).split('.')[-1]}"] = row
            del target, draft
            torch.cuda.empty_cache()
    res["ok"] = bool(ok)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only", default="kernel,tiny,big", help="comma list of kernel, tiny, big, parity"
    )
    ap.add_argument(
        "--families", default=",".join((*TINY, *FAMILY_TINY)), help="the tiny part's families"
    )
    ap.add_argument("--shapes", default="", help="the big part's shapes (default: all)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    ap.add_argument("--profile", action="store_true",
                    help="big: torch.profiler's top CUDA kernels of each shape's block-1 step, the MoE GEMV tile sweep")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "needs a CUDA device"}))
        return 2
    dev = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    try:
        import transformers
        import triton

        report["transformers"], report["triton"] = transformers.__version__, triton.__version__
    except ImportError as e:
        report["import_error"] = str(e)
    checks = {
        "kernel": check_kernel,
        "tiny": lambda d: check_tiny(d, args.families.split(",")),
        "big": lambda d: check_perf(
            d,
            build_target,
            build_draft,
            args.shapes.split(",") if args.shapes else None,
            args.profile,
        ),
        "parity": check_big,
    }
    for name in args.only.split(","):
        t0 = time.perf_counter()
        try:
            report[name] = checks[name](dev)
        except Exception:  # noqa: BLE001 - report it and go on with the next check
            report[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        report[name]["seconds"] = round(time.perf_counter() - t0, 1)
        out = Path(args.out)  # written after every part: a run cut short keeps the parts done
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check_static_families.json").write_text(json.dumps(report, indent=1))
    report["ok"] = all(report[name]["ok"] for name in args.only.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=1)
    (out / "gpu_check_static_families.json").write_text(text)
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
