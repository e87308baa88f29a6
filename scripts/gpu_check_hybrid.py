"""GPU check and benchmark of GatedDeltaNet hybrids on the static (CUDA-graph) path.

    PYTHONPATH=. python3 scripts/gpu_check_hybrid.py [--only kernel,tiny,big] [--out DIR] [--device cpu]

Prints a short summary and writes ``DIR/gpu_check_hybrid.json`` (DIR = --out, else $OUT, else
./gpu_check_hybrid_out); exits 1 when a check fails (the speed goals are reported, not checked):

- ``kernel``: the fused Triton verify kernel (:func:`dflash.kernels.gdn_triton.gdn_verify`)
  against the torch reference (prepare + recurrent_verify) at a Qwen3.5-9B layer's shape (16 key
  and 32 value heads of 128), 1, 4 and 16 tokens, float32 and bf16 inputs: outputs and per-token
  states within 1e-5 (float32) / 1e-4 (bf16) of the largest value; the chunked prefill against the
  recurrence (300 tokens, float32); the time of one layer's verify (kernel and torch) and of the
  rollback of all 24 layers' states (µs, CUDA events).
- ``tiny``: tiny random float32 qwen3_5_text / qwen3_next / qwen3_5_moe targets (TF32 off): the
  graph path's greedy ids (device loop and host loop; blocks 1, 3, 16) equal HF ``generate``;
  scripted schedules [15, 0, 3, 0, 0, 15] and [0, 0, 0] through the graph path (host loop) and the
  plain path: the same ids, and after every step each GatedDeltaNet layer's committed conv and
  recurrent state within 1e-5 of the plain path's (||a - b|| / ||b||; the largest entry's
  difference over the largest entry is reported beside it), or within twice the plain path's
  own distance to transformers decoding the tokens one at a time, where float32 rounding between
  forward widths alone is larger (measured on the CPU: the MoE targets, about 1e-5).
- ``big``: ``scripts/bench_big.py --shape qwen3.5-9b`` (a random bf16 target of Qwen3.5-9B's text
  shape, 5-layer random draft, prompt 512): ms per step at blocks 1 and 16 (k = 0 and 15), next
  to the HBM floor, without and (time allowing) with ``torch.compile``; then HF ``generate`` on
  the same shape (ms per new token, 32 tokens after the prompt). Goals: block 1 <= 1.2x the
  floor, block 16 <= 1.4x block 1, the rollback <= 5% of a step.

``--device cpu`` runs what it can on the CPU (torch kernels, the tiny checks without graphs, a
miniature bench) to test the script.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FAMILIES = ("qwen3_5_text", "qwen3_next", "qwen3_5_moe")
P, N = 70, 32  # tiny checks: prompt tokens (two prefill chunks), new tokens
HK, HV, DK, DV, LAYERS = 16, 32, 128, 128, 24  # Qwen3.5-9B's GatedDeltaNet layers


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (float32)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius, float32): the tiny checks' relative difference of two states."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def timed_us(fn, dev: torch.device, n: int = 50) -> float:
    """Device time of ``fn`` in µs (CUDA events; wall time on CPU), after a warm-up."""
    fn()
    if dev.type != "cuda":
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(dev)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize(dev)
    return start.elapsed_time(end) / n * 1000


def check_kernel(dev: torch.device) -> dict:
    from dflash.kernels import gdn
    from dflash.kernels.gdn_triton import fits, gdn_verify

    out: dict = {"verify": [], "ok": True}
    triton = fits(DK, DV, dev)
    out["triton"] = triton
    g = torch.Generator(device=dev).manual_seed(0)
    c = 2 * HK * DK + HV * DV
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-4)):
        for t in (1, 4, 16):
            x = torch.randn(t, c, generator=g, device=dev).to(dtype)
            a, b = (torch.randn(t, HV, generator=g, device=dev).to(dtype) for _ in range(2))
            a_log = torch.rand(HV, generator=g, device=dev).mul(16).add(0.01).log().to(dtype)
            dt_bias = torch.rand(HV, generator=g, device=dev).to(dtype)
            ref = torch.zeros(17, HV, DK, DV, device=dev)
            ref[0] = torch.randn(HV, DK, DV, generator=g, device=dev) * 0.3
            got = ref.clone()

            def torch_verify(x=x, a=a, b=b, a_log=a_log, dt_bias=dt_bias, states=ref, t=t):
                q, k, v = x.split((HK * DK, HK * DK, HV * DV), -1)
                prepared = gdn.prepare(
                    q.view(t, HK, DK), k.view(t, HK, DK), v.view(t, HV, DV), a, b, a_log, dt_bias
                )
                return gdn.recurrent_verify(*prepared, states)

            want = torch_verify()
            row = {"dtype": str(dtype).split(".")[-1], "tokens": t,
                   "torch_us": timed_us(torch_verify, dev, 20)}  # fmt: skip
            if triton:
                o = gdn_verify(x, a, b, a_log, dt_bias, got, HK)

                def kernel(x=x, a=a, b=b, a_log=a_log, dt_bias=dt_bias, got=got):
                    return gdn_verify(x, a, b, a_log, dt_bias, got, HK)

                row.update(out_rel=rel(o, want), states_rel=rel(got[1 : t + 1], ref[1 : t + 1]),
                           kernel_us=timed_us(kernel, dev))  # fmt: skip
                row["ok"] = (
                    row["out_rel"] <= tol
                    and row["states_rel"] <= tol
                    and torch.equal(got[0], ref[0])
                )
                out["ok"] &= row["ok"]
            out["verify"].append(row)
    # the chunked prefill against the recurrence (float32)
    t = 300
    q, k = torch.randn(t, HK, DK, device=dev), torch.randn(t, HK, DK, device=dev)
    v, a, b = (
        torch.randn(t, HV, DV, device=dev),
        torch.randn(t, HV, device=dev),
        torch.randn(t, HV, device=dev),
    )
    prepared = gdn.prepare(
        q, k, v, a, b, torch.rand(HV, device=dev).log(), torch.rand(HV, device=dev)
    )
    slots = torch.zeros(t + 1, HV, DK, DV, device=dev)
    want = gdn.recurrent_verify(*prepared, slots)
    state = torch.zeros(HV, DK, DV, device=dev)
    o = gdn.chunked_prefill(*prepared, state)
    out["prefill"] = {"out_rel": rel(o, want), "state_rel": rel(state, slots[t])}
    out["prefill"]["ok"] = out["prefill"]["out_rel"] <= 1e-4 and out["prefill"]["state_rel"] <= 1e-4
    out["ok"] &= out["prefill"]["ok"]
    # the rollback of every GatedDeltaNet layer of Qwen3.5-9B (verify width 16)
    conv = torch.zeros(LAYERS, c, 4 + 16, dtype=torch.bfloat16, device=dev)
    states = torch.zeros(LAYERS, 17, HV, DK, DV, device=dev)
    keep, taps = torch.tensor([7], device=dev), torch.arange(4, device=dev)

    def roll(conv=conv, states=states):
        gdn.rollback(conv, states, keep, taps)

    out["rollback_us"] = timed_us(roll, dev, 100)
    out["rollback_bytes"] = 2 * (states[:, 0].numel() * 4 + conv[..., :4].numel() * 2)
    del conv, states
    return out


def committed(be, layers) -> list:
    """Per GatedDeltaNet layer (conv [C, K], recurrent [Hv, Dk, Dv]) committed, cloned, of a
    static backend (its slots) or the plain path (its cache)."""
    from dflash.backends.static.backend import StaticBackend

    if isinstance(be, StaticBackend):
        return [tuple(x.clone() for x in be.gdn.committed(i)) for i in layers]
    return [(be.cache.layers[i].conv_states[0][0].clone(), be.cache.layers[i].recurrent_states[0][0].clone())
            for i in layers]  # fmt: skip


def check_tiny(dev: torch.device) -> dict:
    from dflash.backends.plain import TransformersBackend
    from dflash.backends.static.backend import StaticBackend
    from dflash.loop import speculative_generate
    from tests.helpers.target_families import ScriptedRollback, build, prompt_ids
    from tests.helpers.tiny import make_draft

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    class Recording(ScriptedRollback):
        def rollback(self, length: int) -> None:
            self.inner.rollback(length)
            self.snapshots.append((length, committed(self.inner, self.layers)))

    def ids(be, block, n=N, wrap=None):
        rounds = speculative_generate(
            wrap or be, prompt_ids(P), block_size=block, max_new_tokens=n, stop_ids=[]
        )
        return [t for r in rounds for t in r.tokens]

    out, ok = {}, True
    graphs = dev.type == "cuda"
    for family in FAMILIES:
        row: dict = {}
        try:
            model = build(family).to(dev)
            draft = make_draft(model).to(dev)
            truth = [t for t in greedy_on(model, prompt_ids(P), 60)]
            layers = [i for i, k in enumerate(model.config.layer_types) if k == "linear_attention"]
            fast = StaticBackend(model, draft, dev, use_graphs=graphs)
            host = StaticBackend(model, draft, dev, use_graphs=graphs, device_loop=False)
            row["describe"] = {k: v for k, v in fast.describe().items()
                               if k in ("gdn_recurrence", "device_loop", "cuda_graphs", "moe_route")}  # fmt: skip
            row["ids"] = {f"{name}_b{bs}": ids(be, bs) == truth[:N] for name, be in (("device_loop", fast),
                          ("host_loop", host)) for bs in (1, 3, 16)}  # fmt: skip
            plain = TransformersBackend(model, draft, dev)
            ref = one_by_one(model, prompt_ids(P) + truth, layers)
            worst, worst_max, baseline, steps = 0.0, 0.0, 0.0, 0
            for schedule in ([15, 0, 3, 0, 0, 15], [0, 0, 0]):
                runs = []
                for inner in (host, plain):
                    be = Recording(inner, truth, P, schedule)
                    be.layers = layers
                    got = ids(inner, 16, 56, wrap=be)
                    row["ids"][f"scripted_{schedule}_{type(inner).__name__}"] = got == truth[:56]
                    runs.append(be.snapshots)
                for (n1, a), (n2, b) in zip(*runs, strict=True):
                    assert n1 == n2
                    pairs = [
                        (x, y)
                        for sa, sb in zip(a, b, strict=True)
                        for x, y in zip(sa, sb, strict=True)
                    ]
                    worst = max(worst, *(rel_norm(x, y) for x, y in pairs))
                    worst_max = max(worst_max, *(rel(x, y) for x, y in pairs))
                    base = [
                        (y, z)
                        for sb, sz in zip(b, ref[n1], strict=True)
                        for y, z in zip(sb, sz, strict=True)
                    ]
                    baseline = max(baseline, *(rel_norm(y, z) for y, z in base))
                    steps += 1
            # the plain path's own distance to one-by-one decoding: float32 rounding between
            # forward widths; the graph path may differ from the plain path by twice that
            tol = max(1e-5, 2 * baseline)
            row.update(states_worst_rel=worst, states_worst_rel_maxabs=worst_max,
                       plain_vs_one_by_one_rel=baseline, states_tol=tol, states_steps=steps)  # fmt: skip
            row["ok"] = all(row["ids"].values()) and worst <= tol
        except Exception as e:  # noqa: BLE001 - report and go on
            row.update(
                ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:]
            )
        ok &= row["ok"]
        out[family] = row
        gc.collect()
    out["ok"] = ok
    return out


def one_by_one(model, ids: list[int], layers: list[int]) -> dict[int, list]:
    """transformers decoding the prompt (P tokens) in one forward, then one token at a time:
    committed length -> per GatedDeltaNet layer (conv [C, K], recurrent [Hv, Dk, Dv])."""
    from transformers import DynamicCache

    cache, out = DynamicCache(config=model.config), {}
    dev = model.device

    def states():
        return [(cache.layers[i].conv_states[0][0].clone(), cache.layers[i].recurrent_states[0][0].clone())
                for i in layers]  # fmt: skip

    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:P]], device=dev), past_key_values=cache, use_cache=True)
        out[P] = states()
        for i in range(P, len(ids)):
            model(input_ids=torch.tensor([[ids[i]]], device=dev), position_ids=torch.tensor([[i]], device=dev),
                  past_key_values=cache, use_cache=True)  # fmt: skip
            out[i + 1] = states()
    return out


def greedy_on(model, prompt: list[int], n: int) -> list[int]:
    """HF generate's greedy ids on the model's device."""
    ids = torch.tensor([prompt], device=model.device)
    got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=1)  # fmt: skip
    return got[0, len(prompt) :].tolist()


def hf_generate_ms(dev: torch.device, tiny: bool) -> dict:
    """HF generate on the bench's shape: ms per new token over 32 tokens after a 512-token prompt
    (the difference of a 33-token and a 1-token run, so the prefill is not counted)."""
    from scripts import bench_big as bb

    be = bb.build(tiny, dev, torch.float32 if tiny else torch.bfloat16, False, (1,), "qwen3.5-9b", False,
                  None if tiny else 0.002)  # fmt: skip
    model, n = be.target, 32
    del be
    prompt = torch.randint(
        0,
        min(1000, model.config.vocab_size),
        (1, 64 if tiny else 512),
        generator=torch.Generator().manual_seed(1),
    ).to(dev)

    def run(k):
        bb.sync(dev)
        t = time.perf_counter()
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=k, min_new_tokens=k,
                       do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        bb.sync(dev)
        return time.perf_counter() - t

    run(2)  # warm-up
    one, many = run(1), run(n + 1)
    return {"ms_per_token": 1000 * (many - one) / n, "tokens": n}


def check_big(dev: torch.device, out_dir: Path, t0: float, budget_s: float) -> dict:
    from scripts import bench_big as bb

    tiny = dev.type != "cuda"
    res: dict = {}
    base = ["--shape", "qwen3.5-9b", "--blocks", "1,16", "--steps", "16"] + (
        ["--tiny", "--prompt-len", "64", "--steps", "4"] if tiny else [])  # fmt: skip
    for name, flag in (("eager_graphs", "--no-compile"), ("compiled", "--compile")):
        if name == "compiled" and (tiny or time.perf_counter() - t0 > budget_s):
            res[name] = {"skipped": "time"} if not tiny else {"skipped": "cpu"}
            continue
        try:
            report = bb.main([*base, flag, "--out", str(out_dir / name)])
            rows = {(r["block_size"], r["k"]): r for r in report["results"]}
            b1 = rows[(1, 0)]
            b16 = rows.get((16, 0)) or rows[(4, 0)]
            res[name] = {"device": report["device"], "compile": report["compile"], "floor_ms_block1": b1["floor_ms"],
                         "block1_ms": b1["ms_per_step"], "block1_x_floor": b1["x_floor"],
                         "block16_k0_ms": b16["ms_per_step"], "block16_x_block1": b16["x_block1"],
                         "block16_k15": rows.get((16, 15)), "diverged": [r["diverged_at"] for r in report["results"]],
                         "target_bytes": report["target_bytes"], "copy_GBps": report["copy_bandwidth_GBps"]}  # fmt: skip
        except Exception as e:  # noqa: BLE001 - report and go on
            res[name] = {
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc()[-2000:],
            }
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    try:
        res["hf_generate"] = hf_generate_ms(dev, tiny)
    except Exception as e:  # noqa: BLE001
        res["hf_generate"] = {
            "error": f"{type(e).__name__}: {e}",
            "trace": traceback.format_exc()[-2000:],
        }
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="kernel,tiny,big")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_hybrid_out"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-s", type=float, default=170.0,
                    help="seconds after which the compiled bench is skipped")  # fmt: skip
    args = ap.parse_args(argv)
    dev, t0 = torch.device(args.device), time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    "torch": torch.__version__}  # fmt: skip
    import transformers

    report["transformers"] = transformers.__version__
    ok = True
    for part in args.only.split(","):
        t = time.perf_counter()
        try:
            if part == "kernel":
                report[part] = check_kernel(dev)
            elif part == "tiny":
                report[part] = check_tiny(dev)
            elif part == "big":
                report[part] = check_big(dev, out_dir, t0, args.budget_s)
        except Exception as e:  # noqa: BLE001
            report[part] = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc()[-3000:],
            }
        report[part]["seconds"] = round(time.perf_counter() - t, 1)
        ok &= report[part].get("ok", True)
        (out_dir / "gpu_check_hybrid.json").write_text(json.dumps(report, indent=2, default=str))
    summary(report)
    print("ALL OK" if ok else "FAILED", f"({time.perf_counter() - t0:.0f} s)")
    return 0 if ok else 1


def summary(report: dict) -> None:
    """A few lines: the checks and the figures against the goals."""
    k = report.get("kernel", {})
    for row in k.get("verify", []):
        print(f"kernel {row['dtype']} T={row['tokens']}: ok={row.get('ok')} out_rel={row.get('out_rel', 0):.2e} "
              f"states_rel={row.get('states_rel', 0):.2e} kernel {row.get('kernel_us', 0):.1f} us, torch {row['torch_us']:.0f} us")  # fmt: skip
    if "prefill" in k:
        print(f"prefill: {k['prefill']}; rollback of 24 layers {k['rollback_us']:.1f} us")
    for fam in FAMILIES:
        row = report.get("tiny", {}).get(fam)
        if row:
            print(f"tiny {fam}: ok={row['ok']} states_worst_rel={row.get('states_worst_rel')} "
                  f"(plain vs one-by-one {row.get('plain_vs_one_by_one_rel')}) "
                  f"ids={all(row.get('ids', {}).values())} {row.get('error', '')}")  # fmt: skip
    big = report.get("big", {})
    for name in ("eager_graphs", "compiled"):
        r = big.get(name, {})
        if "block1_ms" in r:
            roll = k.get("rollback_us")
            print(f"big {name}: block1 {r['block1_ms']:.2f} ms = {r['block1_x_floor']:.2f}x floor "
                  f"({r['floor_ms_block1']:.2f} ms); block16 {r['block16_k0_ms']:.2f} ms = "
                  f"{r['block16_x_block1']:.2f}x block1"
                  + (f"; rollback {roll:.0f} us = {100 * roll / 1000 / r['block1_ms']:.1f}% of a block-1 step" if roll else ""))  # fmt: skip
        elif r:
            print(f"big {name}: {r.get('skipped') or r.get('error')}")
    if "hf_generate" in big:
        print(f"HF generate: {big['hf_generate']}")


if __name__ == "__main__":
    sys.exit(main())
