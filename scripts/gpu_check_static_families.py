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
from static_families_perf import check_perf  # noqa: E402

WINDOW = 8
INTERLEAVED = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
               "full_attention", "sliding_attention"]  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
TINY = {  # family -> (config class, arguments beyond tests/helpers/target_families.py's BASE)
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    "qwen3_interleaved": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=WINDOW,
                                              layer_types=INTERLEAVED)),
    "qwen3_moe": ("Qwen3MoeConfig", MOE),
    "qwen3_moe_window": ("Qwen3MoeConfig", dict(MOE, use_sliding_window=True, sliding_window=WINDOW,
                                                mlp_only_layers=[1, 4])),
}  # fmt: skip
MISTRAL_7B = dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, sliding_window=256,
                  max_position_embeddings=32768, rope_theta=1000000.0)  # fmt: skip
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=8,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                     max_position_embeddings=40960, rope_theta=1000000.0)  # 8 of 48 layers  # fmt: skip
BIG = {
    "mistral_7b_w256": ("MistralConfig", MISTRAL_7B),
    "qwen3_30b_a3b_8layers": ("Qwen3MoeConfig", QWEN3_30B_A3B),
}
# families with their own static forward (dflash.backends.static.families), tiny configs from
# tests/helpers/target_families.py (window 8, float32)
PERF_MOE_LAYERS = {  # one layer each, for the expert-block checks
    "gpt_oss": ("GptOssConfig", dict(vocab_size=1024, hidden_size=2880, intermediate_size=2880, num_hidden_layers=1,
                                     num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                     num_experts_per_tok=4, sliding_window=128, layer_types=["sliding_attention"])),
    "gemma4_moe": ("Gemma4TextConfig", dict(vocab_size=1024, hidden_size=2816, intermediate_size=2112,
                                            num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8,
                                            head_dim=256, enable_moe_block=True, num_experts=128, top_k_experts=8,
                                            moe_intermediate_size=704, hidden_size_per_layer_input=0,
                                            layer_types=["sliding_attention"])),
}  # fmt: skip
# tests/helpers/target_families.py's tiny layouts (the device gets dflash/ and scripts/ only)
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, pad_token_id=1, bos_token_id=None, eos_token_id=3)  # fmt: skip
ALTERNATE = ["sliding_attention", "full_attention"] * 3
GEMMA4 = dict(head_dim=16, global_head_dim=32, sliding_window=WINDOW, layer_types=ALTERNATE,
              vocab_size_per_layer_input=256, hidden_size_per_layer_input=8)  # fmt: skip
FAMILY_CONFIGS = {  # family -> (config class, arguments beyond BASE, init range)
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
                0.3),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                                             layer_types=ALTERNATE), 0.02),
    "gemma4_text": ("Gemma4TextConfig", GEMMA4, 0.02),
    "gemma4_moe": ("Gemma4TextConfig", dict(GEMMA4, enable_moe_block=True, num_experts=4, top_k_experts=2,
                                            moe_intermediate_size=32), 0.02),
    "gemma4_kv_shared": ("Gemma4TextConfig", dict(GEMMA4, num_kv_shared_layers=2), 0.02),
    "gemma4_k_eq_v": ("Gemma4TextConfig", dict(GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1), 0.02),
}  # fmt: skip


def family_config(family: str):
    """The tiny transformers config of a :data:`FAMILY_CONFIGS` family."""
    import transformers

    cls, kwargs, init = FAMILY_CONFIGS[family]
    return getattr(transformers, cls)(**BASE, **kwargs, initializer_range=init)


FAMILY_TINY = [
    "gpt_oss",
    "gemma3_text",
    "gemma4_text",
    "gemma4_moe",
    "gemma4_kv_shared",
    "gemma4_k_eq_v",
]


def build_target(
    cls_name: str,
    kwargs: dict,
    dtype: torch.dtype,
    dev: torch.device,
    init: float,
    seed: int = 0,
    cfg=None,
):
    """A random target built on ``dev`` in ``dtype`` (eval mode); ``cfg``: this config instead."""
    import transformers

    if cfg is None:
        cfg = getattr(transformers, cls_name)(
            **kwargs, tie_word_embeddings=False, initializer_range=init
        )
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    finally:
        torch.set_default_dtype(default)


def build_draft(target, dev: torch.device, seed: int = 0, layers: int = 2):
    from dflash.models.draft_torch import DFlashDraft
    from dflash.models.init_draft import draft_config_for

    cfg = target.config
    dcfg = draft_config_for(cfg, layers=layers, block_size=16, mask_token_id=cfg.vocab_size - 1,
                            vocab_rows=cfg.vocab_size)  # fmt: skip
    torch.manual_seed(seed)
    return DFlashDraft(dcfg).to(dev, target.dtype).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=1)  # fmt: skip
    return out[0, len(prompt) :].tolist()


class Scripted:
    """A backend whose draft proposes the true continuation (host side; full blocks)."""

    def __init__(self, inner, truth: list[int], prompt_len: int):
        self.inner, self.truth, self.prompt_len = inner, truth, prompt_len

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, anchor, context, start, length):
        true = self.truth[start - self.prompt_len + 1 :][: length - 1]
        true = true + [4] * (length - 1 - len(true))
        return torch.tensor(true, device=self.inner.device), None


def generate(be, prompt: list[int], block: int, n: int) -> list[int]:
    from dflash.loop import speculative_generate

    return [t for r in speculative_generate(be, prompt, block_size=block, max_new_tokens=n, stop_ids=[])
            for t in r.tokens]  # fmt: skip


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


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

    out["family_kernels"] = check_family_kernels(dev)  # Gemma's head dims, rope_cache_family, the MoE kernels
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
            d, build_target, build_draft, args.shapes.split(",") if args.shapes else None, args.profile
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
