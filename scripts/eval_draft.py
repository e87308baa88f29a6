"""Acceptance of a trained draft: the fast estimate and the real speculative loop.

    PYTHONPATH=. python3 scripts/eval_draft.py --target M.gguf --draft DIR --eval-data DIR \
        --prompts gsm8k@64 --max-new-tokens 256 --block-size 16 --real-seconds 120 --out eval.json

1. estimate: every response position of ``--eval-data`` (target-regenerated answers) is an
   anchor in one batched draft forward, and greedy decoding is replayed from the matches.
2. real: ``dflash.load`` + ``Pipeline.generate`` (greedy) on the ``--prompts`` in order, for as
   many prompts as ``--real-seconds`` allows; τ is the mean of per-response means, and the
   per-position rate is P(slot k accepted | slots 1..k-1 accepted), pooled over steps.
A measurement, not a test (figures: docs/training.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def per_position(lengths: list[int], proposed: list[int], block: int) -> list[float | None]:
    """Conditional acceptance rate of slots 1..L-1 from per-step τ values and proposal counts."""
    attempts, hits = [0] * block, [0] * block
    for tau, p in zip(lengths, proposed, strict=True):
        a = min(tau - 1, p)  # accepted proposals (the bonus is not a proposal)
        for k in range(1, min(a + 1, p) + 1):
            attempts[k] += 1
            hits[k] += int(k <= a)
    return [hits[k] / attempts[k] if attempts[k] else None for k in range(1, block)]


def estimate(target: str, draft: str, eval_data: str, device: str) -> dict:
    from dflash.models.draft_load import load_draft
    from dflash.train.data import prepare, read_shards
    from dflash.train.objective import FrozenTarget, estimate_acceptance
    from dflash.train.train import load_training_target

    model, _ = load_training_target(target, device)
    dev = next(model.parameters()).device
    d = load_draft(draft, dtype=torch.float32, device=dev).eval()  # DFlash v1 or DFlash2
    seqs = prepare(read_shards(eval_data), 4096)
    ac = torch.bfloat16 if dev.type == "cuda" else None
    out = estimate_acceptance(d, FrozenTarget(model, d.config.target_layer_ids), seqs,
                              pad_id=d.config.mask_token_id, autocast_dtype=ac)  # fmt: skip
    del model, d
    return out


def real(target: str, draft: str, spec: str, max_new: int, block: int, seconds: float,
         device: str) -> dict:  # fmt: skip
    import dflash
    from dflash.train.data import parse_prompt_spec

    pipe = dflash.load(target, draft, device=device)
    items = parse_prompt_spec(spec)
    t0 = time.perf_counter()
    rows, lengths, proposed = [], [], []
    for it in items:
        if time.perf_counter() - t0 > seconds:
            break
        ids = pipe.chat_prompt(it.first_messages())
        r = pipe.generate(ids, max_new_tokens=max_new, block_size=block)
        rows.append({"id": it.id, "tau": r.mean_acceptance_length, "tokens": r.num_new_tokens,
                     "decode_tok_per_s": r.decode_tok_per_s})  # fmt: skip
        lengths += r.acceptance_lengths
        proposed += r.proposed
    taus = [x["tau"] for x in rows if x["tau"] is not None]
    return {
        "prompts": len(rows),
        "tau": sum(taus) / len(taus) if taus else None,
        "tau_pooled": sum(lengths) / len(lengths) if lengths else None,
        "per_position": per_position(lengths, proposed, block),
        "histogram": [lengths.count(k) for k in range(block + 1)],
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--eval-data", default=None)
    ap.add_argument("--prompts", default="gsm8k@64")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--real-seconds", type=float, default=120.0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res: dict = {"draft": args.draft, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                 "block_size": args.block_size}  # fmt: skip
    if args.eval_data:
        res["estimate"] = estimate(args.target, args.draft, args.eval_data, args.device)
        print("estimate:", json.dumps({k: v for k, v in res["estimate"].items()}), flush=True)
    if args.real_seconds > 0:
        res["real"] = real(args.target, args.draft, args.prompts, args.max_new_tokens,
                           args.block_size, args.real_seconds, args.device)  # fmt: skip
        print(
            "real:", json.dumps({k: v for k, v in res["real"].items() if k != "rows"}), flush=True
        )
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
