"""GPU check of batched speculative decoding (dflash/backends/static/batched_spec.py).

    PYTHONPATH=. python3 scripts/gpu_check_batched_spec.py [--shapes demo,8b] [--out DIR]
    PYTHONPATH=. python3 scripts/gpu_check_batched_spec.py --device cpu --shapes tiny --new 24  # smoke test

Writes ``DIR/gpu_check_batched_spec.json`` (DIR = --out, else $OUT, else ./gpu_check_out),
prints a summary, exits 1 when a check fails.

- ``exact`` (float32, TF32 off, the target's norm weights random: a weight of one hides a norm
  applied twice): 8 requests with ragged prompts, own budgets and stop ids and
  scripted accept schedules (zero accept, full blocks, mixed) through 4 rows with continuous
  batching, at block size 16 and under the chooser: every request's ids equal the same request
  decoded alone (1 row) and plain greedy decoding of the same engine (width 1).
- ``speed`` per shape (bf16, random weights; ``demo`` = SmolLM2-135M + its 5-layer draft's
  shapes, ``8b`` = Qwen3-8B + a 5-layer draft): at each concurrency c (``LEVELS``: demo 1, 4,
  16, 64; 8b 1, 4, 16) 2c
  requests (prompts of 64-192 tokens, budgets of 64-192 new tokens, mean 128: rows end and
  others join at ragged times, as in serving) go through c rows, closed loop.
  Plain batched decoding (every step width 1) gives the baseline tokens/s and each request's
  greedy ids; the draft is random, so its acceptance is ~0: to measure what acceptance buys,
  the draft's proposals (the draft still runs, its cost is real) are replaced on the device by
  the request's own greedy ids for k positions and wrong ids after, k cycling through
  ``SCHEDULE`` (mean 3: τ ≈ 4 at width 16, like the demo pair), see scripts/batched_spec_scripted.py;
  the target's greedy ids are forced to those of the plain run too (``force``: a random model's
  logits are near-tied everywhere, and bf16 rounding of other batch shapes would otherwise part
  a row from its truth after which every proposal fails; the compute is unchanged). New jobs
  enter in groups (1/8 of the rows free), in every run alike.
  Runs: ``auto`` (the per-step chooser on costs timed at every rows bucket up to c, rates
  learned per row), and ``fixed16``; each reports tokens/s, speedup over plain, mean committed
  tokens per row-step, the widths chosen, engine calls, prefills and catch-ups, and TTFT / ITL
  percentiles (ms; ITL = (e2e - TTFT) / (tokens - 1) per request, TTFT from the request's
  admission). ``generator``: the plain batched generator of ``data regenerate`` (dense
  attention, graphs of ``plain_steps`` steps, no compile; demo shape) on the same requests, the reference
  for the engine's plain mode (``engine_plain_vs_generator``). A last line per shape gives auto /
  plain by concurrency (the goal: >= 1.0 everywhere).
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

from dflash.auto_block_batch import BatchCosts, BatchPolicy  # noqa: E402
from dflash.backends.static.batched_spec import SpecJob  # noqa: E402
from dflash.types import SamplingParams  # noqa: E402

sys.path.insert(0, str(REPO / "scripts"))
from batched_spec_scripted import ScriptedJob, ScriptedSpec  # noqa: E402

SCHEDULE = [1, 5, 2, 4, 3, 0, 6]  # accepted proposals per step, cycled (mean 3)
SHAPES = {
    "tiny": (dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2), 2, 8),
    "demo": (dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0), 5, 16),
    "8b": (dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0), 5, 16),
}  # fmt: skip


def build(shape: str, dtype, device, seed: int = 0, random_norms: bool = False):
    """A random target (Qwen3 for 8b, Llama otherwise) and a random DFlash draft for it;
    ``random_norms``: the target's norm weights drawn in [0.5, 2) (a weight of one hides a norm
    applied twice, as the batched rows once did)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from dflash.models.draft_torch import DFlashDraft
    from dflash.models.init_draft import draft_config_for

    kw, layers, block = SHAPES[shape]
    cls, cfg_cls = (
        (Qwen3ForCausalLM, Qwen3Config) if shape == "8b" else (LlamaForCausalLM, LlamaConfig)
    )
    cfg = cfg_cls(
        **kw,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        initializer_range=0.3 if shape == "tiny" else 0.02,
    )
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # no float32 copy of an 8B model first
    try:
        with torch.device(device):
            target = cls(cfg).eval()
            dcfg = draft_config_for(cfg, layers=layers, block_size=block, mask_token_id=kw["vocab_size"] - 1,
                                    vocab_rows=kw["vocab_size"])  # fmt: skip
            draft = DFlashDraft(dcfg).to(dtype).eval()
    finally:
        torch.set_default_dtype(default)
    if random_norms:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, w in target.named_parameters():
                if name.endswith("norm.weight"):
                    w.copy_(0.5 + 1.5 * torch.rand(w.shape, generator=g))
    return target, draft


def prompts(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 2, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]  # fmt: skip


def run(spec, jobs, block_size) -> dict:
    """Run ``jobs`` through ``spec``; returns ids per job, wall seconds, timings, widths."""
    t_admit = [0.0]
    prefill = [0.0, 0, 0]  # seconds in admit (it ends with a host read), calls, catch-ups
    orig, orig_catch = spec.admit, spec._catch_up

    def admit(js):
        t_admit[0] = time.perf_counter()
        got = orig(js)
        prefill[0] += time.perf_counter() - t_admit[0]
        prefill[1] += 1
        return got

    def catch_up(busy):
        if any(spec.h_pos[r] - spec.h_seen[r] > spec.block for r in busy):
            prefill[2] += 1
        return orig_catch(busy)

    spec.admit, spec._catch_up = admit, catch_up
    steps0 = spec.steps_run
    first, last, count = {}, {}, {}
    committed = [0, 0]  # tokens committed by drafted row-steps, drafted row-steps

    def on_step(i, s):
        now = time.perf_counter()
        if s.accepted is None:
            first[i] = (t_admit[0], now)
        else:
            last[i] = now
            if s.proposed > 0:
                committed[0] += len(s.tokens)
                committed[1] += 1
        count[i] = count.get(i, 0) + len(s.tokens)

    widths: list[int] = []
    chooser = block_size
    if isinstance(block_size, BatchPolicy):
        pol = block_size

        def chooser(rows):
            live = [r for r in rows if not spec.h_done[r]]
            left = [spec.h_limit[r] - spec.h_n[r] for r in live]
            w = pol.choose(live, left, rows=spec.rows_bucket(live))
            widths.append(w)
            return w

        def on_step_pol(i, s, inner=on_step):
            inner(i, s)
            if s.accepted is None:  # a new request in this row: the prior's rates
                pol.forget(s.row)
            elif s.proposed > 0:
                pol.observe(s.row, s.accepted, s.proposed)

        cb = on_step_pol
    else:
        cb = on_step
    sync = torch.cuda.synchronize if spec.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    ids = dict(spec.run_jobs(jobs, block_size=chooser, on_step=cb))
    sync()
    wall = time.perf_counter() - t0
    spec.admit, spec._catch_up = orig, orig_catch
    ttft = [1000 * (b - a) for a, b in first.values()]
    itl = [1000 * (last[i] - first[i][1]) / (count[i] - 1) for i in last if count[i] > 1]
    tokens = sum(len(v) for v in ids.values())
    return {"ids": ids, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "ttft_ms": pct(ttft), "itl_ms": pct(itl),
            "tokens_per_drafted_row_step": committed[0] / committed[1] if committed[1] else None,
            "calls": spec.steps_run - steps0, "admits": prefill[1], "admit_s": round(prefill[0], 3),
            "catch_ups": prefill[2],
            "widths": {str(w): widths.count(w) for w in sorted(set(widths))} if widths else None}  # fmt: skip


def pct(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    at = lambda q: round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)  # noqa: E731
    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": round(sum(xs) / len(xs), 3)}


def classify(target, ps, base: dict, got: dict, most: int = 16) -> dict:
    """bf16 mismatches against the plain run, classified at their first differing position by the
    near-tie rule of ``dflash benchmark --check-parity`` (teacher-forced target logits after the
    plain run's tokens): counts of near ties and of unexplained ones (the first ``most``)."""
    from dflash.bench.metrics import classify_divergence, near_tie_threshold

    diff = [i for i in sorted(base) if got[i] != base[i]]
    out = {"count": len(diff), "near_tie": 0, "unexplained": 0}
    for i in diff[:most]:
        m = next((k for k, (a, b) in enumerate(zip(base[i], got[i], strict=False)) if a != b),
                 min(len(base[i]), len(got[i])))  # fmt: skip
        if m >= len(base[i]) or m >= len(got[i]):
            out["unexplained"] += 1
            continue
        with torch.no_grad():
            dev = next(target.parameters()).device
            logits = (
                target(torch.tensor([ps[i] + base[i][:m]], device=dev)).logits[0, -1].float().cpu()
            )
        verdict = classify_divergence(
            logits.numpy(), base[i][m], got[i][m], near_tie_threshold("bfloat16")
        )
        out["near_tie" if verdict["near_tie"] else "unexplained"] += 1
    return out


def check_exact(device, out: dict) -> bool:
    """float32: batched ids == alone ids == plain greedy ids (scripted schedules, stops, budgets)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    target, draft = build("demo" if device.type == "cuda" else "tiny", torch.float32, device, seed=1,
                          random_norms=True)  # fmt: skip
    vocab = target.config.vocab_size
    ps = prompts(8, vocab, 5, 60, seed=2)
    budgets = [40, 7, 33, 1, 25, 40, 12, 30]
    plain = ScriptedSpec(target, draft, max_batch=4, capacity=256, kv_bucket=64)
    free = dict(plain.run_jobs([SpecJob(p, 48) for p in ps], block_size=1))
    stop = free[2][5]  # a token request 2 emits: it ends there (others may too)
    scheds = [[15], [0], [3, 0, 15, 1], [2], [5, 6], [15, 15, 0], [], [1, 4]]
    jobs = [ScriptedJob(p, m, (stop,) if i % 2 == 0 else (), truth=p + free[i], schedule=s)
            for i, (p, m, s) in enumerate(zip(ps, budgets, scheds, strict=True))]  # fmt: skip
    want = {}
    for i, m in enumerate(budgets):
        full = free[i][:m]
        want[i] = full[: full.index(stop) + 1] if i % 2 == 0 and stop in full else full
    res = {}
    alone = ScriptedSpec(target, draft, max_batch=1, capacity=256, kv_bucket=64)
    got_alone = {i: dict(alone.run_jobs([j], block_size=16))[0] for i, j in enumerate(jobs)}
    res["alone_equals_plain"] = got_alone == want
    for name, bs in (("fixed16", 16),):
        got = dict(
            ScriptedSpec(target, draft, max_batch=4, capacity=256, kv_bucket=64).run_jobs(
                jobs, block_size=bs
            )
        )
        res[f"{name}_equals_alone"] = got == got_alone
        res[f"{name}_mismatches"] = [i for i in got if got[i] != got_alone[i]]
    costs = BatchCosts({4: {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.8, 16: 3.0}})
    got = dict(ScriptedSpec(target, draft, max_batch=4, capacity=256, kv_bucket=64).run_jobs(
        jobs, block_size=lambda rows, p=BatchPolicy(costs, 16): p.choose(rows)))  # fmt: skip
    res["auto_equals_alone"] = got == got_alone
    # sampled rows (temperature; top-k/top-p): each row's seeded ids do not depend on its batch
    samp = [SamplingParams(temperature=0.8, top_k=40 if i % 2 else 0, top_p=0.9 if i % 3 == 0 else 1.0, seed=7 + i)
            for i in range(len(jobs))]  # fmt: skip
    sj = [dataclasses.replace(j, sampling=s, stop_ids=()) for j, s in zip(jobs, samp, strict=True)]
    together = dict(
        ScriptedSpec(target, draft, max_batch=4, capacity=256, kv_bucket=64).run_jobs(
            sj, block_size=6
        )
    )
    one = ScriptedSpec(target, draft, max_batch=1, capacity=256, kv_bucket=64)
    res["sampled_seeded_equals_alone"] = all(
        dict(one.run_jobs([j], block_size=6))[0] == together[i] for i, j in enumerate(sj))  # fmt: skip
    out["exact"] = res
    return all(
        v for k, v in res.items() if k.endswith("equals_alone") or k.endswith("equals_plain")
    )


LEVELS = {"tiny": [1, 4], "demo": [1, 4, 16, 64], "8b": [1, 4, 16]}
GENERATOR_SHAPES = ("tiny", "demo")  # the generator reference (8b: its runs would not fit the time)


def generator_run(
    target, ps: list[list[int]], c: int, budgets: list[int], capacity: int, steps: int
) -> dict:
    """The plain batched generator (``dflash data regenerate``'s: dense attention, CUDA graphs,
    ``steps`` decode steps per replay, no compile) on the same prompts through c rows: the
    reference the engine's plain mode should match (warm-up run, then the timed one)."""
    from dflash.backends.static.batched import BatchedGenerator, Job

    gen = BatchedGenerator(target, max_batch=c, capacity=capacity, steps_per_sync=steps, kv_bucket=128,
                           kv_lengths=False, compile=False, refill_fraction=0.125)  # fmt: skip
    jobs = [Job(p, m) for p, m in zip(ps, budgets, strict=True)]
    dict(gen.run(jobs))
    sync = torch.cuda.synchronize if gen.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    ids = dict(gen.run(jobs))
    sync()
    wall = time.perf_counter() - t0
    tokens = sum(len(v) for v in ids.values())
    return {"ids": ids, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall}


def speed(shape: str, device, levels: list[int], new: int, out: dict, stop_at: float) -> None:
    """Per concurrency: plain (width 1 every call) -> baseline; costs at every rows bucket up to
    c; auto and fixed16 (scripted acceptance); the plain batched generator as a reference."""
    from dflash.backends.static.batched_spec import ROW_BUCKETS

    target, draft = build(shape, torch.bfloat16, device)
    vocab, block = target.config.vocab_size, draft.config.block_size
    res: dict = {}
    out.setdefault("speed", {})[shape] = res
    for c in levels:
        t0 = time.perf_counter()
        if t0 > stop_at:  # the time budget: leave the rest (named in the JSON)
            res[str(c)] = "skipped: time budget"
            print(f"{shape} c={c}: skipped (time budget)", flush=True)
            continue
        n = 2 * c
        ps = prompts(n, vocab, 64, 192, seed=c)
        capacity = 192 + new + new // 2 + 8
        spec = ScriptedSpec(
            target, draft, max_batch=c, capacity=capacity, kv_bucket=128, force=True
        )
        budgets = [new // 2 + (37 * i) % (new + 1) for i in range(n)]  # new/2..3new/2: ragged ends
        jobs = [SpecJob(p, m) for p, m in zip(ps, budgets, strict=True)]
        run(spec, jobs, 1)  # warm-up: captures every graph the run needs (as each run below)
        plain = run(spec, jobs, 1)
        truth = {i: ps[i] + plain["ids"][i] for i in range(n)}
        sj = [
            ScriptedJob(p, budgets[i], truth=truth[i], schedule=SCHEDULE) for i, p in enumerate(ps)
        ]
        widths = [1, 2, 4, 6, 8, 16] if block >= 16 else [1, 2, 4, block]
        buckets = sorted({b for b in ROW_BUCKETS if b < c} | {c})  # every bucket a step runs at
        costs = BatchCosts.measure(spec, buckets, widths, context=128 + new // 2, repeats=5)
        level = {"plain": {k: v for k, v in plain.items() if k != "ids"},
                 "costs_ms": {str(nb): {str(w): round(1000 * s, 3) for w, s in costs.table[nb].items()}
                              for nb in buckets}}  # fmt: skip

        def policy(costs=costs, steps=spec.plain_steps):
            return BatchPolicy(costs, block, plain_steps=steps)

        for name, bs in (("auto", None), ("fixed16", block)):
            run(spec, sj, policy() if bs is None else bs)  # warm-up: captures
            r = run(spec, sj, policy() if bs is None else bs)
            level[name] = {k: v for k, v in r.items() if k != "ids"}
            level[name]["speedup"] = round(r["tok_s"] / plain["tok_s"], 3)
            level[name]["ids_equal_plain"] = (
                sum(r["ids"][i] == plain["ids"][i] for i in range(n)) / n
            )
            if not spec.force:  # forced runs commit the truth: nothing to classify
                level[name]["mismatches"] = classify(target, ps, plain["ids"], r["ids"])
        steps = spec.plain_steps
        del spec
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if shape in GENERATOR_SHAPES and time.perf_counter() < stop_at:
            g = generator_run(target, ps, c, budgets, capacity, steps=steps)
            level["generator"] = {k: v for k, v in g.items() if k != "ids"}
            level["generator"]["engine_plain_vs_generator"] = round(plain["tok_s"] / g["tok_s"], 3)
        level["seconds"] = round(time.perf_counter() - t0, 1)
        res[str(c)] = level
        if "save" in out:  # after every level: a run cut short keeps what it measured
            out["save"]()
        a, p = level["auto"], level["plain"]
        gen = level.get("generator", {}).get("engine_plain_vs_generator")
        print(f"{shape} c={c}: plain {p['tok_s']:.0f} tok/s (vs plain generator {gen}x); auto {a['tok_s']:.0f} "
              f"= {a['speedup']}x plain (widths {a['widths']}, {a['tokens_per_drafted_row_step'] or 0:.2f} "
              f"tok/row-step, {a['catch_ups']} catch-ups); fixed16 {level['fixed16']['speedup']}x; "
              f"TTFT p50/p90 ms plain {p['ttft_ms'].get('p50')}/{p['ttft_ms'].get('p90')} auto "
              f"{a['ttft_ms'].get('p50')}/{a['ttft_ms'].get('p90')}; ITL p50/p90 ms plain "
              f"{p['itl_ms'].get('p50')}/{p['itl_ms'].get('p90')} auto {a['itl_ms'].get('p50')}/"
              f"{a['itl_ms'].get('p90')} ({level['seconds']} s)", flush=True)  # fmt: skip
    del target, draft
    if device.type == "cuda":
        torch.cuda.empty_cache()


def summary(out: dict) -> None:
    """One line per shape: auto / plain at every level (the goal: >= 1.0 everywhere)."""
    for shape, res in out.get("speed", {}).items():
        ratios = {c: (v["auto"]["speedup"] if isinstance(v, dict) else v) for c, v in res.items()}
        print(f"summary {shape}: auto/plain by concurrency {ratios}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="demo,8b")
    ap.add_argument(
        "--levels", default=None, help="concurrencies for every shape (default: LEVELS)"
    )
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--skip-exact", action="store_true")
    ap.add_argument(
        "--exact-last",
        action="store_true",
        help="the float32 check after the speed runs, time allowing",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--budget-s", type=float, default=170.0, help="start no level after this many seconds"
    )
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    folder = Path(a.out or os.environ.get("OUT") or "gpu_check_out")
    folder.mkdir(parents=True, exist_ok=True)
    out: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "schedule": SCHEDULE}  # fmt: skip
    ok = True
    stop_at = time.perf_counter() + a.budget_s
    path = folder / "gpu_check_batched_spec.json"

    def save() -> None:
        path.write_text(json.dumps({k: v for k, v in out.items() if k != "save"}, indent=1))

    out["save"] = save
    try:
        if not a.skip_exact and not a.exact_last:
            try:  # a failure here is reported; the speed runs still go
                ok = check_exact(device, out)
            except Exception:  # noqa: BLE001
                out["exact"] = {"error": traceback.format_exc()[-3000:]}
                ok = False
            print(f"exact (float32): {out['exact']}", flush=True)
        for shape in [s for s in a.shapes.split(",") if s]:
            try:
                levels = [int(x) for x in a.levels.split(",")] if a.levels else LEVELS[shape]
                speed(shape, device, levels, a.new, out, stop_at)
            except Exception as e:  # noqa: BLE001 - report and go on to the next shape
                out.setdefault("errors", {})[shape] = traceback.format_exc()[-3000:]
                print(f"{shape}: {type(e).__name__}: {e}", flush=True)
                ok = False
            save()
        if a.exact_last and not a.skip_exact:  # after the speed runs, if the time budget allows
            if time.perf_counter() < stop_at:
                ok = check_exact(device, out) and ok
                print(f"exact (float32): {out['exact']}", flush=True)
            else:
                out["exact"] = "skipped: time budget"
    except Exception:  # noqa: BLE001
        out["error"] = traceback.format_exc()[-3000:]
        print(out["error"], flush=True)
        ok = False
    save()
    summary(out)
    print(f"{'OK' if ok else 'FAILED'}; wrote {path}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
