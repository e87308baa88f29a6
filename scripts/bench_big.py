"""Cost of one speculative step on a Qwen3-8B-shaped random target, next to the HBM floor.

    PYTHONPATH=. python3 scripts/bench_big.py [--tiny] [--out DIR] [--no-compile]

A random-weight bf16 target with Qwen3-8B dimensions (36 layers, hidden 4096, intermediate
12288, 32 heads, 8 KV heads, head dim 128, vocab 151936; 16.4 GB) is built on the GPU with a
matching random 5-layer DFlash draft, and driven through the real loop and static backend
(CUDA graphs, optionally compiled). A scripted draft makes exactly k of the L-1 proposals right
(the real draft forward still runs, so its cost is counted), so the loop's cost per step is
measured independently of draft quality: ms per verify step for block sizes 1, 4, 8, 16 and
k = 0 and k = L-1, next to the HBM floor (bytes read per step / measured copy bandwidth).
``--tiny`` runs the same code on a miniature model on the CPU (eager) for tests.
Writes ``bench_big.json`` to --out (default: $OUT or ./bench_big_out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, tie_word_embeddings=False, rope_theta=1000000.0)  # fmt: skip
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.3)  # fmt: skip


class ScriptedDraft:
    """Wraps a backend: the real draft forward runs, then its proposals are replaced on the
    device by the greedy truth for k positions and a wrong token after (no host sync)."""

    def __init__(self, inner, truth: torch.Tensor, prompt_len: int, k: int):
        self.inner, self.truth, self.prompt_len, self.k = inner, truth, prompt_len, k

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, anchor, context, start, length):
        props, logits = self.inner.draft(anchor, context, start, length)
        i0 = start - self.prompt_len + 1  # index in truth of the token after the anchor
        scripted = self.truth[i0 : i0 + length - 1].clone()
        scripted[self.k :] = (scripted[self.k :] + 1) % self.inner.vocab_size
        return scripted, logits


def build(tiny: bool, device: torch.device, dtype: torch.dtype, compile: bool,
          widths: tuple[int, ...] = (1, 4, 8, 16)):
    """Random target + random draft behind a StaticBackend with a verify graph per width."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.backends.graph_plan import GraphPlan
    from dflash.backends.static_torch import StaticBackend
    from dflash.models.draft_torch import DFlashDraft
    from dflash.models.init_draft import draft_config_for

    torch.manual_seed(0)
    cfg = Qwen3Config(**(TINY if tiny else QWEN3_8B))
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the compute dtype (an fp32 8B would be 33 GB)
    try:
        with torch.device(device):
            target = Qwen3ForCausalLM(cfg).eval()
            dcfg = draft_config_for(cfg, layers=2 if tiny else 5, block_size=16,
                                    mask_token_id=cfg.vocab_size - 1, vocab_rows=cfg.vocab_size)  # fmt: skip
            draft = DFlashDraft(dcfg).eval()
        # Random weights give near-uniform logits: in bf16 a 16-wide verify then rarely picks
        # the block-1 argmax (ties), and no proposal would be "right". An LM head equal to the
        # embedding (untied copy: same bytes) makes the greedy next token the current one with
        # a wide margin, so the truth is the same at every width; costs do not depend on values.
        with torch.no_grad():
            target.lm_head.weight.copy_(target.model.embed_tokens.weight)
    finally:
        torch.set_default_dtype(default)
    be = StaticBackend(target, draft, device, use_graphs=device.type == "cuda", compile=compile)
    be.plan = GraphPlan(verify_widths=tuple(sorted(set(widths) | {1})), draft_width=16)  # each as is
    return be


def param_bytes(module: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters()
               if not n.startswith(skip))  # fmt: skip


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device copy bandwidth in bytes/s (a copy reads and writes each byte)."""
    a = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    b = torch.empty_like(a)
    for _ in range(2):
        b.copy_(a)
    sync(device)
    n = 10
    t = time.perf_counter()
    for _ in range(n):
        b.copy_(a)
    sync(device)
    return 2 * a.numel() * a.element_size() * n / (time.perf_counter() - t)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(be, prompt: list[int], truth: torch.Tensor, block: int, k: int, steps: int) -> dict:
    """Time ``steps`` verify steps at block size L with k right proposals (k = 0 for L = 1),
    every one at the full width L (the budget never trims the last blocks)."""
    from dflash.loop import speculative_generate

    wrapped = ScriptedDraft(be, truth, len(prompt), k) if block > 1 else be
    budget = 1 + steps * (k + 1) + block  # room to spare: no timed step is cut by the budget
    for _ in range(2):  # warm-up (first run after a reset) then the timed run
        rounds = speculative_generate(wrapped, prompt, block_size=block, max_new_tokens=budget)
        first = next(rounds)  # prefill + first token: not timed
        sync(be.device)
        t = time.perf_counter()
        accepted = []
        for r in rounds:  # exactly `steps` full-width verify steps
            accepted.append(r.accepted)
            if len(accepted) == steps:
                break
        sync(be.device)
        dt = time.perf_counter() - t
        rounds.close()
    del first
    return {"block_size": block, "k": k, "steps": len(accepted),
            "ms_per_step": 1000 * dt / max(len(accepted), 1),
            "tau": sum(accepted) / max(len(accepted), 1), "tok_per_s": sum(accepted) / dt}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="miniature model on the CPU (tests)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_big_out"))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32, help="verify steps timed per setting")
    ap.add_argument("--blocks", default="1,4,8,16")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    blocks = [int(b) for b in args.blocks.split(",")]
    t0 = time.perf_counter()
    be = build(args.tiny, device, dtype, args.compile and device.type == "cuda", tuple(blocks))
    built_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, be.vocab_size - 1, (args.prompt_len,), generator=g).tolist()
    # greedy truth (block 1, same kernels) long enough for the longest scripted run
    from dflash.loop import speculative_generate

    n_truth = 17 + args.steps * max(blocks)  # + a full draft block past the last anchor
    truth_ids = [t for r in speculative_generate(be, prompt, block_size=1, max_new_tokens=n_truth)
                 for t in r.tokens]  # fmt: skip
    truth = torch.tensor(truth_ids, device=device)
    # HBM floor: weights read once per forward (embedding rows aside) plus the filled K/V
    tgt = param_bytes(be.target, skip=("model.embed_tokens",))
    drf = param_bytes(be.draft_model) + be.lm_head.weight.numel() * be.lm_head.weight.element_size()
    c = be.target.config
    kv_per_pos = 2 * c.num_hidden_layers * c.num_key_value_heads * be.head_dim * be.dtype.itemsize
    kv = kv_per_pos * (args.prompt_len + args.steps * max(blocks) // 2)
    bw = copy_bandwidth(device, 1 << (22 if args.tiny else 32))
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": str(dtype).split(".")[-1], "tiny": args.tiny, "compile": be.compile,
              "cuda_graphs": be.use_graphs, "prompt_len": args.prompt_len, "build_s": built_s,
              "target_bytes": tgt, "draft_step_bytes": drf, "kv_bytes": kv,
              "copy_bandwidth_GBps": bw / 1e9, "results": []}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = report["results"]
    for block in blocks:
        for k in sorted({0, block - 1}):
            r = run(be, prompt, truth, block, k, args.steps)
            r["floor_ms"] = 1000 * (tgt + kv + (drf if block > 1 else 0)) / bw
            r["x_floor"] = r["ms_per_step"] / r["floor_ms"]
            base = next((x["ms_per_step"] for x in results if x["block_size"] == 1), None)
            r["x_block1"] = r["ms_per_step"] / base if base else (1.0 if block == 1 else None)
            results.append(r)
            report["compile"] = be.compile  # False if compiling failed and fell back
            print(json.dumps(r), flush=True)
            (out / "bench_big.json").write_text(json.dumps(report, indent=2))  # incremental
    print(f"wrote {out / 'bench_big.json'}")
    return report


if __name__ == "__main__":
    main()
