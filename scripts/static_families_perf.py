"""Step times of the static (CUDA-graph) path on random targets of published shapes, against
the HBM floor, and HF ``generate`` on the same shape (the ``big`` part of
``scripts/gpu_check_static_families.py``; bf16; one GPU).

Per shape: a random target and a random 5-layer draft of its shape, a prompt of ``PROMPT``
tokens prefilled; then, with the captured graphs replayed ``REPS`` times each (CUDA events):

- ``block1_ms``: the width-1 verify graph (a block-1 decode step: one target forward);
- ``floor_ms``: the bytes that step must read (every non-expert weight of the target but the
  embedding table, of which one row; the router's top-K experts of each expert layer; the K/V rows
  each layer sees: min(window, context) per layer, K and V) over the HBM bandwidth measured here
  (a read-only reduction over 4 GiB; ``hbm_gbps``); ``block1_vs_floor`` = block1_ms / floor_ms;
- ``block16_ms``: the width-16 verify graph plus the draft's 16-wide graph (one speculative step
  of block 16); ``block16_vs_block1``; ``floor16_ms``: the 16-row verify's bytes (MoE: the
  experts 16 rows hit under uniform routing, most of them at gpt-oss's 32), ``verify16_vs_floor16``;
- ``verify1_ms_grouped``, ``verify16_ms_grouped``: MoE shapes, the verify graphs again with the
  ``grouped`` expert route in place of ``fused`` (:func:`dflash.backends.static.moe.moe_route`);
- ``hf_ms_per_token``: HF ``generate`` (greedy, its own default attention) of ``HF_TOKENS`` tokens
  after the same prompt, per token (prefill excluded: the time of a 1-token generate subtracted).

Goals (issue): block1_vs_floor <= 1.2 for dense sliding targets, <= 1.35 for MoE;
block16_vs_block1 <= 1.5. Not pass/fail: the figures are reported.
"""

from __future__ import annotations

import gc
import time

import torch

PROMPT = 1024
REPS = 30
HF_TOKENS = 32
GIB = 1 << 30

GPT_OSS_20B = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                   num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072)  # fmt: skip
QWEN3_CODER_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                           num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                           num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                           max_position_embeddings=262144, rope_theta=10000000.0)  # 24 of 48 layers  # fmt: skip
# Gemma-4-31B text as we understand its published config (5 sliding : 1 full, window 1024,
# global layers with head dim 512 and 4 K/V heads sharing K and V); 30 of its 60 layers
GEMMA4_31B = dict(vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_hidden_layers=30,
                  num_attention_heads=32, num_key_value_heads=16, head_dim=256, global_head_dim=512,
                  num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=1024,
                  layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5, final_logit_softcapping=30.0,
                  hidden_size_per_layer_input=0, max_position_embeddings=262144)  # fmt: skip
SHAPES = {  # name -> (config class, arguments, moe, layers of the published model)
    "gpt_oss_20b": ("GptOssConfig", GPT_OSS_20B, True, 24),
    "qwen3_coder_30b_a3b_24of48": ("Qwen3MoeConfig", QWEN3_CODER_30B_A3B, True, 48),
    "gemma4_31b_text_30of60": ("Gemma4TextConfig", GEMMA4_31B, False, 60),
}


def hbm_gbps(dev: torch.device) -> float:
    """Read bandwidth (GB/s) of a sum over a 4 GiB bf16 tensor (best of 5)."""
    x = torch.ones(2 * GIB, dtype=torch.bfloat16, device=dev)
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        x.sum()
        torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    del x
    return 4 * GIB / best / 1e9


def _expert_bytes(target) -> tuple[int, int, int]:
    """(bytes of all expert tensors, bytes of one expert's weights per layer summed over layers,
    experts chosen per row) of the target's expert blocks (0s when dense)."""
    total = per_expert = 0
    top_k = 0
    for layer in target.model.layers:
        ex = getattr(getattr(layer, "mlp", None), "experts", None) or getattr(
            layer, "experts", None
        )
        if ex is None or not hasattr(ex, "gate_up_proj"):
            continue
        tensors = [p for n, p in ex.named_parameters()]
        size = sum(p.numel() * p.element_size() for p in tensors)
        total += size
        per_expert += size // ex.gate_up_proj.shape[0]
        cfg = target.config
        top_k = int(
            getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "top_k_experts", 0) or 0
        )
    return total, per_expert, top_k


def floor_bytes(be, context: int, rows: int = 1) -> dict:
    """Bytes a step of ``rows`` rows reads at ``context`` committed rows (see the module
    docstring); ``rows`` > 1: the distinct experts a layer's rows hit, expected under uniform
    routing (E * (1 - (1 - K/E)^rows)), and the KV rows of the last row."""
    target = be.target
    params = sum(p.numel() * p.element_size() for p in target.parameters())
    emb = target.get_input_embeddings().weight
    lm = target.get_output_embeddings().weight
    emb_bytes = emb.numel() * emb.element_size() if emb.data_ptr() != lm.data_ptr() else 0
    experts, per_expert, top_k = _expert_bytes(target)
    n_experts = experts // per_expert if per_expert else 0
    hit = n_experts * (1 - (1 - top_k / n_experts) ** rows) if n_experts else 0
    kv = 0
    for i in range(be.n_layers):  # a layer sharing K/V reads its source's rows again
        k = be.k[i]
        rows = context + 1 if be.windows[i] is None else min(be.windows[i], context + 1)
        kv += 2 * k.shape[1] * rows * k.shape[3] * k.element_size()
    weights = params - emb_bytes - experts + per_expert * hit
    return {
        "weights_gb": round(weights / 1e9, 3),
        "kv_gb": round(kv / 1e9, 4),
        "total_gb": round((weights + kv) / 1e9, 3),
    }


def _time_graph(key_graph, reps: int) -> float:
    """Milliseconds per replay of a captured graph (CUDA events, after 3 warm replays)."""
    graph = key_graph[0]
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def measure(name: str, dev: torch.device, build_target, build_draft, bandwidth: float,
            profile: bool = False) -> dict:  # fmt: skip
    """Build the ``name`` shape (bf16), prefill, time the graphs and HF generate (see module doc)."""
    from dflash.backends.static.backend import StaticBackend

    cls_name, kwargs, moe, full_layers = SHAPES[name]
    row: dict = {"layers": f"{kwargs['num_hidden_layers']} of {full_layers}", "moe": moe}
    target = build_target(cls_name, kwargs, torch.bfloat16, dev, 0.02)
    draft = build_draft(target, dev, layers=5)
    vocab = kwargs["vocab_size"]
    prompt = torch.randint(
        4, vocab - 1, (PROMPT,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    be = StaticBackend(target, draft, dev)
    be.reset(PROMPT + 64)
    with torch.inference_mode():
        be.prefill(prompt, True)
    torch.cuda.synchronize(dev)
    row["describe"] = {k: v for k, v in be.describe().items()
                       if k in ("attention", "moe_route", "family", "sliding_windows", "linear", "device_loop")}  # fmt: skip
    # what the forwards run (after any fall-back): the ladder's live rungs and the choices
    row["chosen"] = {"attention": be.attention, "linear": be.linear, "moe_route": be.moe_route,
                     "target_rope": bool(be.target_rope), "norm_kernel": bool(be.norm_kernel),
                     "fuse_norm": bool(getattr(be, "fuse_norm", False)), "live": sorted(be.live_kernels("target"))}  # fmt: skip
    start = PROMPT
    verify1 = be._verify_graph(1)
    verify1[2][1][0].copy_(be.key_pos[start : start + 1])  # position of the step's row
    row["block1_ms"] = round(_time_graph(verify1, REPS), 4)
    if profile:  # where a block-1 step's time goes
        from static_families_profile import profile_step

        try:
            ids1, pos1 = verify1[2][0], verify1[2][1]
            row["profile_block1"] = profile_step(
                verify1[0], lambda b=be: b._target_forward(ids1, pos1)
            )
        except Exception as e:  # noqa: BLE001 - the profiler is a report, not a check
            row["profile_block1"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    verify16 = be._verify_graph(16)
    verify16[2][1][0].copy_(be.key_pos[start : start + 16])
    draft16 = be._draft_graph(16)
    draft16[2][1].fill_(start)
    draft16[2][2].copy_(be.key_pos[start - 16 : start])
    row["verify16_ms"] = round(_time_graph(verify16, REPS), 4)
    row["draft16_ms"] = round(_time_graph(draft16, REPS), 4)
    row["block16_ms"] = round(row["verify16_ms"] + row["draft16_ms"], 4)
    row["block16_vs_block1"] = round(row["block16_ms"] / row["block1_ms"], 3)
    fb = floor_bytes(be, start)
    row["floor"] = fb
    row["floor_ms"] = round(fb["total_gb"] / bandwidth * 1e3, 4)
    row["block1_vs_floor"] = round(row["block1_ms"] / row["floor_ms"], 3)
    fb16 = floor_bytes(be, start + 15, 16)  # a 16-row verify: the experts its rows hit
    row["floor16_ms"] = round(fb16["total_gb"] / bandwidth * 1e3, 4)
    row["verify16_vs_floor16"] = round(row["verify16_ms"] / row["floor16_ms"], 3)
    row["goal_block1"] = 1.35 if moe else 1.2
    if be.moe_route == "fused":  # the same steps with the grouped_mm route, for comparison
        be.moe_route = "grouped"
        be.graphs.clear()
        be.capture_all()
        for width in (1, 16):
            graph = be._verify_graph(width)
            graph[2][1][0].copy_(be.key_pos[start : start + width])
            row[f"verify{width}_ms_grouped"] = round(_time_graph(graph, REPS), 4)
    del be, draft, verify1, verify16, draft16
    gc.collect()  # the backend and its device loop refer to each other
    torch.cuda.empty_cache()
    ids = torch.tensor([prompt], device=dev)
    times = {}
    for n in (1, HF_TOKENS + 1):
        with torch.inference_mode():
            target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
                            do_sample=False, pad_token_id=1)  # warm-up  # fmt: skip
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, eos_token_id=None, pad_token_id=1)  # fmt: skip
            torch.cuda.synchronize(dev)
            times[n] = time.perf_counter() - t0
    row["hf_ms_per_token"] = round((times[HF_TOKENS + 1] - times[1]) / HF_TOKENS * 1e3, 3)
    row["hf_vs_block1"] = round(row["hf_ms_per_token"] / row["block1_ms"], 2)
    del target
    torch.cuda.empty_cache()
    return row


def check_perf(dev: torch.device, build_target, build_draft, only: list[str] | None = None,
               profile: bool = False) -> dict:  # fmt: skip
    """Every shape of :data:`SHAPES` (or ``only``); ``ok`` is False only when one fails to run.
    ``profile``: each shape's block-1 graph under torch.profiler (``profile_block1``: the top
    CUDA kernels) and the expert GEMV tile sweep (``moe_tiles``)."""
    import traceback

    res: dict = {"hbm_gbps": round(hbm_gbps(dev), 1), "prompt": PROMPT}
    if profile:
        from static_families_profile import moe_tile_sweep

        try:
            res["moe_tiles"] = moe_tile_sweep(dev, res["hbm_gbps"])
        except Exception as e:  # noqa: BLE001 - a report
            res["moe_tiles"] = [{"error": f"{type(e).__name__}: {e}"[:300]}]
    ok = True
    for name in only or SHAPES:
        t0 = time.perf_counter()
        try:
            res[name] = measure(name, dev, build_target, build_draft, res["hbm_gbps"], profile)
        except Exception:  # noqa: BLE001 - report it and go on
            res[name] = {"error": traceback.format_exc()[-2500:]}
            ok = False
            torch.cuda.empty_cache()
        res[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(name, {k: v for k, v in res[name].items()
                     if k.endswith(("_ms", "vs_floor", "vs_floor16", "vs_block1", "token", "chosen"))}, flush=True)  # fmt: skip
        for k in (res[name].get("profile_block1") or {}).get("top", [])[:8]:
            print("   ", k["us"], "us", k["calls"], "x", k["kernel"][:90], flush=True)
    res["ok"] = ok
    return res
