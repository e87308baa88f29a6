"""GPU check and benchmark of GatedDeltaNet hybrids on the static (CUDA-graph) path.

    PYTHONPATH=. python3 scripts/gpu_check_hybrid.py [--only kernel,big,tiny] [--out DIR] [--device cpu]

Prints a few lines per part and writes ``DIR/gpu_check_hybrid.json`` after each (DIR = --out,
else $OUT, else ./gpu_check_hybrid_out); exits 1 when a check fails (the speed goals are
reported, not checked). Imports dflash/ and scripts/ only. About 90 s on one H100:

- ``kernel``: the fused Triton verify kernel (:func:`dflash.kernels.gdn_triton.gdn_verify`)
  against the torch reference (prepare + recurrent_verify) at a Qwen3.5-9B layer's shape (16 key
  and 32 value heads of 128), 1, 4 and 16 tokens, float32 and bf16 inputs: outputs and per-token
  states within 1e-5 (float32) / 1e-4 (bf16) of the largest value; the chunked prefill against the
  recurrence (300 tokens, float32); the time of one layer's verify (kernel and torch); the
  centred and gated RMSNorm kernels (:mod:`dflash.kernels.gdn_norms`) against transformers'
  modules in bf16 (within one bf16 rounding of the largest value).
- ``big``: a random bf16 target of Qwen3.5-9B's text shape (``scripts/bench_big.py --shape
  qwen3.5-9b``: 8.95 B parameters, 5-layer random draft, prompt 512) on the graph path with the
  device loop, no compile: ms per step at block 1 and block 16 (k = 0 and 15 right proposals),
  the HBM floor (weights but the embedding, the K/V of the 8 attention layers, one read and one
  write of the 24 recurrent states; measured copy bandwidth), the rollback of the backend's own
  buffers (µs, CUDA events), and HF ``generate`` on the same target (ms per new token). Goals:
  block 1 <= 1.2x the floor, block 16 <= 1.4x block 1, the rollback <= 5% of a step.
- ``tiny``: tiny random float32 qwen3_5_text / qwen3_5_moe / qwen3_next targets (the test
  suite's shapes; TF32 off): the graph path's greedy ids (device loop at blocks 1 and 16, host
  loop at 3) equal HF ``generate``; scripted schedules [15, 0, 3, 0, 0, 15] and [0, 0, 0]
  through the graph path (host loop) and the plain path: the same ids, and after every step each
  GatedDeltaNet layer's committed conv and recurrent state within 1e-5 of the plain path's
  (||a - b|| / ||b||; the largest entry's difference over the largest entry is reported beside
  it), or within twice the plain path's own distance to transformers decoding the tokens one at
  a time, where float32 rounding between forward widths alone is larger (on the CPU: the MoE
  targets, about 1e-5). No new family starts after ``--tiny-budget-s`` seconds from the start.

``--device cpu`` runs what it can on the CPU (torch kernels, the tiny checks without graphs, a
miniature bench) to test the script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from scripts.hybrid_tiny_check import FAMILIES, check_tiny, rel  # noqa: E402

HK, HV, DK, DV, LAYERS = 16, 32, 128, 128, 24  # Qwen3.5-9B's GatedDeltaNet layers


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
    # the norm kernels against transformers' modules (bf16, Qwen3.5-9B's widths)
    if triton:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

        from dflash.kernels.gdn_norms import centred_rms_norm, gated_rms_norm

        bf = torch.bfloat16
        norm, gated = Qwen3_5RMSNorm(4096).to(dev, bf), Qwen3_5RMSNormGated(DV).to(dev, bf)
        with torch.no_grad():
            norm.weight.normal_(0, 0.1)
            gated.weight.uniform_(0.5, 1.5)
            x = torch.randn(1, 16, 4096, device=dev).to(bf)
            o, z = torch.randn(16, HV, DV, device=dev), torch.randn(16, HV, DV, device=dev).to(bf)
            out["norms"] = {"centred_rel": rel(centred_rms_norm(norm, x), norm(x)),
                            "gated_rel": rel(gated_rms_norm(gated, o, z),
                                             gated(o.to(bf).reshape(-1, DV), z.reshape(-1, DV)))}  # fmt: skip
        out["norms"]["ok"] = max(out["norms"]["centred_rel"], out["norms"]["gated_rel"]) <= 1e-2
        out["ok"] &= out["norms"]["ok"]
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


def check_big(dev: torch.device, steps: int) -> dict:
    """The bench of ``scripts/bench_big.py --shape qwen3.5-9b`` (CUDA graphs, device loop, no
    compile; blocks 1 and 16), the rollback of the backend's own buffers, and HF generate on the
    same target."""
    from dflash.loop import speculative_generate
    from scripts import bench_big as bb

    tiny = dev.type != "cuda"
    dtype = torch.float32 if tiny else torch.bfloat16
    t = time.perf_counter()
    be = bb.build(tiny, dev, dtype, False, (1, 16), "qwen3.5-9b", True, None if tiny else 0.002)
    res: dict = {"build_s": time.perf_counter() - t, "describe": {k: v for k, v in be.describe().items()
                 if k in ("gdn_recurrence", "gdn_norms", "gdn_layers", "device_loop", "cuda_graphs", "attention")}}  # fmt: skip
    plen = 64 if tiny else 512
    prompt = torch.randint(
        0, be.vocab_size - 1, (plen,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    n_truth = 17 + (steps + 2) * 16
    script = (
        bb.ScriptedLoop(be.device_loop, n_truth + 64, plen) if be.device_loop is not None else None
    )
    truth_ids = [
        x
        for r in speculative_generate(be, prompt, block_size=1, max_new_tokens=n_truth)
        for x in r.tokens
    ]
    truth = torch.tensor(truth_ids, device=dev)
    if script is not None:
        script.truth[: len(truth_ids)].copy_(truth)
    tgt = bb.param_bytes(be.target, skip=("model.embed_tokens",))
    drf = (
        bb.param_bytes(be.draft_model)
        + be.lm_head.weight.numel() * be.lm_head.weight.element_size()
    )
    c = be.target.config
    attn_layers = sum(k is not None for k in be.k)
    kv = (
        2
        * attn_layers
        * c.num_key_value_heads
        * be.head_dim
        * be.dtype.itemsize
        * (plen + steps * 8)
    )
    state = 2 * be.gdn.states[:, 0].numel() * 4  # the committed states read, one slot written
    bw = bb.copy_bandwidth(dev, 1 << (22 if tiny else 32))
    res.update(
        target_bytes=tgt, draft_bytes=drf, kv_bytes=kv, state_bytes=state, copy_GBps=bw / 1e9
    )
    rows = {}
    for block, k in ((1, 0), (16, 0), (16, 15)):
        r = bb.run(be, prompt, truth, block, k, steps, script)
        r["floor_ms"] = 1000 * (tgt + kv + state + (drf if block > 1 else 0)) / bw
        r["x_floor"] = r["ms_per_step"] / r["floor_ms"]
        rows[(block, k)] = r
        print(json.dumps(r), flush=True)
    b1, b16 = rows[(1, 0)], rows[(16, 0)]
    res["steps"] = list(rows.values())
    res.update(block1_ms=b1["ms_per_step"], floor_ms=b1["floor_ms"], block1_x_floor=b1["x_floor"],
               block16_ms=b16["ms_per_step"], block16_x_block1=b16["ms_per_step"] / b1["ms_per_step"])  # fmt: skip
    # the rollback of this backend's own buffers (every GatedDeltaNet layer, keep = 7)
    res["rollback_us"] = timed_us(lambda: be.gdn.rollback(7), dev, 100)
    res["rollback_pct_block1"] = 100 * res["rollback_us"] / 1000 / b1["ms_per_step"]
    res["rollback_pct_block16"] = 100 * res["rollback_us"] / 1000 / b16["ms_per_step"]
    # HF generate on the same target: ms per new token (a 33-token run minus a 1-token run)
    model = be.target
    ids = torch.tensor([prompt], device=dev)

    def hf(n):
        bb.sync(dev)
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        bb.sync(dev)
        return time.perf_counter() - t

    hf(2)
    one, many = hf(1), hf(33)
    res["hf_generate_ms_per_token"] = 1000 * (many - one) / 32
    res["hf_x_block1"] = res["hf_generate_ms_per_token"] / b1["ms_per_step"]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="kernel,big,tiny")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_hybrid_out"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per bench setting")
    ap.add_argument("--tiny-budget-s", type=float, default=55.0,
                    help="seconds from the start after which no further tiny family starts")  # fmt: skip
    args = ap.parse_args(argv)
    dev, t0 = torch.device(args.device), time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import transformers

    report: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    "torch": torch.__version__, "transformers": transformers.__version__}  # fmt: skip
    ok = True
    for part in args.only.split(","):
        t = time.perf_counter()
        try:
            if part == "kernel":
                report[part] = check_kernel(dev)
            elif part == "tiny":
                report[part] = check_tiny(dev, t0, args.tiny_budget_s)
            elif part == "big":
                report[part] = check_big(dev, args.steps)
        except Exception as e:  # noqa: BLE001
            report[part] = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc()[-3000:],
            }
        report[part]["seconds"] = round(time.perf_counter() - t, 1)
        ok &= report[part].get("ok", True)
        (out_dir / "gpu_check_hybrid.json").write_text(json.dumps(report, indent=2, default=str))
        summary(report, part)
    print("ALL OK" if ok else "FAILED", f"({time.perf_counter() - t0:.0f} s)")
    return 0 if ok else 1


def summary(report: dict, part: str) -> None:
    """A few lines on one part: the checks, and the figures against the goals."""
    r = report.get(part, {})
    if "error" in r:
        print(f"{part}: {r['error']}")
    if part == "kernel":
        for row in r.get("verify", []):
            print(f"kernel {row['dtype']} T={row['tokens']}: ok={row.get('ok')} out_rel={row.get('out_rel', 0):.2e} "
                  f"states_rel={row.get('states_rel', 0):.2e} kernel {row.get('kernel_us', 0):.1f} us, "
                  f"torch {row['torch_us']:.0f} us")  # fmt: skip
        if "prefill" in r:
            print(
                f"prefill: {r['prefill']}; rollback of 24 layers (synthetic) {r['rollback_us']:.1f} us"
            )
    elif part == "tiny":
        for fam in FAMILIES:
            row = r.get(fam, {})
            print(f"tiny {fam}: ok={row.get('ok')} states_worst_rel={row.get('states_worst_rel')} "
                  f"(plain vs one-by-one {row.get('plain_vs_one_by_one_rel')}) ids={row.get('ids')} "
                  f"{row.get('error', row.get('skipped', ''))}")  # fmt: skip
    elif part == "big" and "block1_ms" in r:
        print(f"big: block1 {r['block1_ms']:.2f} ms = {r['block1_x_floor']:.2f}x floor ({r['floor_ms']:.2f} ms); "
              f"block16 {r['block16_ms']:.2f} ms = {r['block16_x_block1']:.2f}x block1; rollback "
              f"{r.get('rollback_us', 0):.0f} us = {r.get('rollback_pct_block1', 0):.1f}% of block1; "
              f"HF generate {r.get('hf_generate_ms_per_token', 0):.1f} ms/token")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
