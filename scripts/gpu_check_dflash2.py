"""GPU check of DFlash2 drafts on the static (CUDA-graph) path.

    PYTHONPATH=. python3 scripts/gpu_check_dflash2.py [--out DIR] [--tiny] [--only exact,perf]
        [--no-compile] [--new-tokens N]

A random target of the demo target's shape (SmolLM2-135M: Llama, hidden 576, 30 layers,
vocabulary 49152; the demo GGUF is not on the device) and untrained 5-layer block-16 drafts of
the published DFlash2 settings (conv 2/16, selector rank 256, top-16) and of DFlash v1, same
size. Prints a short summary, writes ``DIR/gpu_check_dflash2.json`` (DIR = --out, else $OUT,
else ./gpu_check_out) and exits 1 when a check fails:

- ``exact`` (float32, CUDA graphs, no compile): greedy ids of the graph path (host loop and
  device loop) at blocks 4 and 16 equal the plain path's and HF ``generate``'s (fails if not);
  whether every step accepted the same count as the plain path (the same proposals; reported);
  sampled (T = 0.8, seed 7): the graph path's tokens against the plain path's (first
  difference reported, not a failure: their target kernels round differently), and the
  selector's q rows sum to 1 with every proposal among its candidates (fails if not).
- ``cost`` (bfloat16, graphs, compile unless --no-compile): one captured graph each of the
  DFlash2 draft step (forward + greedy walk), the walk alone (greedy and sampled, from fixed
  hidden states), and the v1 draft step (forward + argmax head): microseconds per replay.
- ``speed`` (bfloat16, same backends): greedy decoding through the device loop, 256 new tokens
  from a 128-token prompt at block 16 (and block 1 as the baseline), DFlash2 against v1: tok/s,
  τ and ms per step (untrained drafts accept little: this compares step cost); sampled DFlash2
  (host loop, sampled walk graph) tok/s.
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

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=100000.0)  # fmt: skip
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=1024, tie_word_embeddings=False)  # fmt: skip


def build_pair(tiny: bool, dev: torch.device, dtype: torch.dtype, seed: int = 0):
    """(target, DFlash2 draft, v1 draft), random, on ``dev`` in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.models.draft2_torch import DFlash2Draft
    from dflash.models.draft_torch import DFlashDraft
    from dflash.models.init_draft import draft_config_for

    cfg = LlamaConfig(**(TINY if tiny else SMOLLM2), initializer_range=0.3 if tiny else 0.02)
    torch.manual_seed(seed)
    target = LlamaForCausalLM(cfg).to(dev, dtype).eval()
    drafts = []
    for arch in ("dflash2", "dflash"):
        dcfg = draft_config_for(cfg, layers=2 if tiny else 5, block_size=16, mask_token_id=cfg.vocab_size - 1,
                                vocab_rows=cfg.vocab_size, arch=arch)  # fmt: skip
        torch.manual_seed(seed + 1)
        drafts.append(
            (DFlash2Draft if arch == "dflash2" else DFlashDraft)(dcfg).to(dev, dtype).eval()
        )
    return target, drafts[0], drafts[1]


def run_ids(
    be, prompt: list[int], block: int, n: int, sampling=None
) -> tuple[list[int], list[int]]:
    """(token ids, accepted per step) of one request."""
    from dflash.loop import speculative_generate

    kw = {} if sampling is None else {"sampling": sampling}
    toks, acc = [], []
    for r in speculative_generate(
        be, prompt, block_size=block, max_new_tokens=n, stop_ids=[], **kw
    ):
        toks += r.tokens
        if r.accepted is not None:
            acc.append(r.accepted)
    return toks, acc


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def check_exact(tiny: bool, dev: torch.device, prompt: list[int], n: int) -> dict:
    from dflash.backends.plain import TransformersBackend
    from dflash.backends.static.backend import StaticBackend
    from dflash.types import SamplingParams

    target, d2, _ = build_pair(tiny, dev, torch.float32)
    plain = TransformersBackend(target, d2, dev)
    graphs = dev.type == "cuda"
    out, ok = {"greedy": []}, True
    ref = hf_greedy(target, prompt, n)
    for loop in (False, True):
        be = StaticBackend(target, d2, dev, use_graphs=graphs, compile=False, device_loop=loop)
        for block in (4, 16):
            ids, acc = run_ids(be, prompt, block, n)
            pids, pacc = run_ids(plain, prompt, block, n)
            good = ids == ref == pids
            ok &= good
            out["greedy"].append(dict(device_loop=loop, block=block, ids_equal_hf_and_plain=good,
                                      first_diff_hf=first_difference(ids, ref),
                                      accepted_equal_plain=acc == pacc, tau=sum(acc) / max(len(acc), 1)))  # fmt: skip
    be = StaticBackend(target, d2, dev, use_graphs=graphs, compile=False, device_loop=False)
    sp = SamplingParams(temperature=0.8, seed=7)
    ids, _ = run_ids(be, prompt, 16, n, sp)
    again, _ = run_ids(be, prompt, 16, n, sp)
    pids, _ = run_ids(plain, prompt, 16, n, sp)
    # the sampled walk's outputs: q rows are distributions, proposals among the candidates
    be.reset(len(prompt) + 64)
    with torch.inference_mode():
        _, ctx = be.prefill(prompt, True)
        props, sel = be.draft(prompt[-1], ctx, len(prompt), 16, sampling=sp)
    q_ok = bool(torch.allclose(sel.q.sum(-1), torch.ones_like(sel.q[:, 0]), atol=1e-5))
    in_cand = bool((sel.candidates == props[:, None]).any(-1).all())
    good = q_ok and in_cand and ids == again and len(ids) == n
    ok &= good
    out["sampled"] = dict(ok=good, seeded_repeat_equal=ids == again, q_rows_sum_to_1=q_ok,
                          proposals_in_candidates=in_cand, equal_plain=ids == pids,
                          first_diff_plain=first_difference(ids, pids))  # fmt: skip
    out["ok"] = bool(ok)
    return out


def graph_us(fn, args: tuple, dev: torch.device, reps: int = 200) -> float:
    """Microseconds per replay of ``fn(*args)`` captured in a CUDA graph (eager on the CPU)."""
    with torch.inference_mode():
        if dev.type != "cuda":
            fn(*args)
            t = time.perf_counter()
            for _ in range(5):
                fn(*args)
            return 1e6 * (time.perf_counter() - t) / 5
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for _ in range(3):
                fn(*args)
        torch.cuda.current_stream(dev).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(*args)
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize(dev)
        return 1e6 * (time.perf_counter() - t) / reps


def check_cost_and_speed(
    tiny: bool, dev: torch.device, prompt: list[int], n: int, compile: bool, baseline: bool = True
) -> dict:
    from dflash.backends.static.backend import StaticBackend
    from dflash.types import SamplingParams

    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    target, d2, d1 = build_pair(tiny, dev, dtype)
    graphs = dev.type == "cuda"
    compile = compile and graphs
    out: dict = {"dtype": str(dtype).split(".")[-1], "compile": compile}
    bes = {name: StaticBackend(target, d, dev, use_graphs=graphs, compile=compile)
           for name, d in (("dflash2", d2), ("dflash", d1))}  # fmt: skip
    speed, greedy_ids = {}, {}
    sp = SamplingParams(temperature=0.8, seed=7)
    runs = [("dflash2", 16, None), ("dflash", 16, None), ("dflash2", 16, sp)] + (
        [("dflash", 1, None)] if baseline else []
    )
    for name, block, sampling in runs:
        be = bes[name]
        run_ids(be, prompt, block, n, sampling)  # warm-up (captures, compiles)
        sync(dev)
        t = time.perf_counter()
        ids, acc = run_ids(be, prompt, block, n, sampling)
        dt = time.perf_counter() - t
        key = f"{name}_b{block}" + ("_sampled" if sampling else "")
        speed[key] = dict(tok_per_s=len(ids) / dt, tau=sum(acc) / max(len(acc), 1),
                          ms_per_step=1000 * dt / max(len(acc), 1), steps=len(acc))  # fmt: skip
        print(key, json.dumps(speed[key]), flush=True)
        if sampling is None and block == 16:
            greedy_ids[name] = ids
    # the same target graphs verify both drafts' blocks: the same greedy ids (information)
    out["greedy_ids_equal_v1"] = greedy_ids["dflash2"] == greedy_ids["dflash"]
    out["speed"] = speed
    print("speed", json.dumps(speed), flush=True)  # before the costs: a time limit may cut them
    # per-piece graph costs: the caches are sized by the runs above; rows near the end are harmless
    cost = {}
    for name, be in bes.items():
        start = be.capacity - 64
        block = torch.full((1, 16), be.mask_token_id, dtype=torch.long, device=dev)
        args = (
            block,
            be.key_pos[start : start + 1].clone(),
            be.key_pos[start - 16 : start].clone(),
        )
        fn = be._fn("draft")  # the forward the draft graphs capture (compiled once already)
        cost[f"{name}_draft_step_us"] = graph_us(lambda *a, f=fn: f(*a, logits=False), args, dev)
    be = bes["dflash2"]
    h = torch.randn(1, 15, target.config.hidden_size, device=dev, dtype=dtype)
    anchor = torch.zeros(1, dtype=torch.long, device=dev)
    be.sel_u[:, :15].uniform_()
    for mode, sample in (("greedy", False), ("sampled", True)):
        fn = torch.compile(be._select, dynamic=False) if compile else be._select
        cost[f"selector_{mode}_us"] = graph_us(
            lambda a, b, f=fn, s=sample: f(a, b, s), (h, anchor), dev
        )
    cost["dflash2_forward_us_est"] = cost["dflash2_draft_step_us"] - cost["selector_greedy_us"]
    try:  # the one-kernel walk (not on by default): same picks as the torch walk, and its cost
        cost.update(walk_kernel_check(dev, be.draft_model.candidate_selector.top_k, 15))
    except Exception as e:  # noqa: BLE001 - information only
        cost["walk_kernel_error"] = f"{type(e).__name__}: {e}"[:300]
    out["cost"] = cost
    return out


def walk_kernel_check(dev: torch.device, k: int, t: int, trials: int = 20) -> dict:
    """:func:`dflash.kernels.selector_walk.walk_kernel` against the torch walk on random
    scores (greedy and sampled picks equal, q within 1e-5) and both walks' graph costs."""
    from dflash.kernels.selector_walk import walk_kernel
    from dflash.models.draft2_torch import select_walk

    g = torch.Generator(device=dev).manual_seed(0)
    temp = torch.tensor([0.8], device=dev)
    equal = True
    for _ in range(trials):
        un = torch.randn(1, t, k, device=dev, generator=g) * 3
        fi, tr = (
            torch.randn(1, k, device=dev, generator=g),
            torch.randn(1, t - 1, k, k, device=dev, generator=g),
        )
        u = torch.rand(1, 64, device=dev, generator=g)
        equal &= torch.equal(walk_kernel(un, fi, tr)[0], select_walk(un, fi, tr)[0])
        (pk, q), (pr, qr) = walk_kernel(un, fi, tr, u, temp), select_walk(un, fi, tr, u, temp)
        equal &= torch.equal(pk, pr) and (q - qr).abs().max().item() < 1e-5
    return {"walk_kernel_equal": bool(equal),
            "walk_kernel_greedy_us": graph_us(lambda: walk_kernel(un, fi, tr), (), dev),
            "walk_kernel_sampled_us": graph_us(lambda: walk_kernel(un, fi, tr, u, temp), (), dev),
            "walk_torch_greedy_us": graph_us(lambda: select_walk(un, fi, tr), (), dev),
            "walk_torch_sampled_us": graph_us(lambda: select_walk(un, fi, tr, u, temp), (), dev)}  # fmt: skip


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU tests)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64 (exact), 256 (speed)")
    ap.add_argument("--only", default="exact,perf", help="parts to run: exact, perf (comma list)")
    ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="time block-1 decoding too")  # fmt: skip
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    g = torch.Generator().manual_seed(1)
    vocab = (TINY if args.tiny else SMOLLM2)["vocab_size"]
    prompt = torch.randint(0, vocab - 1, (128,), generator=g).tolist()
    report: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    "torch": torch.__version__, "tiny": args.tiny}  # fmt: skip
    t_start = time.perf_counter()
    ok = True
    for name, fn in (("exact", lambda: check_exact(args.tiny, dev, prompt, args.new_tokens or 64)),
                     ("perf", lambda: check_cost_and_speed(args.tiny, dev, prompt, args.new_tokens or 256,
                                                           args.compile, args.baseline))):  # fmt: skip
        if name not in args.only.split(","):
            continue
        t = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as e:  # noqa: BLE001 - report every failure, keep going
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:400],
                            "trace": traceback.format_exc()[-3000:]}  # fmt: skip
        report[name]["seconds"] = round(time.perf_counter() - t, 1)
        ok &= report[name].get("ok", True)
        print(name, json.dumps(report[name])[:1500], flush=True)
    report["ok"] = bool(ok)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check_dflash2.json").write_text(json.dumps(report, indent=2))
    perf = report.get("perf", {})
    if "cost" in perf:
        s, c = perf["speed"], perf["cost"]
        print(f"{report['device']}: DFlash2 b16 {s['dflash2_b16']['tok_per_s']:.0f} tok/s "
              f"({s['dflash2_b16']['ms_per_step']:.3f} ms/step), v1 b16 {s['dflash_b16']['tok_per_s']:.0f} tok/s "
              f"({s['dflash_b16']['ms_per_step']:.3f} ms/step), sampled DFlash2 {s['dflash2_b16_sampled']['tok_per_s']:.0f} tok/s; "
              f"draft step DFlash2 {c['dflash2_draft_step_us']:.1f} us (selector {c['selector_greedy_us']:.1f} us "
              f"greedy, {c['selector_sampled_us']:.1f} us sampled), v1 {c['dflash_draft_step_us']:.1f} us")  # fmt: skip
    print(("ok" if ok else "FAILED") + f" ({time.perf_counter() - t_start:.0f} s)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
