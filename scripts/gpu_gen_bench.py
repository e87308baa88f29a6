"""Checks and times the batched generator (``dflash.backends.batched_torch``) on a random target.

    PYTHONPATH=. python3 scripts/gpu_gen_bench.py [--tiny] [--batches 256,512,1024] [--out F]

1. graphs vs eager: the same greedy tokens for a ragged batch (same kernels, so identical);
   rows vs alone: share of rows whose tokens equal that row decoded alone (bf16: batched matmuls
   may round differently, so this is reported, not required).
2. throughput: B rows of random prompts (100-300 tokens) decode ``--new`` tokens each (random
   weights never stop early); generated tokens / wall seconds, prefill and capture included,
   after one warm-up run of the same shape.
A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
               tie_word_embeddings=True, rope_theta=100000.0)  # fmt: skip
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            tie_word_embeddings=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batches", default="256,512,1024")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.backends.batched_torch import BatchedGenerator

    shape = TINY if args.tiny else SMOLLM2
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(dev, dtype).eval()
    rng = random.Random(0)
    vocab = shape["vocab_size"]
    res: dict = {"device": str(dev), "torch": torch.__version__}
    ragged = [[rng.randrange(vocab) for _ in range(rng.randint(5, 60))] for _ in range(12)]
    g = BatchedGenerator(model, max_batch=8, capacity=256, use_graphs=True)
    e = BatchedGenerator(model, max_batch=8, capacity=256, use_graphs=False)
    a = g.generate(ragged, 48)
    b = e.generate(ragged, 48)
    one = BatchedGenerator(model, max_batch=1, capacity=256, use_graphs=False)
    alone = [one.generate([p], 48)[0] for p in ragged]
    res["graphs_equal_eager"] = a == b
    res["rows_equal_alone"] = sum(x == y for x, y in zip(b, alone, strict=True)) / len(ragged)
    print(json.dumps(res), flush=True)
    for bsz in (int(x) for x in args.batches.split(",")):
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(100, 300))] for _ in range(bsz)]
        gen = BatchedGenerator(model, max_batch=bsz, capacity=320 + args.new)
        gen.generate(prompts, args.new)  # warm-up: graphs for every KV bucket
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = gen.generate(prompts, args.new)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        sec = time.perf_counter() - t0
        n = sum(len(o) for o in outs)
        res[f"batch_{bsz}"] = {"tokens": n, "seconds": round(sec, 3), "tok_per_s": round(n / sec)}
        print(f"batch {bsz}: {n} tokens in {sec:.2f}s = {n / sec:,.0f} tok/s", flush=True)
        del gen
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
