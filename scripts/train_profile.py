"""Per-phase timing of ``dflash train`` steps through the real Trainer code path (issues 11/12).

    python scripts/train_profile.py --target T.gguf --data data/ --draft draft/ --out prof.json

Runs ``--steps`` optimizer steps (Trainer._batch + Trainer._guarded_step, as ``dflash train``
does; bf16 autocast and FlexAttention on CUDA) at the real settings (--batch-tokens 16384,
--anchors 512, --max-len 1024, --block-size 16), then ``--profile-steps`` more under
torch.profiler. The JSON holds, as medians over the steps after ``--warmup``: device ms per
phase (torch.cuda.Event pairs around the target features, mask building, draft forward, head
cross-entropy, backward and optimizer; on CPU wall ms), host ms of batch building, device and
wall ms per step; the batch shapes, the steps that compiled (torch._dynamo counters) and the top
25 ops by self device time. Runs on CPU too (``--device cpu``) with a tiny model, as a smoke run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("target_features", "masks", "draft_forward", "head_ce", "backward", "optimizer")


class PhaseClock:
    """Start/stop marks per phase: CUDA events (no sync) on CUDA, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: dict[str, list] = {p: [] for p in PHASES + ("step_device",)}
        self.active = True

    @contextmanager
    def phase(self, name: str):
        if not self.active:
            yield
            return
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            try:
                yield
            finally:
                b.record()
                self.marks[name].append((a, b))
        else:
            t = time.perf_counter()
            try:
                yield
            finally:
                self.marks[name].append((t, time.perf_counter()))

    def take(self) -> dict[str, float]:
        """Milliseconds of this step's marks per phase (sums repeated phases); clears them."""
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for name, pairs in self.marks.items():
            if self.cuda:
                out[name] = sum(a.elapsed_time(b) for a, b in pairs)
            else:
                out[name] = sum((b - a) * 1e3 for a, b in pairs)
            pairs.clear()
        return out


def instrument(trainer, clock: PhaseClock) -> None:
    """Wrap the functions the real step calls with phase marks (no copy of the step)."""
    import dflash.train.objective as obj

    def wrap(fn, name):
        def timed(*a, **kw):
            with clock.phase(name):
                return fn(*a, **kw)

        return timed

    trainer.target.features = wrap(trainer.target.features, "target_features")
    obj.layer_masks = wrap(obj.layer_masks, "masks")
    obj.head_cross_entropy = wrap(obj.head_cross_entropy, "head_ce")
    trainer.runner = wrap(trainer.runner, "draft_forward")
    backward = torch.Tensor.backward

    def timed_backward(self, *a, **kw):
        with clock.phase("backward"):
            return backward(self, *a, **kw)

    torch.Tensor.backward = timed_backward
    clip = torch.nn.utils.clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = wrap(clip, "optimizer")
    trainer.opt.step = wrap(trainer.opt.step, "optimizer")


def compile_count() -> int:
    """Graphs dynamo compiled so far (a new one after the warm-up is a recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def top_ops(prof, device: torch.device, steps: int, n: int = 25) -> list[dict]:
    """The n ops with the most self device time (CPU: self CPU time); ms per step."""

    def dev_self(e):
        for key in ("self_device_time_total", "self_cuda_time_total"):
            if hasattr(e, key):
                return getattr(e, key)
        return 0.0

    rows = list(prof.key_averages())
    key = dev_self if device.type == "cuda" else (lambda e: e.self_cpu_time_total)
    rows.sort(key=key, reverse=True)
    per = 1e3 * max(1, steps)
    return [{"op": e.key, "self_ms_per_step": round(key(e) / per, 3), "calls_per_step": e.count / max(1, steps),
             "cpu_total_ms_per_step": round(e.cpu_time_total / per, 3)} for e in rows[:n]]  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help=".gguf, model folder or hub id")
    ap.add_argument("--data", required=True, help="regenerated training data folder")
    ap.add_argument("--draft", required=True, help="draft folder to start from (--init)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from dflash.train.train import TrainConfig, Trainer, load_training_target

    model, _ = load_training_target(args.target, args.device)
    tmp = tempfile.mkdtemp(prefix="train-profile-")
    cfg = TrainConfig(target=args.target, data=args.data, out=tmp, init=args.draft,
                      block_size=args.block_size, anchors=args.anchors, max_len=args.max_len,
                      batch_tokens=args.batch_tokens, epochs=1, seed=args.seed,
                      eval_every=10**9, save_every=10**9, log_every=10**9)  # fmt: skip
    events: list[dict] = []  # trainer warnings (e.g. a flex failure that falls back to dense)
    trainer = Trainer(cfg, model, on_log=events.append)
    dev = trainer.device
    clock = PhaseClock(dev)
    instrument(trainer, clock)
    batches = [(e, b) for e, eb in enumerate(trainer.epoch_batches) for b in eb]
    total = args.steps + args.profile_steps
    if len(batches) < total:
        batches = (batches * (total // max(1, len(batches)) + 1))[:total]

    def one_step(i: int) -> dict:
        epoch, idx = batches[i]
        t0 = time.perf_counter()
        batch = trainer._batch(idx, epoch)
        host = (time.perf_counter() - t0) * 1e3
        graphs = compile_count()
        with clock.phase("step_device"):
            out = trainer._guarded_step(batch, cfg.lr)
        loss = float(out.loss.detach())  # sync: the step is done
        wall = (time.perf_counter() - t0) * 1e3
        ms = clock.take()
        b, s = batch["input_ids"].shape
        return {"step": i, "host_batch_ms": host, "wall_ms": wall, **ms, "loss": loss,
                "B": b, "S": s, "N": batch["anchors"].shape[1], "tokens": sum(trainer.lengths[j] for j in idx),
                "compiled": compile_count() - graphs}  # fmt: skip

    recs = [one_step(i) for i in range(args.steps)]
    steady = recs[args.warmup :] or recs

    def med(key):
        return round(statistics.median(r[key] for r in steady), 3)

    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__,
           "flex": trainer.flex, "settings": {k: getattr(args, k) for k in
                                              ("batch_tokens", "anchors", "max_len", "block_size", "steps", "warmup")},
           "median_ms": {**{p: med(p) for p in PHASES}, "host_batch": med("host_batch_ms"),
                         "step_device": med("step_device"), "step_wall": med("wall_ms")},
           "tokens_per_s": round(sum(r["tokens"] for r in steady) / (sum(r["wall_ms"] for r in steady) / 1e3), 1),
           "compiles": [{k: r[k] for k in ("step", "B", "S", "N", "compiled", "wall_ms")}
                        for r in recs if r["compiled"]],
           "steps": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in recs]}  # fmt: skip
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    clock.active = False
    with profile(activities=acts) as prof:
        for i in range(args.steps, total):
            one_step(i)
    res["top_ops"] = top_ops(prof, dev, args.profile_steps)
    res["profile_steps"] = args.profile_steps
    res["trainer_events"] = events
    res["flex_at_end"] = trainer.flex
    try:
        from torch._dynamo.utils import counters

        res["dynamo_counters"] = {k: dict(v) for k, v in counters.items() if v}
    except Exception as e:  # noqa: BLE001 - diagnostics only
        res["dynamo_counters"] = str(e)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("device", "flex", "median_ms", "tokens_per_s", "compiles")},
                     indent=1))  # fmt: skip
    return res


if __name__ == "__main__":
    main()
