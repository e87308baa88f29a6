"""Checks and times the batched generator (``dflash.backends.static.batched``) on a random target.

    PYTHONPATH=. python3 scripts/gpu_gen_bench.py [--tiny] [--batches 512,1024]
        [--settings dense,kv,kv+compile] [--jobs-per-row 2] [--out F]

1. parity (small ragged greedy batch, bf16 on CUDA): graphs vs eager for each attention kind
   (same kernels, so identical tokens expected), and the share of rows whose tokens equal the
   dense eager reference for kv (bf16 rounds differently; reported, not required).
2. throughput, every setting side by side in one process, at each batch size: jobs like real
   regeneration (prompts 50-400 random tokens, answer budgets uniform 64..1024 since random
   weights never stop, every other job sampled at T=0.8), ``jobs-per-row`` x B jobs through B
   rows. Reported per setting: generated tokens / wall second over the whole run (prefill and
   drain tail included, graph capture and compile excluded: they happen once per process),
   ``steady`` (finished tokens / second while the queue still feeds every row), the capture +
   compile seconds, and ``probe_rows_equal_first``: after the timed run, 32 greedy 48-token
   answers at the same B, the share equal to the first setting's (bf16: most, not all). Settings: ``dense`` (attention over the longest row's bucket, the old path),
   ``kv`` (each row over its own length), ``+compile`` (Inductor before capture).
A measurement, not a test.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path

import torch

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
               tie_word_embeddings=True, rope_theta=100000.0)  # fmt: skip
TINY = dict(vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048,
            tie_word_embeddings=True)  # fmt: skip


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def parse_setting(name: str) -> dict:
    parts = name.split("+")
    if parts[0] not in ("dense", "kv") or any(p != "compile" for p in parts[1:]):
        raise SystemExit(f"unknown setting {name!r}: use dense|kv with an optional +compile")
    return {"kv_lengths": parts[0] == "kv", "compile": "compile" in parts[1:]}


def parity(model, dev, vocab: int, rng: random.Random) -> dict:
    """Graphs vs eager per attention kind; kv_lengths vs the dense eager reference."""
    from dflash.backends.static.batched import BatchedGenerator

    ragged = [[rng.randrange(vocab) for _ in range(rng.randint(5, 300))] for _ in range(12)]
    res: dict = {}

    def gen(**kw):
        return BatchedGenerator(model, max_batch=8, capacity=512, **kw).generate(ragged, 64)

    ref = gen(use_graphs=False, kv_lengths=False, compile=False)
    for kind, kv in (("dense", False), ("kv", True)):
        eager = ref if not kv else gen(use_graphs=False, kv_lengths=True, compile=False)
        graphs = gen(use_graphs=True, kv_lengths=kv, compile=False)
        res[f"{kind}_graphs_equal_eager"] = graphs == eager
        same = sum(a == b for a, b in zip(eager, ref, strict=True))
        res[f"{kind}_rows_equal_dense_eager"] = same / len(ragged)
    return res


def throughput(model, dev, vocab: int, bsz: int, setting: str, args) -> dict:
    """One setting at batch ``bsz``: tokens / second (see the module docstring)."""
    from dflash.backends.static.batched import BatchedGenerator, Job

    rng = random.Random(bsz)  # the same jobs for every setting at this batch size
    lo, hi = args.prompt_range
    jobs = [Job([rng.randrange(vocab) for _ in range(rng.randint(lo, hi))],
                rng.randint(args.min_new, args.max_new), 0.8 if i % 2 else 0.0)
            for i in range(bsz * args.jobs_per_row)]  # fmt: skip
    capacity = -(-(hi + args.max_new + 1) // 64) * 64  # as ``dflash data regenerate`` sizes it
    gen = BatchedGenerator(model, max_batch=bsz, capacity=capacity, **parse_setting(setting))
    captured = [0.0]
    capture = gen._capture

    def timed_capture(width):  # graph capture + compile: once per process, not per token
        t = time.perf_counter()
        out = capture(width)
        sync(dev)
        captured[0] += time.perf_counter() - t
        say(f"  B={bsz} {setting}: captured width {width} in {time.perf_counter() - t:.1f}s")
        return out

    gen._capture = timed_capture
    sync(dev)
    t0 = time.perf_counter()
    marks: list[tuple[float, int]] = []
    total = 0
    for n_done, (_, toks) in enumerate(gen.run(jobs, seed=0), start=1):
        total += len(toks)
        marks.append((time.perf_counter() - captured[0], total))
        if n_done % max(1, len(jobs) // 4) == 0:
            say(f"  B={bsz} {setting}: {n_done}/{len(jobs)} jobs, {total:,} tokens")
    sync(dev)
    sec = time.perf_counter() - t0 - captured[0]
    probe = gen.generate([j.prompt_ids for j in jobs[:32]], 48)  # greedy, same B: no recompile
    k1, k2 = bsz // 2, max(bsz // 2 + 1, len(jobs) - bsz)  # the queue still feeds every row
    (ta, na), (tb, nb) = marks[k1 - 1], marks[min(k2, len(marks)) - 1]
    res = {"tokens": total, "seconds": round(sec, 2), "tok_per_s": round(total / sec),
           "steady_tok_per_s": round((nb - na) / max(tb - ta, 1e-9)),
           "capture_s": round(captured[0], 1), "kv_lengths": gen.kv_lengths,
           "compile": gen.compile, "probe": probe}  # fmt: skip
    gen.__dict__.pop("_capture")  # kv_lengths / compile above are read after any fallback
    del gen  # compiled forwards refer back to gen: collected below
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        res["gpu_gb_left_allocated"] = round(torch.cuda.memory_allocated(dev) / 2**30, 2)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="a 4-layer model (a CPU smoke run)")
    ap.add_argument("--batches", default="512,1024")
    ap.add_argument("--settings", default="dense,kv,kv+compile")
    ap.add_argument("--jobs-per-row", type=int, default=2)
    ap.add_argument("--min-new", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=1024)
    ap.add_argument("--prompt-range", type=lambda s: tuple(int(x) for x in s.split(",")),
                    default=(50, 400))  # fmt: skip
    ap.add_argument("--no-parity", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = TINY if args.tiny else SMOLLM2
    settings = args.settings.split(",")
    for s in settings:
        parse_setting(s)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(dev, dtype).eval()
    vocab = shape["vocab_size"]
    res: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "torch": torch.__version__, "settings": settings,
                 "workload": {"prompts": list(args.prompt_range), "new": [args.min_new, args.max_new],
                              "jobs_per_row": args.jobs_per_row}}  # fmt: skip
    if not args.no_parity:
        say("parity ...")
        res["parity"] = parity(model, dev, vocab, random.Random(0))
        say(json.dumps(res["parity"]))
    probes: dict[int, list] = {}
    for bsz in (int(x) for x in args.batches.split(",")):
        for setting in settings:
            say(f"B={bsz} {setting} ...")
            r = throughput(model, dev, vocab, bsz, setting, args)
            probe = r.pop("probe")
            first = probes.setdefault(bsz, probe)  # the first setting's greedy rows
            same = sum(a == b for a, b in zip(probe, first, strict=True))
            r["probe_rows_equal_first"] = same / len(probe)
            res.setdefault(f"batch_{bsz}", {})[setting] = r
            say(f"B={bsz} {setting}: {r['tok_per_s']:,} tok/s (steady {r['steady_tok_per_s']:,}), "
                f"{r['tokens']:,} tokens in {r['seconds']}s + capture {r['capture_s']}s")  # fmt: skip
            if args.out:  # after every setting, so a timeout keeps what was measured
                Path(args.out).write_text(json.dumps(res, indent=1))
    for bsz in (int(x) for x in args.batches.split(",")):
        row = res[f"batch_{bsz}"]
        say(f"B={bsz}: " + "  ".join(f"{s} {row[s]['tok_per_s']:,} ({row[s]['steady_tok_per_s']:,})"
                                      for s in settings))  # fmt: skip


if __name__ == "__main__":
    main()
