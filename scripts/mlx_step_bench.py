"""Per-step cost of DFlash on mlx against one mlx-lm decode step, on random 4-bit targets of
8B-class shapes; prints one JSON object.

What is timed (random weights: the draft's proposals are rejected, so every step verifies the
full block and commits one token; the step cost is what the figures are about, not τ):

- ``mlx_lm_step_ms``: one decode step of ``mlx_lm.generate.generate_step`` (its own pipelined
  loop, greedy), context ``--context`` tokens;
- ``dflash_step_ms``: one step of :func:`dflash.loop.speculative_generate` at block size L
  (block-L verify + draft, the pipelined device loop), same target and context;
  ``dflash_step_host_loop_ms``: the same through the host loop (the ``device_loop`` setting off);
- ``ratio``: dflash_step_ms / mlx_lm_step_ms (the goal on a GPU: <= 2.0 at L = 16);
- pieces, synchronised one at a time: ``verify_ms`` (target forward of L rows + trim),
  ``decode1_ms`` (target forward of 1 row), ``draft_ms`` per draft quantization (none, 8, 4 bits).

Shapes (``--shape``): ``qwen3-8b`` (36 layers, hidden 4096, GQA 32/8, vocab 151936),
``qwen3.5-9b`` (hybrid: 3 GatedDeltaNet layers per attention layer, hidden 4096, vocab 248320;
the layout of Qwen3.5's mlx-lm module, sizes approximated), ``tiny`` (hidden 64, for tests and
CPU; ``tiny-hybrid`` the same as a qwen3_5 hybrid). Targets are built in bfloat16 and quantized to 4 bits (group 64), as mlx-community's 4-bit
models; the draft (``--draft-layers``, default 5) is bfloat16 unless quantized.

Usage::

    python scripts/mlx_step_bench.py --shape qwen3-8b --context 512 --steps 64
    python scripts/mlx_step_bench.py --shape tiny --steps 8        # CPU smoke run
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash.mlx_process import keep_torch_out  # noqa: E402

keep_torch_out()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

_COMMON = {"rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "rope_theta": 1000000.0}
_HYBRID = {"linear_num_value_heads": 32, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
           "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4}  # fmt: skip
SHAPES = {
    "qwen3-8b": {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False, **_COMMON},
    "qwen3.5-9b": {"model_type": "qwen3_5", "tie_word_embeddings": False,
                   "text_config": {"model_type": "qwen3_5_text", "hidden_size": 4096,
                                   "intermediate_size": 12288, "num_hidden_layers": 32,
                                   "num_attention_heads": 16, "num_key_value_heads": 4,
                                   "head_dim": 256, "vocab_size": 248320, **_HYBRID, **_COMMON,
                                   "tie_word_embeddings": False,
                                   "rope_parameters": {"type": "default", "rope_theta": 1e7,
                                                       "partial_rotary_factor": 0.25}}},
    "tiny": {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "vocab_size": 1024, "tie_word_embeddings": True, **_COMMON},
    "tiny-hybrid": {"model_type": "qwen3_5", "tie_word_embeddings": True,
                    "text_config": {"model_type": "qwen3_5_text", "hidden_size": 64,
                                    "intermediate_size": 128, "num_hidden_layers": 4,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                    "vocab_size": 1024, **_COMMON, "linear_num_value_heads": 4,
                                    "linear_num_key_heads": 2, "linear_key_head_dim": 32,
                                    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                                    "full_attention_interval": 4, "tie_word_embeddings": True,
                                    "rope_parameters": {"type": "default", "rope_theta": 1e6,
                                                        "partial_rotary_factor": 0.5}}},
}  # fmt: skip


def quantizable(_path: str, m: nn.Module) -> bool:
    """Linear and embedding layers whose input width is a multiple of the group size."""
    return hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0


def build_target(cfg: dict, bits: int | None) -> nn.Module:
    """A random mlx-lm model of ``cfg`` in bfloat16, quantized to ``bits`` (group 64)."""
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(json.loads(json.dumps(cfg))))
    model.set_dtype(mx.bfloat16)
    if bits:
        nn.quantize(model, group_size=64, bits=bits, class_predicate=quantizable)
    mx.eval(model.parameters())
    return model


def build_draft(cfg: dict, layers: int, block: int, bits: int | None):
    from dflash.models.draft_mlx import random_draft_mlx
    from dflash.models.init_draft import draft_config_for

    text = SimpleNamespace(**{**cfg, **cfg.get("text_config", {})})
    dcfg = draft_config_for(text, layers=layers, block_size=block, mask_token_id=0,
                            vocab_rows=text.vocab_size)  # fmt: skip
    draft = random_draft_mlx(dcfg)
    draft.set_dtype(mx.bfloat16)
    if bits:
        nn.quantize(draft, group_size=64, bits=bits, class_predicate=quantizable)
    mx.eval(draft.parameters())
    return draft


def ms(samples: list[float]) -> float:
    return round(1e3 * statistics.median(samples), 3)


def time_mlx_lm(model, prompt: list[int], steps: int) -> float:
    """Seconds per decode step of mlx-lm's generate_step (after the first token)."""
    from mlx_lm.generate import generate_step

    mx.synchronize()
    t1 = None
    for i, _ in enumerate(generate_step(mx.array(prompt), model, max_tokens=steps + 1)):
        if i == 0:
            t1 = time.perf_counter()
    return (time.perf_counter() - t1) / steps


def time_dflash(be, prompt: list[int], block: int, steps: int) -> tuple[float, int, int]:
    """(seconds per verify step, steps, tokens) of speculative_generate at block size ``block``."""
    from dflash.loop import speculative_generate

    mx.synchronize()
    t1, n, k = None, 0, 0
    for r in speculative_generate(be, prompt, block_size=block, max_new_tokens=steps + 1):
        if r.accepted is None:
            t1 = time.perf_counter()
        else:
            n, k = n + 1, k + len(r.tokens)
        if n >= steps:
            break
    return (time.perf_counter() - t1) / max(n, 1), n, k


def pieces(be, prompt: list[int], block: int, reps: int) -> dict:
    """Verify of L rows (+ trim) and a 1-row forward, each synchronised."""
    be.reset()
    logits, _ = be.prefill(prompt, True)
    mx.eval(logits)
    ids = mx.array(prompt[:block], dtype=mx.int32)
    out = {"verify_ms": [], "decode1_ms": []}
    for _ in range(reps):
        start = be.length
        t = time.perf_counter()
        lg, f = be.verify(int(ids[0]), ids[1:block], start, True)
        mx.eval(lg, f)
        be.rollback(start + 1)
        out["verify_ms"].append(time.perf_counter() - t)
        t = time.perf_counter()
        lg, _ = be.verify(int(ids[0]), None, be.length, False)
        mx.eval(lg)
        out["decode1_ms"].append(time.perf_counter() - t)
    return {k: ms(v) for k, v in out.items()}


def draft_time(be, prompt: list[int], block: int, reps: int) -> float:
    """One pipelined-draft call (block L, context = L verify rows of which 1 is kept), synced."""
    be.reset()
    _, feats = be.prefill(prompt, True)
    be.draft(int(prompt[-1]), feats, len(prompt), block, rows=block - 1)[0].tolist()  # context in
    rows = feats[-block:]
    tok = mx.array([int(prompt[-1])], dtype=mx.int32)
    samples, pos = [], len(prompt)
    for _ in range(reps):
        t = time.perf_counter()
        props = be.draft_ahead(tok, rows, pos, mx.array(1, dtype=mx.int32), block, block - 1)
        mx.eval(props)
        samples.append(time.perf_counter() - t)
        be.draft_cache.drop_tail(block - 1)
        pos += 1
    return ms(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--bits", type=int, default=4, help="target quantization (0 = bfloat16)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens before the steps")
    ap.add_argument("--steps", type=int, default=64, help="decode / verify steps timed")
    ap.add_argument("--reps", type=int, default=20, help="repetitions of each piece")
    ap.add_argument(
        "--layers", type=int, default=None, help="override the target's depth (smoke runs)"
    )
    ap.add_argument("--device", default="auto", choices=("auto", "gpu", "cpu"))
    args = ap.parse_args()
    if args.device != "auto":
        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    from dflash.backends.mlx import MLXBackend

    cfg = json.loads(json.dumps(SHAPES[args.shape]))
    if args.layers:
        (cfg.get("text_config") or cfg)["num_hidden_layers"] = args.layers
    text = {**cfg, **cfg.get("text_config", {})}
    vocab = int(text["vocab_size"])
    prompt = [
        int(i) for i in mx.random.randint(0, vocab, (args.context,), key=mx.random.key(0)).tolist()
    ]
    target = build_target(cfg, args.bits or None)
    steps, block = args.steps, args.block_size
    result = {"shape": args.shape, "target_bits": args.bits or None, "block_size": block,
              "context": args.context, "steps": steps, "device": str(mx.default_device()),
              "mlx": mx.__version__, "config": text}  # fmt: skip
    try:
        import mlx_lm

        result["mlx_lm"] = mlx_lm.__version__
    except AttributeError:
        pass
    time_mlx_lm(target, prompt[:64], 8)  # warm-up
    draft = build_draft(cfg, args.draft_layers, block, None)
    be = MLXBackend(target, draft)
    time_dflash(be, prompt[:64], block, 4)  # warm-up (compiles the acceptance)
    rounds = {"mlx_lm": [], "dflash": [], "dflash_host_loop": []}
    for _ in range(2):  # interleaved
        rounds["mlx_lm"].append(time_mlx_lm(target, prompt, steps))
        sec, n, k = time_dflash(be, prompt, block, steps)
        rounds["dflash"].append(sec)
        loop, be.device_loop = be.device_loop, None
        try:
            rounds["dflash_host_loop"].append(time_dflash(be, prompt, block, steps)[0])
        finally:
            be.device_loop = loop
    result |= {f"{k}_step_ms": ms(v) for k, v in rounds.items()}
    result["dflash_steps"], result["dflash_tokens"] = n, k
    result["ratio"] = round(result["dflash_step_ms"] / result["mlx_lm_step_ms"], 3)
    result["ratio_host_loop"] = round(
        result["dflash_host_loop_step_ms"] / result["mlx_lm_step_ms"], 3
    )
    result |= pieces(be, prompt, block, args.reps)
    result["draft_ms"] = {"none": draft_time(be, prompt, block, args.reps)}
    for bits in (8, 4):
        qbe = MLXBackend(
            target, build_draft(cfg, args.draft_layers, block, bits), device_loop=False
        )
        result["draft_ms"][str(bits)] = draft_time(qbe, prompt, block, args.reps)
    result["peak_memory_gb"] = round(mx.get_peak_memory() / 2**30, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
