"""Smoke test and timings of draft training on a random target shaped like SmolLM2-135M.

    PYTHONPATH=. python3 scripts/gpu_smoke.py [--tiny] [--out DIR]

Checks the CUDA path end to end before the real job (FlexAttention compile, bf16 autocast, fused
AdamW, the chunked head loss, checkpoint export, the acceptance estimate) and times a training
step and a batched ``generate`` step. ``--tiny`` runs a miniature version on CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path

import torch

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
               tie_word_embeddings=True, rope_theta=100000.0)  # fmt: skip
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            tie_word_embeddings=True)  # fmt: skip


def synth_data(folder: Path, n: int, vocab: int, seed: int = 0) -> None:
    """n random records: prompt ~150 tokens, response 200..350 tokens."""
    from dflash.train.data import ShardWriter

    rng = random.Random(seed)
    recs = [{"id": f"s{i}", "prompt_ids": [rng.randrange(vocab) for _ in range(rng.randint(100, 200))],
             "response_ids": [rng.randrange(vocab) for _ in range(rng.randint(200, 350))]}
            for i in range(n)]  # fmt: skip
    ShardWriter(folder, {"synthetic": n}).append(recs, n)


def time_training(model, root: Path, attention: str, steps: int, batch_tokens: int, anchors: int):
    """Train ``steps`` steps; returns (seconds per step after the first 3, peak GiB, last log)."""
    from dflash.train.train import TrainConfig, Trainer

    cfg = TrainConfig(target=None, data=str(root / "data"), out=str(root / f"out-{attention}"),
                      init=str(root / "init"), block_size=16, anchors=anchors, epochs=50,
                      max_steps=steps, batch_tokens=batch_tokens, max_len=1024,
                      eval_data=str(root / "eval"), eval_every=10_000, save_every=10_000,
                      log_every=1, attention=attention)  # fmt: skip
    times: list[float] = []
    trainer = Trainer(
        cfg, model, on_log=lambda r: times.append(time.perf_counter()) if "loss" in r else print(r)
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    last = trainer.run()
    per = (times[-2] - times[2]) / max(1, len(times) - 4) if len(times) > 5 else float("nan")
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    print(f"{attention}: {steps} steps in {time.perf_counter() - t0:.1f}s (first step incl. compile "
          f"{times[0] - t0:.1f}s), {per * 1000:.0f} ms/step, peak {peak:.1f} GiB, "
          f"flex={trainer.flex}, loss {last.get('loss')}, heldout {last.get('heldout')}", flush=True)  # fmt: skip
    return per, peak, last


def time_generate(model, batch: int, new_tokens: int, vocab: int) -> float:
    """Seconds per decode step of a left-padded batched greedy ``generate``."""
    from transformers import GenerationConfig

    dev = next(model.parameters()).device
    ids = torch.randint(0, vocab, (batch, 160), device=dev)
    att = torch.ones_like(ids)
    att[: batch // 2, :40] = 0  # some left padding
    times = []
    for n in (4, 4, new_tokens):  # the first call warms up
        cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=att, generation_config=cfg)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    per = (times[2] - times[1]) / (new_tokens - 4)
    print(
        f"generate batch {batch}: {per * 1000:.1f} ms/step ({batch / per:,.0f} tok/s)", flush=True
    )
    return per


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--root", default="/tmp/smoke")
    ap.add_argument("--out", default=None, help="write a JSON summary here")
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.models.draft_torch import DFlashDraft
    from dflash.models.init_draft import draft_config_for

    shape = TINY if args.tiny else SMOLLM2
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    print(f"torch {torch.__version__}, device {dev}", flush=True)
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)  # a leftover run would be resumed, not timed
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**shape)).to(dev, dtype).eval()
    cfg = draft_config_for(target.config, layers=5, block_size=16, mask_token_id=16,
                           vocab_rows=shape["vocab_size"])  # fmt: skip
    DFlashDraft(cfg).save(root / "init")
    synth_data(root / "data", 64 if args.tiny else 600, shape["vocab_size"])
    synth_data(root / "eval", 4 if args.tiny else 16, shape["vocab_size"], seed=1)
    summary = {}
    bt = 2048 if args.tiny else 16384
    runs = (("dense", 6),) if args.tiny else (("auto", 30), ("dense", 8))  # no flex backward on CPU
    for attention, steps in runs:
        per, peak, _ = time_training(target, root, attention, steps, bt, 64 if args.tiny else 512)
        summary[attention] = {"ms_per_step": per * 1000, "peak_gib": peak}
    from dflash.models.draft_torch import DFlashDraft as D

    exported = D.load(root / f"out-{runs[0][0]}")
    files = sorted(p.name for p in (root / f"out-{runs[0][0]}").iterdir())
    print("export:", files, exported.config.to_dict()["dtype"], flush=True)
    for batch in (8,) if args.tiny else (256, 768):
        summary[f"generate_{batch}_ms"] = time_generate(target, batch, 8 if args.tiny else 40,
                                                        shape["vocab_size"]) * 1000  # fmt: skip
    print(json.dumps(summary), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
