"""Write the benchmark prompts dflash ships for offline use (``dflash/assets/datasets``).

    PYTHONPATH=. python3 scripts/make_offline_datasets.py --data-dir ../shared/datasets

For each benchmark set (gsm8k, math500, humaneval, mbpp, mt-bench) the rows of its test split
that ``dflash benchmark`` picks first (the ``random.Random(42)`` order of
:func:`dflash.data.datasets.select`), at most ``--rows`` of them, in that order, each with its row
index among the split's rows as ``_index`` (the prompt id), verbatim but for the long fields the
benchmark and ``--score`` never read (MATH-500 ``solution``). Files are gzip'd JSONL with
mtime 0, so a rerun on the same data writes the same bytes. ``index.json`` records how many
rows each set has in all.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

from dflash.data.datasets import BENCHMARK_NAMES, SELECT_SEED, SOURCES, _load_rows
from dflash.data.offline import OFFLINE_DIR

DROP = {"math500": ("solution",)}  # fields no prompt and no score reads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, required=True, help="a folder in the tests/datasets layout")
    ap.add_argument("--rows", type=int, default=128, help="rows per set (at most)")
    ap.add_argument("--out", type=Path, default=OFFLINE_DIR)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    index = {}
    for name in BENCHMARK_NAMES:
        source = SOURCES[name]
        rows = _load_rows(name, source, args.data_dir)
        rows = [r for r in rows if source.keep is None or source.keep(r)]
        order = list(range(len(rows)))
        random.Random(SELECT_SEED).shuffle(order)
        kept = [{**{k: v for k, v in rows[i].items() if k not in DROP.get(name, ())}, "_index": i}
                for i in order[: args.rows]]  # fmt: skip
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept).encode("utf-8")
        path = args.out / f"{name}.jsonl.gz"
        with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as gz:
            gz.write(data)
        index[name] = {"file": path.name, "rows": len(kept), "of": len(rows)}
        print(f"{name}: {len(kept)} of {len(rows)} rows, {path.stat().st_size:,} bytes")
    (args.out / "index.json").write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
