"""HF ``generate`` vs dflash (block 1, the draft's block size and auto) in one process, same prompts.

    PYTHONPATH=. python3 scripts/hf_baseline.py --model T.gguf --data-dir DIR [--n 8] [--out DIR]

Greedy, ``--max-new-tokens`` (default 256) per prompt, the first ``--n`` gsm8k prompts in the
benchmark's Random(42) order; decode tok/s of each is tokens after the first / time after the
first token (HF: whole generate time minus one prefill forward, timed separately). Also checks
that the three produce the same tokens. Writes ``hf_baseline.json`` to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> dict:
    import dflash
    from dflash.data.datasets import load_prompts, select

    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--data-dir")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--auto", action="store_true",
                    help="also time block_size='auto' (with --compile its first call compiles every width)")
    ap.add_argument("--out", default=os.environ.get("OUT", "hf_baseline_out"))
    args = ap.parse_args(argv)
    pipe = dflash.load(args.model, args.draft, device=args.device, dtype=args.dtype)
    target = pipe.backend.target
    dev = pipe.backend.device
    items = select(load_prompts("gsm8k", args.data_dir), args.n)
    prompts = [pipe.chat_prompt(it.first_messages()) for it in items]
    new = args.max_new_tokens

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def hf(ids):
        x = torch.tensor([ids], device=dev)
        mask = torch.ones_like(x)
        with torch.inference_mode():
            sync()
            t = time.perf_counter()
            target(x)  # one prefill forward, subtracted below
            sync()
            t_pre = time.perf_counter() - t
            t = time.perf_counter()
            out = target.generate(x, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                  eos_token_id=pipe.stop_ids or None, pad_token_id=0)  # fmt: skip
            sync()
            dt = time.perf_counter() - t
        toks = out[0, len(ids) :].tolist()
        return toks, max(dt - t_pre, 1e-9)

    lsz = pipe.block_size  # the draft's trained block size
    sizes = (1, lsz, "auto") if args.auto else (1, lsz)
    rows = {"hf": [], "block1": [], "dflash": [], **({"auto": []} if args.auto else {})}
    hf(prompts[0][:16])  # warm-up (and, for dflash, graph capture and auto's cost calibration)
    for b in sizes:
        pipe.generate(prompts[0], block_size=b, max_new_tokens=new)
    same = 0
    for ids in prompts:
        toks, dt = hf(ids)
        rows["hf"].append((len(toks) - 1) / dt)
        r1 = pipe.generate(ids, block_size=1, max_new_tokens=new)
        rf = pipe.generate(ids, block_size=lsz, max_new_tokens=new)
        rows["block1"].append(r1.decode_tok_per_s or 0.0)
        rows["dflash"].append(rf.decode_tok_per_s or 0.0)
        ok = toks == r1.token_ids == rf.token_ids
        if args.auto:
            ra = pipe.generate(ids, block_size="auto", max_new_tokens=new)
            rows["auto"].append(ra.decode_tok_per_s or 0.0)
            ok = ok and ra.token_ids == toks
        same += ok
    mean = {k: sum(v) / len(v) for k, v in rows.items()}
    report = {"prompts": len(prompts), "max_new_tokens": new, "tok_s_mean": mean,
              "block_size": lsz,
              "dflash_over_hf": mean["dflash"] / mean["hf"],
              **({"auto_over_hf": mean["auto"] / mean["hf"]} if args.auto else {}), "identical_tokens": same,
              "describe": pipe.describe()}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_baseline.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
