"""Kernels per forward and replay times of the static path, with and without this project's kernels.

    PYTHONPATH=. python3 scripts/kernel_count.py --model /tmp/smollm2.gguf \
        --draft dflash/assets/smollm2-135m-instruct-dflash --out $OUT/kernels.json
    PYTHONPATH=. python3 scripts/kernel_count.py --tiny --out /tmp/k.json   # CPU, random tiny pair

For each variant - auto (the default settings), off (``--kernels off``: torch ops in the
graphs), autotune (the default kernels, ``torch.compile`` mode max-autotune-no-cudagraphs) - one
StaticBackend is built on the same target, its graphs are captured (CUDA; with ``--compile`` the forwards are
compiled first), a prompt is prefilled, then verify-1, verify-16 and draft-16 are each:
timed over ``--iters`` replays (CUDA events, plus the host time of the launches; on CPU the
eager forward, wall clock) and profiled
once with torch.profiler (``kernels``: CUDA kernel/memcpy/memset events of one replay, ``top``:
the kernels with the most device time, e.g. to see what attention over the whole allocated
KV capacity costs; on CPU aten ops of one eager call; ``--sequence``: every kernel in launch
order). With the device loop on CUDA also its own graphs (``dverify-1``, ``dverify-16``,
``ddraft-16``), a step's two replays and a whole loop step (see :func:`loop_calls`).
JSON to ``--out``; a table on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # dflash from this checkout, as bench_big.py

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
               tie_word_embeddings=True, rope_theta=100000.0)  # fmt: skip
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            tie_word_embeddings=True)  # fmt: skip


def load_pair(args, device: torch.device, dtype: torch.dtype):
    """(target, draft) from --model/--draft, a random tiny Llama pair with --tiny, or with
    --random-target a random target of the demo target's shape (SmolLM2-135M: same kernels and
    times as the real weights) with the --draft (default: the shipped demo draft)."""
    if args.random_target:
        from transformers import LlamaConfig, LlamaForCausalLM

        from dflash.backends.plain import load_draft
        from dflash.models.target_torch import resolve_draft

        torch.manual_seed(0)
        target = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(device, dtype).eval()
        return target, load_draft(resolve_draft(args.draft, None), device, dtype)
    if args.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        from dflash.models.draft_torch import DFlashDraft
        from dflash.models.init_draft import draft_config_for

        torch.manual_seed(0)
        cfg = LlamaConfig(**TINY)
        target = LlamaForCausalLM(cfg).to(device, dtype).eval()
        dcfg = draft_config_for(cfg, layers=2, block_size=16, mask_token_id=cfg.vocab_size - 1,
                                vocab_rows=cfg.vocab_size)  # fmt: skip
        return target, DFlashDraft(dcfg).to(device, dtype).eval()
    from dflash.backends.plain import load_draft, load_target
    from dflash.models.target_torch import resolve_draft, resolve_target

    target, _ = load_target(resolve_target(args.model), device, dtype)
    return target, load_draft(resolve_draft(args.draft, args.model), device, dtype)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calls(be, prompt_len: int, length: int) -> dict:
    """name -> zero-argument callable running that forward once (a graph replay on CUDA)."""
    out = {}
    for kind, width in (("verify", 1), ("verify", length), ("draft", length)):
        name = f"{kind}-{width}"
        if kind == "verify":
            inputs = (torch.zeros(1, width, dtype=torch.long, device=be.device),
                      be.key_pos[prompt_len : prompt_len + width][None].clone())  # fmt: skip
        else:
            inputs = (torch.full((1, width), be.mask_token_id, dtype=torch.long, device=be.device),
                      be.key_pos[prompt_len : prompt_len + 1].clone(),
                      be.key_pos[prompt_len - be.draft_block_size : prompt_len].clone())  # fmt: skip
        if be.use_graphs:
            graph, _, static = (be._verify_graph if kind == "verify" else be._draft_graph)(width)
            for dst, src in zip(static, inputs, strict=True):
                dst.copy_(src)
            direct = be._fn(kind)

            def replay(graph=graph, direct=direct, static=static, graphed=True):
                if graphed:
                    graph.replay()
                else:  # the captured (compiled) function called outside the graph
                    with torch.inference_mode():
                        direct(*static)

            out[name] = replay
        else:
            fn = be._target_forward if kind == "verify" else be._draft_forward

            def run(fn=fn, inputs=inputs):
                with torch.inference_mode():
                    fn(*inputs)

            out[name] = run
    if be.use_graphs and be.device_loop is not None:
        out.update(loop_calls(be, prompt_len, length))
    return out


def loop_calls(be, prompt_len: int, length: int) -> dict:
    """The device loop's graphs (with their glue) as the greedy loop replays them, state held
    at ``prompt_len`` with no budget (nothing moves, every call computes the same): each graph
    alone (``dverify-1``, ``dverify-L``, ``ddraft-L``), a step's two replays back to back
    (``step-L``) and a whole loop step with the whole next step queued ahead, as
    :func:`dflash.loop.speculative_generate` runs block 1 and the ``queue_ahead`` setting ``step``
    (``loop-L``/``loop-1``: launch, copy to pinned memory, then wait for the step before; their
    ``host_us`` includes that wait, so it is about the device time, not the launch cost), and
    with only the next draft queued ahead, the default at block L (``loopd-L``: wait for the
    step before, then queue its successor's verify and the draft after it)."""
    lp = be.device_loop
    lp.begin(torch.zeros(1, dtype=torch.long, device=be.device), prompt_len, length, 0)
    out: dict = {}
    for kind, width in (("dverify", 1), ("dverify", length), ("ddraft", length)):
        graph = be._device_graph(kind, width)[0]
        out[f"{kind}-{width}"] = lambda graphed=True, g=graph: g.replay()
    g_draft, g_verify = be._device_graph("ddraft", length)[0], be._device_graph("dverify", length)[0]

    def step(graphed=True):
        g_draft.replay()
        g_verify.replay()

    out[f"step-{length}"] = step
    for block in (length, 1):
        prev: list = []

        def loop(graphed=True, block=block, prev=prev):
            slot = lp.launch(block)
            if prev:
                lp.read(prev.pop())
            prev.append(slot)

        out[f"loop-{block}"] = loop
    ahead: list = []

    def loop_draft_ahead(graphed=True, prev=ahead):
        if not prev:  # the first call: a whole step, then the next step's draft queued ahead
            prev.append(lp.launch(length))
            lp.launch_draft()
            return
        lp.read(prev.pop())
        prev.append(lp.launch_verify(length))
        lp.launch_draft()

    out[f"loopd-{length}"] = loop_draft_ahead
    return out


def count_kernels(fn, device: torch.device, sequence: bool = False) -> tuple[int, list, list | None]:
    """Kernels (CUDA kernel/memcpy/memset events) of one call, the 12 kernel names with the
    most device time [name, count, total us] (on CPU top-level aten ops, times: CPU us), and
    with ``sequence`` every event of the call in launch order [name, us] (where to fuse)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    count, rows = kernel_table(prof, device.type == "cuda")
    seq = kernel_sequence(prof, device.type == "cuda") if sequence else None
    return count, [[n, c, round(t, 1)] for n, c, t in rows[:12]], seq


def kernel_sequence(prof, cuda: bool, width: int = 90) -> list[list]:
    """The events :func:`kernel_table` groups, one by one in start order: [name, us]."""
    events = [e for e in prof.events() if (e.device_type == torch.autograd.DeviceType.CUDA if cuda
              else e.name.startswith("aten::") and e.cpu_parent is None)]  # fmt: skip
    events.sort(key=lambda e: e.time_range.start)
    return [[e.name[:width], round(e.time_range.elapsed_us(), 1)] for e in events]


def kernel_table(prof, cuda: bool, width: int = 120) -> tuple[int, list[list]]:
    """Events of a finished torch.profiler run (CUDA kernels/copies/memsets, or on CPU top-level
    aten ops) grouped by name: (event count, [name, calls, total us] by total time, descending)."""
    if cuda:
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        events = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    by_name: dict[str, list] = {}
    for e in events:
        row = by_name.setdefault(e.name[:width], [e.name[:width], 0, 0.0])
        row[1] += 1
        row[2] += e.time_range.elapsed_us()
    return len(events), sorted(by_name.values(), key=lambda r: -r[2])


def measure(fn, device: torch.device, iters: int, sequence: bool = False) -> dict:
    """ms per call (median of 5 batches of iters/5) and kernels of one call (profiler); on
    CUDA also ``kernels_direct``: the captured function run outside its graph (a cross-check
    in case the profiler does not see kernels inside graph replays)."""
    for _ in range(3):
        fn()
    sync(device)
    per, host = [], []
    for _ in range(5):
        n = max(1, iters // 5)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            host.append((time.perf_counter() - t0) * 1e6 / n)
            end.record()
            sync(device)
            per.append(start.elapsed_time(end) / n)
        else:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            per.append((time.perf_counter() - t0) * 1000 / n)
    kernels, top, seq = count_kernels(fn, device, sequence)
    out = {"ms": sorted(per)[2], "kernels": kernels, "top": top}
    if seq is not None:
        out["sequence"] = seq
    if host:  # host time of the launches alone (us per call): above the device time = host-bound
        out["host_us"] = round(sorted(host)[2], 1)
    if device.type == "cuda":
        fn(graphed=False)  # warm (no compilation: the same compiled code as the capture)
        out["kernels_direct"], out["top_direct"], _ = count_kernels(lambda: fn(graphed=False), device)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target (.gguf, folder or hub id; default: demo)")
    ap.add_argument("--draft", default=None, help="draft folder (default: the demo draft)")
    ap.add_argument("--tiny", action="store_true", help="random tiny pair (CPU check)")
    ap.add_argument("--random-target", action="store_true",
                    help="random target of the demo target's shape (no target file needed)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default="kernel_count.json")
    ap.add_argument("--variants", default="auto,off",
                    help="auto (default settings), off (--kernels off), "
                         "autotune (default kernels, compile mode max-autotune-no-cudagraphs)")
    ap.add_argument("--sequence", action="store_true",
                    help="store every kernel of each profiled call in launch order (name, us)")
    args = ap.parse_args(argv)
    from dflash.backends.static.backend import StaticBackend
    from dflash.kernels.settings import KernelSettings

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    target, draft = load_pair(args, device, dtype)
    prompt = torch.randint(0, 200, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "dtype": str(dtype), "compile": args.compile, "prompt_len": args.prompt_len,
                    "torch": torch.__version__, "runs": {}}  # fmt: skip
    variants = {"auto": KernelSettings(), "off": KernelSettings().without_kernels(),
                "autotune": dataclasses.replace(KernelSettings(), compile_mode="max-autotune-no-cudagraphs")}
    for name in args.variants.split(","):
        t0 = time.perf_counter()
        be = StaticBackend(target, draft, device, use_graphs=device.type == "cuda",
                           compile=args.compile, settings=variants[name])  # fmt: skip
        be.reset(args.prompt_len + 64)  # captures (and compiles) the graphs
        sync(device)
        setup_s = time.perf_counter() - t0
        with torch.inference_mode():
            be.prefill(prompt, True)
        run = {"setup_s": round(setup_s, 1), "compiled": be.compile}
        for label, fn in calls(be, args.prompt_len, be.draft_block_size).items():
            run[label] = measure(fn, device, args.iters, args.sequence)
            print(f"{name:8s} {label:10s} {run[label]['ms']:8.3f} ms  {run[label]['kernels']:5d} kernels"
                  f"  host {run[label].get('host_us', 0):7.1f} us",
                  flush=True)  # fmt: skip
        result["runs"][name] = run
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))  # after each variant
        del be
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


if __name__ == "__main__":
    main()
