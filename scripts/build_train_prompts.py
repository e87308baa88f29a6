"""Build the demo draft's training prompt file and check it against every benchmark test split.

    PYTHONPATH=. python3 scripts/build_train_prompts.py --data-dir ../shared/datasets \
        --out .stage/prompts/train-prompts.jsonl.gz

Sources (licences in the model card): GSM8K train (MIT), MBPP task ids outside 11-510 (CC-BY-4.0),
MMLU (MIT; validation plus --mmlu-test rows of test), Python stdlib docstrings/signatures (PSF),
templated math, writing, programming-task, chat and composition prompts (built here, ``dflash.data.synthetic``
and ``dflash.data.synthetic_tasks``). The rows are shuffled (Random(seed)) so a time-limited regeneration still
sees every source. Prompts that share a 60-character normalized passage with a gsm8k test, math500,
humaneval, mbpp (11-510) or mt-bench prompt are dropped and listed (``dflash.data.guard``; MMLU
holds some MATH problems and MBPP some near-duplicate tasks); the script fails (exit 1) if any
prompt id belongs to a benchmark test split.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

from dflash.data.datasets import load_prompts
from dflash.data.guard import benchmark_of, benchmark_texts, text_overlap
from dflash.data.synthetic import code_prompts, math_prompts, writing_prompts
from dflash.data.synthetic_tasks import chat_prompts, compose_prompts, task_prompts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--math", type=int, default=8000)
    ap.add_argument("--writing", type=int, default=3000)
    ap.add_argument("--tasks", type=int, default=5000, help="templated programming tasks")
    ap.add_argument("--chat", type=int, default=4000, help="templated roleplay/extraction/reasoning requests")
    ap.add_argument("--compose", type=int, default=6000, help="templated emails/posts/stories/speeches")
    ap.add_argument("--mmlu-test", type=int, default=8000, help="MMLU test rows kept (a seeded sample)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows: list[tuple[str, str]] = []
    for spec in ("gsm8k:train", "mbpp:train", "mmlu"):
        rows += [(it.id, it.turns[0]) for it in load_prompts(spec, data_dir=args.data_dir)]
    test = [r for r in rows if r[0].startswith("mmlu-test/")]
    keep = set(random.Random(args.seed).sample(range(len(test)), min(args.mmlu_test, len(test))))
    drop = {r[0] for i, r in enumerate(test) if i not in keep}
    rows = [r for r in rows if r[0] not in drop]  # MMLU answers are short; keep room for code and chat
    rows += [(f"stdlib/{i}", p) for i, p in enumerate(code_prompts(args.seed))]
    rows += [(f"mathgen/{i}", p) for i, p in enumerate(math_prompts(args.math, args.seed))]
    rows += [(f"writing/{i}", p) for i, p in enumerate(writing_prompts(args.writing, args.seed))]
    rows += [(f"tasks/{i}", p) for i, p in enumerate(task_prompts(args.tasks, args.seed))]
    rows += [(f"chat/{i}", p) for i, p in enumerate(chat_prompts(args.chat, args.seed))]
    rows += [(f"compose/{i}", p) for i, p in enumerate(compose_prompts(args.compose, args.seed))]
    bench_ids = [rid for rid, _ in rows if benchmark_of(rid)]
    bench_texts = benchmark_texts(args.data_dir)
    overlap = set(text_overlap([p for _, p in rows], bench_texts))
    dropped = [rid for rid, p in rows if p in overlap]
    rows = [(rid, p) for rid, p in rows if p not in overlap]  # near-duplicates of test prompts
    counts: dict[str, int] = {}
    for rid, _ in rows:
        src = rid.split("/", 1)[0]
        counts[src] = counts.get(src, 0) + 1
    report = {"prompts": len(rows), "by_source": counts, "benchmark_ids": bench_ids[:5],
              "dropped_overlapping_benchmarks": dropped, "benchmark_texts_checked": len(bench_texts)}  # fmt: skip
    print(json.dumps(report, indent=1))
    if bench_ids or text_overlap([p for _, p in rows], bench_texts):
        print("error: benchmark test prompts found; nothing written", file=sys.stderr)
        return 1
    random.Random(args.seed).shuffle(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt", encoding="utf-8") as f:
        for rid, p in rows:
            f.write(json.dumps({"id": rid, "prompt": p}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
