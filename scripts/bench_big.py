"""Cost of one speculative step on a Qwen3-8B-shaped random target, next to the HBM floor.

    PYTHONPATH=. python3 scripts/bench_big.py [--tiny] [--out DIR] [--no-compile]
        [--shape qwen3-8b|smollm2|qwen3.5-9b] [--arch qwen3|llama] [--no-device-loop] [--profile] [--dtype float32]

A random-weight bf16 target with Qwen3-8B dimensions (36 layers, hidden 4096, intermediate
12288, 32 heads, 8 KV heads, head dim 128, vocab 151936; 16.4 GB) is built on the GPU with a
matching random 5-layer DFlash draft, and driven through the real loop and static backend
(CUDA graphs, optionally compiled). A scripted draft makes exactly k of the L-1 proposals right
(the real draft forward still runs, so its cost is counted), so the loop's cost per step is
measured independently of draft quality: ms per verify step for block sizes 1, 4, 8, 16 and
k = 0 and k = L-1, next to the HBM floor (bytes read per step / measured copy bandwidth).

Greedy requests run through the device loop (:mod:`dflash.backends.static.device_loop`) unless
``--no-device-loop``; there the proposals are scripted on the device inside the draft graph.
A step's time is taken in steady state: from the host's read of the first step (whose draft
reads the whole prompt, eagerly) to its read of step ``--steps`` + 1. ``diverged_at`` is the
first token where a run left the block-1 truth (None: never), so a low τ at k = L-1 can be told
from a numerical difference between widths. ``--profile`` adds, per setting, the kernels of
``--steps`` steps (torch.profiler): device-busy ms per step next to the wall ms per step (the
difference is time the GPU waited for the host) and the kernels with the most device time.
``--shape qwen3.5-9b`` runs a GatedDeltaNet hybrid of Qwen3.5-9B's text shape (the floor then
counts the K/V of its 8 attention layers and one read and one write of the 24 recurrent states);
``--shape smollm2`` runs the demo target's shape (SmolLM2-135M, with a 5-layer draft of the
demo draft's shape). ``--arch llama`` builds a Llama model of those dims instead of a Qwen3 one
(no q/k norms). ``--tiny`` runs the same code on a miniature model on the CPU (eager) for
tests. Writes ``bench_big.json`` to --out (default: $OUT or ./bench_big_out).
"""

from __future__ import annotations

import argparse
import hashlib
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
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=100000.0)  # fmt: skip
# Qwen3.5-9B's text model (its published config's text part): 32 layers, 3 GatedDeltaNet : 1
# gated attention, hidden 4096, MLP 12288, attention 16 heads (4 KV) of 256 with RoPE on 64 dims,
# linear attention 16 key heads and 32 value heads of 128, conv 4, vocab 248320 (~17.9 GB bf16)
QWEN35_9B = dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_conv_kernel_dim=4,
                 linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                 linear_num_value_heads=32, max_position_embeddings=262144, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                  "partial_rotary_factor": 0.25})  # fmt: skip
SHAPES = {"qwen3-8b": QWEN3_8B, "smollm2": SMOLLM2, "qwen3.5-9b": QWEN35_9B}
HYBRID_SHAPES = ("qwen3.5-9b",)  # built as Qwen3.5 text models (Qwen3_5ForCausalLM)
TINY_HYBRID = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
                   linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False,
                   initializer_range=0.3)  # fmt: skip
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


class ScriptedLoop:
    """Makes a backend's device loop propose the greedy truth for ``k`` rows and a wrong token
    after (inside the draft graph); ``truth`` and ``k`` are device tensors filled in place, so
    graphs captured before the truth is known still read the current values."""

    def __init__(self, loop, truth_len: int, prompt_len: int):
        dev = loop.tok.device
        self.truth = torch.zeros(truth_len, dtype=torch.long, device=dev)
        self.k = torch.zeros(1, dtype=torch.long, device=dev)
        self.loop, self.prompt_len = loop, prompt_len
        loop.proposals_hook = self  # an instance attribute: captured from now on

    def __call__(self, proposals: torch.Tensor) -> torch.Tensor:
        lp, rows = self.loop, self.loop.arange[: proposals.shape[0]]
        idx = (lp.pos - self.prompt_len + 1 + rows).clamp(0, self.truth.shape[0] - 1)
        scripted = self.truth[idx]
        return torch.where(rows < self.k, scripted, (scripted + 1) % lp.be.vocab_size)


def build(tiny: bool, device: torch.device, dtype: torch.dtype, compile: bool,
          widths: tuple[int, ...] = (1, 4, 8, 16), shape: str = "qwen3-8b",
          device_loop: bool | None = None, init_std: float | None = None, arch: str = "qwen3"):
    """Random target + random draft behind a StaticBackend with a verify graph per width.

    ``init_std``: weight init std of the target (default the config's 0.02): a small one keeps
    the residual stream near the token's embedding, so the greedy margin is wide at every width.
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3_5ForCausalLM,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from dflash.backends.static.backend import StaticBackend
    from dflash.backends.static.graph_plan import GraphPlan
    from dflash.models.draft_torch import DFlashDraft
    from dflash.models.init_draft import draft_config_for

    torch.manual_seed(0)
    extra = {} if init_std is None else {"initializer_range": init_std}
    config, model = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    dims = TINY if tiny else SHAPES[shape]
    if shape in HYBRID_SHAPES:  # a GatedDeltaNet hybrid (dflash.backends.static.hybrid)
        config, model, dims = Qwen3_5TextConfig, Qwen3_5ForCausalLM, TINY_HYBRID if tiny else dims
    cfg = config(**{**dims, **extra})
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the compute dtype (an fp32 8B would be 33 GB)
    try:
        with torch.device(device):
            target = model(cfg).eval()
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
    from dflash.kernels.settings import KernelSettings

    be = StaticBackend(target, draft, device, use_graphs=device.type == "cuda", compile=compile,
                       device_loop=device_loop, settings=KernelSettings.resolve())  # the overrides, as a load  # fmt: skip
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


def run(be, prompt: list[int], truth: torch.Tensor, block: int, k: int, steps: int,
        script: ScriptedLoop | None = None, profile: bool = False) -> dict:
    """Time ``steps`` verify steps at block size L with k right proposals (k = 0 for L = 1),
    every one at the full width L (the budget never trims the timed blocks), in steady state:
    from the read of the first step to the read of step ``steps`` + 1."""
    from dflash.loop import speculative_generate

    if script is not None:
        script.k.fill_(k)
    wrapped = ScriptedDraft(be, truth, len(prompt), k) if block > 1 and script is None else be
    budget = 1 + (steps + 2) * (k + 1) + block  # room to spare: no timed step is cut
    prof = None
    for attempt in range(3 if profile else 2):  # warm-up, timed run, profiled run
        rounds = speculative_generate(wrapped, prompt, block_size=block, max_new_tokens=budget)
        tokens = list(next(rounds).tokens)  # prefill + first token
        tokens += next(rounds).tokens  # the first step (its draft reads the whole prompt)
        sync(be.device)
        if attempt == 2:
            prof = _profiler(be.device)
            prof.__enter__()
        t = time.perf_counter()
        accepted = []
        for r in rounds:  # exactly `steps` full-width verify steps
            accepted.append(r.accepted)
            tokens += r.tokens
            if len(accepted) == steps:
                break
        dt = time.perf_counter() - t  # the last read waited for that step's tokens
        if prof is not None:
            sync(be.device)
            prof.__exit__(None, None, None)
        rounds.close()
        if attempt == 1:
            result = {"block_size": block, "k": k, "steps": len(accepted),
                      "ms_per_step": 1000 * dt / max(len(accepted), 1),
                      "tau": sum(accepted) / max(len(accepted), 1), "tok_per_s": sum(accepted) / dt,
                      "diverged_at": first_difference(tokens, truth.tolist())}  # fmt: skip
    if prof is not None:
        result.update(kernel_summary(prof, len(accepted), be.device.type == "cuda"))
    return result


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` differs from ``b`` (over a's length), or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b[: len(a)], strict=False)) if x != y), None)


def _profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=acts)


def kernel_summary(prof, steps: int, cuda: bool) -> dict:
    """Device-busy ms per step (CUDA kernels, copies, memsets; on CPU top-level aten ops) and the
    16 kernels with the most device time per step [name, calls per step, us per step]."""
    from scripts.kernel_count import kernel_table

    count, rows = kernel_table(prof, cuda, width=240)
    busy = sum(r[2] for r in rows)
    out = {"busy_ms_per_step": busy / 1000 / max(steps, 1), "kernels_per_step": count / max(steps, 1),
           "top_kernels": [[n, round(c / steps, 2), round(t / steps, 1)] for n, c, t in rows[:16]]}  # fmt: skip
    if cuda and os.environ.get("BENCH_BIG_SEQUENCE") == "1":  # every kernel of the last profiled step, in order
        ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
        n = len(ev) // max(steps, 1)
        out["sequence"] = [[e.name[:80], round(e.time_range.start - ev[-n].time_range.start, 1),
                            round(e.time_range.elapsed_us(), 1)] for e in ev[-n:]]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="miniature model on the CPU (tests)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_big_out"))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32, help="verify steps timed per setting")
    ap.add_argument("--blocks", default="1,4,8,16")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--arch", choices=("qwen3", "llama"), default="qwen3",
                    help="the target's architecture at those dims: qwen3 (q/k norms) or llama (none)")  # fmt: skip
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="default bfloat16 (float32 with --tiny)")  # fmt: skip
    ap.add_argument("--device-loop", action=argparse.BooleanOptionalAction, default=True,
                    help="greedy steps through the device loop (static_loop)")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="kernels per step (torch.profiler)")
    ap.add_argument("--init-std", type=float, default=None,
                    help="target weight init std (default 0.002; 0.3 with --tiny)")  # fmt: skip
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = getattr(torch, args.dtype or ("float32" if args.tiny else "bfloat16"))
    blocks = [int(b) for b in args.blocks.split(",")]
    init_std = args.init_std if args.init_std is not None else (None if args.tiny else 0.002)
    t0 = time.perf_counter()
    be = build(args.tiny, device, dtype, args.compile and device.type == "cuda", tuple(blocks),
               args.shape, args.device_loop, init_std, args.arch)  # fmt: skip
    built_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, be.vocab_size - 1, (args.prompt_len,), generator=g).tolist()
    # greedy truth (block 1, same kernels) long enough for the longest scripted run
    from dflash.loop import speculative_generate

    n_truth = 17 + (args.steps + 2) * max(blocks)  # + a full draft block past the last anchor
    script = None
    if be.device_loop is not None:  # before any capture: the draft graph reads it
        script = ScriptedLoop(be.device_loop, n_truth + 64, len(prompt))
    truth_ids = [t for r in speculative_generate(be, prompt, block_size=1, max_new_tokens=n_truth)
                 for t in r.tokens]  # fmt: skip
    truth = torch.tensor(truth_ids, device=device)
    if script is not None:
        script.truth[: len(truth_ids)].copy_(truth)
    # HBM floor: weights read once per forward (embedding rows aside) plus the filled K/V
    tgt = param_bytes(be.target, skip=("model.embed_tokens",))
    drf = param_bytes(be.draft_model) + be.lm_head.weight.numel() * be.lm_head.weight.element_size()
    c = be.target.config
    attn_layers = sum(k is not None for k in be.k)  # layers with K/V (a hybrid's full-attention ones)
    kv_per_pos = 2 * attn_layers * c.num_key_value_heads * be.head_dim * be.dtype.itemsize
    kv = kv_per_pos * (args.prompt_len + args.steps * max(blocks) // 2)
    # a hybrid's GatedDeltaNet states: the committed one read and one slot written per step at least
    kv += 2 * be.gdn.states[:, 0].numel() * 4 if be.gdn is not None else 0
    bw = copy_bandwidth(device, 1 << (22 if args.tiny else 32))
    desc = be.describe()
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": str(dtype).split(".")[-1], "tiny": args.tiny, "compile": be.compile,
              "cuda_graphs": be.use_graphs, "device_loop": be.device_loop is not None,
              "queue_ahead": be.device_loop.ahead if be.device_loop is not None else None,
              "attention": be.attention, "attn_split": desc.get("attn_split"), "attn_one_slice": desc.get("attn_one_slice"),
              "attn_block": desc.get("attn_block"), "attn_early": desc.get("attn_early"),
              "linear": be.linear, "linear_in": desc.get("linear_in"), "glu": desc.get("glu"), "norm_kernel": desc.get("norm_kernel"),
              "fuse_norm": desc.get("fuse_norm"), "compile_glue": be.settings.compile_glue,
              "pdl": be.settings.pdl, "pdl_on": be.launch["target"].pdl, "kernel_settings": be.settings.record(),
              "truth_sha1": hashlib.sha1(str(truth_ids).encode()).hexdigest(),  # same across variants
              "shape": "tiny" if args.tiny else args.shape, "arch": args.arch, "init_std": init_std, "prompt_len": args.prompt_len, "build_s": built_s,
              "target_bytes": tgt, "draft_step_bytes": drf, "kv_bytes": kv,
              "copy_bandwidth_GBps": bw / 1e9, "results": []}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = report["results"]
    for block in blocks:
        for k in sorted({0, block - 1}):
            r = run(be, prompt, truth, block, k, args.steps, script, args.profile)
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
