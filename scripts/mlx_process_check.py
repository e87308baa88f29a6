"""Is mlx-lm slower inside ``dflash benchmark mlx`` than alone? Times mlx_lm.stream_generate in
fresh processes set up differently, interleaved over rounds, and prints JSON.

Variants (each one child process per round, same prompts, same timing rule: decode tok/s = 1 /
mean per-response time per output token after the first, as ``dflash benchmark`` reports it):

- ``plain``: mlx-lm alone, torch hidden (as where torch is not installed);
- ``plain_torch``: mlx-lm alone, torch imported by transformers as mlx-lm's import does when
  torch is installed;
- ``plain_torch_cuda``: plus a CUDA context and allocation made by torch on the same GPU (only
  where torch sees CUDA);
- ``ours_ref``: ``dflash.load(backend="mlx")`` in a process set up as ``dflash benchmark mlx``
  sets it up (no torch), then the benchmark's own mlx-lm baseline
  (``Pipeline.reference_generate``) on each prompt, nothing else;
- ``ours_bench``: the benchmark's code path itself (``harness.run_benchmark`` with its progress
  bar: per prompt mlx-lm, block size 1, then DFlash); mlx-lm, block-1 and DFlash tok/s;
- ``ours_bench_torch``: the same with torch imported first (how ``dflash benchmark mlx`` ran
  before it kept torch out);
- ``authors``: the DFlash authors' package (``dflash`` 0.1.0 from PyPI, installed with its
  mlx-lm into the folder ``--authors-site`` names; it shares our import name, so this child runs
  without our repository on its path): per prompt mlx-lm's ``stream_generate`` and then the
  authors' ``dflash.model_mlx.stream_generate`` on the same target folder, draft and prompt ids,
  as their mlx benchmark does; mlx-lm and DFlash tok/s by the same timing rule.

Each child also reports whether torch was loaded, its Python threads, garbage-collector passes
and pause time during the timed part, and mlx's peak memory.

Usage (from the repository root; the demo pair when --model is not given)::

    python scripts/mlx_process_check.py --prompts 16 --max-new-tokens 256 --rounds 2
    python scripts/mlx_process_check.py --model path/to/mlx-lm-folder --draft path/to/draft
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = (
    "plain",
    "plain_torch",
    "plain_torch_cuda",
    "ours_ref",
    "ours_bench",
    "ours_bench_torch",
    "authors",
)
DEFAULT = ("plain", "plain_torch", "ours_ref", "ours_bench", "ours_bench_torch")


class GcClock:
    """Garbage-collector passes per generation and their total pause, while active."""

    def __init__(self) -> None:
        self.passes = [0, 0, 0]
        self.pause_s = 0.0
        self._t = 0.0

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.pause_s += time.perf_counter() - self._t
            self.passes[info["generation"]] += 1

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)


def tok_s(runs: list[tuple[int, float]]) -> float | None:
    """1 / mean TPOT over responses (n tokens, decode seconds after the first token)."""
    tpots = [d / (n - 1) for n, d in runs if n > 1 and d > 0]
    return len(tpots) / sum(tpots) if tpots else None


def plain_generate(model, tokenizer, prompt: list[int], n: int) -> tuple[int, float]:
    """A standalone mlx-lm loop: greedy stream_generate; (tokens, seconds after the first)."""
    import mlx.core as mx
    from mlx_lm import stream_generate

    count = 0
    mx.synchronize()
    t1 = time.perf_counter()
    for _ in stream_generate(model, tokenizer, prompt, max_tokens=n):
        count += 1
        if count == 1:
            t1 = time.perf_counter()
    return count, time.perf_counter() - t1


def process_info(torch_first: bool) -> dict:
    import mlx.core as mx

    t = sys.modules.get("torch")
    return {
        "torch_loaded": t is not None,
        "torch_imported_first": torch_first,
        "python_threads": threading.active_count(),
        "os_threads": _os_threads(),
        "mlx_device": str(mx.default_device()),
        "mlx_peak_memory_mb": round(mx.get_peak_memory() / 2**20, 1),
        "mlx_cache_memory_mb": round(mx.get_cache_memory() / 2**20, 1),
    }


def _os_threads() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def child(variant: str, spec: dict) -> dict:
    """Run one variant in this (fresh) process; returns its JSON record."""
    prompts, n = spec["prompts"], spec["max_new_tokens"]
    torch_first = variant in ("plain_torch_cuda", "ours_bench_torch")
    if variant in ("plain", "ours_ref", "ours_bench"):
        sys.path.insert(0, str(ROOT))
        from dflash.mlx_process import keep_torch_out

        keep_torch_out()
    if torch_first:
        import torch

        if variant == "plain_torch_cuda":
            if not torch.cuda.is_available():
                return {"variant": variant, "skipped": "torch sees no CUDA device"}
            torch.zeros(1 << 20, device="cuda").sum().item()  # a context and the caching allocator
    out: dict = {"variant": variant}
    if variant == "authors":
        return out | authors_child(spec)
    if variant.startswith("plain"):
        from mlx_lm import load

        model, tokenizer = load(spec["model_path"])
        plain_generate(model, tokenizer, prompts[0], min(64, n))  # untimed warm-up
        with GcClock() as gcc:
            runs = [plain_generate(model, tokenizer, p, n) for p in prompts]
        out["mlx_lm_tok_s"] = tok_s(runs)
    else:
        sys.path.insert(0, str(ROOT))
        import dflash
        from dflash.bench import harness, report
        from dflash.bench.metrics import summarize

        pipe = dflash.load(spec["model"], spec["draft"], backend="mlx", device=spec["device"])
        if variant == "ours_ref":
            pipe.reference_generate(prompts[0], max_new_tokens=min(64, n))  # untimed warm-up
            with GcClock() as gcc:
                runs = []
                for p in prompts:
                    r = pipe.reference_generate(p, max_new_tokens=n)
                    runs.append((len(r.token_ids), r.decode_s))
            out["mlx_lm_tok_s"] = tok_s(runs)
        else:
            items = harness_items(spec)
            config = harness.BenchConfig(block_size=spec["block_size"], max_new_tokens=n)
            with GcClock() as gcc, report.BenchProgress(enabled=True) as progress:
                recs = harness.run_benchmark(pipe, {"gsm8k": items}, config,
                                             on_record=progress.update, on_dataset=progress.start)  # fmt: skip
            s = summarize(recs["gsm8k"])
            out |= {"mlx_lm_tok_s": s.get("reference_tok_s"), "block1_tok_s": s.get("baseline_tok_s"),
                    "dflash_tok_s": s.get("dflash_tok_s"), "tau": s.get("tau_mean_of_responses")}  # fmt: skip
    out |= {"gc_passes": gcc.passes, "gc_pause_s": round(gcc.pause_s, 4)} | process_info(
        torch_first
    )
    return out


def authors_child(spec: dict) -> dict:
    """The authors' mlx path (their package must be first on ``sys.path``, ours absent)."""
    import mlx.core as mx

    import dflash  # theirs: the child runs with --authors-site on PYTHONPATH, not our repo
    from dflash import model_mlx

    here = str(Path(dflash.__file__).resolve())
    if here.startswith(str(ROOT)):
        raise SystemExit(f"authors variant imported this repository's dflash ({here})")
    model_mlx.snapshot_download = lambda path, **_: path  # local folders, no hub
    model, tokenizer = model_mlx.load(spec["model_path"])
    draft = model_mlx.load_draft(spec["draft_path"])
    block = spec["block_size"] or int(draft.config.block_size)

    def theirs(prompt: list[int], n: int) -> tuple[int, float, list[int]]:
        count, accepted = 0, []
        mx.synchronize()
        t1 = time.perf_counter()
        for i, r in enumerate(model_mlx.stream_generate(model, draft, tokenizer, prompt,
                                                        block_size=block, max_tokens=n)):  # fmt: skip
            count += len(r.tokens)
            if r.accepted is not None:
                accepted.append(r.accepted)
            if i == 0:
                t1 = time.perf_counter()
        return count, time.perf_counter() - t1, accepted

    prompts, n = spec["prompts"], spec["max_new_tokens"]
    plain_generate(model, tokenizer, prompts[0], min(64, n))  # untimed warm-ups
    theirs(prompts[0], min(64, n))
    base, runs, accepted = [], [], []
    with GcClock() as gcc:
        for p in prompts:
            base.append(plain_generate(model, tokenizer, p, n))
            c, d, acc = theirs(p, n)
            runs.append((c, d))
            accepted += acc
    return {"mlx_lm_tok_s": tok_s(base), "dflash_tok_s": tok_s(runs), "block_size": block,
            "authors_version": getattr(dflash, "__version__", None), "authors_file": here,
            "accepted_mean": statistics.mean(accepted) if accepted else None,
            "gc_passes": gcc.passes, "gc_pause_s": round(gcc.pause_s, 4)} | process_info(False)  # fmt: skip


def harness_items(spec: dict) -> list:
    from dflash.data.datasets import load_prompts, select

    return select(
        load_prompts(spec["dataset"], None, offline=spec["offline"]), len(spec["prompts"])
    )


def prepare(args: argparse.Namespace) -> dict:
    """Resolve the target folder and the prompts' token ids as the benchmark builds them."""
    sys.path.insert(0, str(ROOT))
    from dflash.mlx_process import keep_torch_out

    keep_torch_out()
    import dflash
    from dflash.models.target_mlx import resolve_target

    spec = {"model": args.model, "draft": args.draft, "device": args.device, "dataset": args.dataset,
            "offline": args.offline, "max_new_tokens": args.max_new_tokens, "block_size": args.block_size,
            "model_path": resolve_target(args.model)}  # fmt: skip
    pipe = dflash.load(args.model, args.draft, backend="mlx", device=args.device)
    spec["draft_path"] = str(args.draft or ROOT / "dflash" / "assets" / "smollm2-135m-instruct-dflash")
    spec["prompts"] = []
    from dflash.data.datasets import load_prompts, select

    for item in select(load_prompts(args.dataset, None, offline=args.offline), args.prompts):
        spec["prompts"].append(pipe.chat_prompt(item.first_messages()))
    return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="mlx-lm folder, hub id or .gguf (default: demo)")
    ap.add_argument("--draft", default=None, help="draft folder (default: demo draft)")
    ap.add_argument("--device", default="auto", help="auto, gpu or cpu")
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--offline", action="store_true", help="the shipped test prompts, no hub")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--variants", default=",".join(DEFAULT), help=f"comma list of {', '.join(VARIANTS)}"
    )
    ap.add_argument("--authors-site", default=None,
                    help="folder holding the authors' dflash 0.1.0 (pip install --target) for the authors variant")  # fmt: skip
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, json.loads(Path(args.spec).read_text()))))
        return
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        sys.exit(f"error: unknown variant {bad[0]!r}\nhint: use {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec = prepare_in_child(args, spec_file)
        rows = []
        for rnd in range(args.rounds):
            order = variants if rnd % 2 == 0 else variants[::-1]  # interleaved, alternating order
            for v in order:
                rec = run_child(v, spec_file, args.authors_site)
                rec["round"] = rnd + 1
                rows.append(rec)
                print(json.dumps(rec), file=sys.stderr, flush=True)
    summary = {}
    for v in variants:
        recs = [r for r in rows if r.get("variant") == v and "skipped" not in r]
        if not recs:
            continue
        summary[v] = {k: statistics.median(vals) for k in ("mlx_lm_tok_s", "block1_tok_s", "dflash_tok_s")
                      if (vals := [r[k] for r in recs if r.get(k) is not None])}  # fmt: skip
    base = summary.get("plain", {}).get("mlx_lm_tok_s")
    if base:
        for s in summary.values():
            if s.get("mlx_lm_tok_s"):
                s["mlx_lm_vs_plain"] = s["mlx_lm_tok_s"] / base
    print(json.dumps({"spec": {k: v for k, v in spec.items() if k != "prompts"}, "rounds": rows,
                      "median": summary}))  # fmt: skip


def prepare_in_child(args: argparse.Namespace, spec_file: Path) -> dict:
    """:func:`prepare` in a child process (this one stays free of mlx and torch)."""
    code = (
        "import json, sys, argparse; sys.path.insert(0, sys.argv[1]);"
        "import runpy; m = runpy.run_path(sys.argv[2]);"
        "a = argparse.Namespace(**json.loads(sys.argv[3]));"
        "open(sys.argv[4], 'w').write(json.dumps(m['prepare'](a)))"
    )
    ns = {k: getattr(args, k) for k in ("model", "draft", "device", "dataset", "offline", "prompts",
                                        "max_new_tokens", "block_size")}  # fmt: skip
    subprocess.run([sys.executable, "-c", code, str(ROOT), __file__, json.dumps(ns), str(spec_file)],
                   check=True, cwd=ROOT)  # fmt: skip
    return json.loads(spec_file.read_text())


def run_child(variant: str, spec_file: Path, authors_site: str | None = None) -> dict:
    env = dict(os.environ)
    if variant == "authors":
        if not authors_site:
            return {"variant": variant, "skipped": "no --authors-site"}
        keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                if p and Path(p).resolve() != ROOT]  # fmt: skip
        env["PYTHONPATH"] = os.pathsep.join([authors_site, *keep])
    out = subprocess.run([sys.executable, __file__, "--child", variant, "--spec", str(spec_file)],
                         capture_output=True, text=True, cwd=ROOT, env=env)  # fmt: skip
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"variant": variant, "error": (out.stderr or out.stdout).strip().splitlines()[-3:]}


if __name__ == "__main__":
    main()
