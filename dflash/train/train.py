"""The ``dflash train`` loop: data, schedule, optimisation, held-out τ, checkpoints and resume.

    dflash train --target M --data data/ --out my-draft/ --epochs 6

Recipe (paper §4.2/§5, brief §8): AdamW lr 6e-4, cosine schedule with 4% warmup, gradient clip
1.0, bf16 autocast on CUDA, random anchors re-sampled every epoch. ``out/`` always holds the
latest draft in the loader's format; ``out/state/`` (or ``--state-dir``) holds the float32
weights, the optimizer moments and the cursor for an exact resume. Under torchrun the run is
data-parallel (``dflash.train.distributed``).

The run settings, the schedule and the fresh draft live in :mod:`dflash.train.config`
(re-exported here).
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dflash.bench.distributed import DistInfo
from dflash.errors import DatasetError, InputError
from dflash.train import distributed as ddp
from dflash.train.checkpoint import _weights_only, load_state, save_state, write_acceptance
from dflash.train.config import (  # noqa: F401 - re-exported
    DATA_KEYS,
    RESUME_KEYS,
    TrainConfig,
    _fresh_draft,
    _where,
    config_dict,
    lr_at,
)
from dflash.train.data import collate, make_batches, prepare, read_shards
from dflash.train.masks import FLEX_TILE, round_up, sample_anchors
from dflash.train.objective import FrozenTarget, batch_loss, estimate_acceptance, supervised_rows

# ----------------------------------------------------------------------------- the loop


class Trainer:
    """Holds the models, data and optimizer of one run; :meth:`run` trains to the end.

    Args:
        cfg: the run settings.
        target_model: a loaded HF causal LM on the training device (frozen here).
        on_log: callback(record dict) for every log/eval record (progress bar, files).
        dist: rank and world size of a data-parallel run (process group already initialised;
            see ``dflash.train.distributed``); None: one process.
    """

    def __init__(
        self, cfg: TrainConfig, target_model, on_log: Callable[[dict], None] | None = None,
        dist: DistInfo | None = None,
    ):  # fmt: skip
        cfg.check()
        self.cfg, self.on_log = cfg, on_log or (lambda r: None)
        self.dist = dist or DistInfo()
        self.device = next(target_model.parameters()).device
        self.out = Path(cfg.out)
        self.state_dir = Path(cfg.state_dir) if cfg.state_dir else self.out / "state"
        emb = target_model.get_input_embeddings() if hasattr(target_model, "get_input_embeddings") else None
        self._target_vocab = getattr(emb, "num_embeddings", None)
        self.seqs, self.eval_sets = self._load_data()
        self.eval_seqs = [sq for _, group in self.eval_sets for sq in group]
        resume = (self.state_dir / "trainer_state.json").is_file()
        from dflash.models.draft_load import load_draft

        self.base_step, prior_log = 0, []
        if cfg.resume_from and not resume:
            draft, self.base_step, prior_log = _weights_only(cfg)
        elif resume:
            draft = load_draft(self.state_dir / "draft", dtype=torch.float32)
            if cfg.arch is not None and cfg.arch != ("dflash2" if getattr(draft, "is_dflash2", False) else "dflash"):
                raise InputError(f"{self.state_dir} holds a run of another architecture than --arch {cfg.arch}.",
                                 hint="drop --arch to resume it, or use another --out")  # fmt: skip
        else:
            draft = _fresh_draft(cfg, self.state_dir)
        self._check_pair(draft, target_model)
        self.draft = draft.to(self.device).train()
        self.target = FrozenTarget(target_model, draft.config.target_layer_ids)
        self.pad_id = int(draft.config.mask_token_id)  # never attended, never a label
        fused = self.device.type == "cuda"
        self.opt = torch.optim.AdamW(self.draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                     weight_decay=cfg.weight_decay, fused=fused)  # fmt: skip
        # a resumed segment draws a new order and anchors; global batches hold W x batch_tokens
        self.order_seed = cfg.seed + self.base_step
        world = self.dist.world
        self.epoch_batches = [make_batches(self.lengths, cfg.batch_tokens * world, self.order_seed, e)
                              for e in range(cfg.epochs)]  # fmt: skip
        total = sum(len(b) for b in self.epoch_batches)
        self.cursor = {"step": 0, "epoch": 0, "batch": 0, "elapsed": 0.0, "log": prior_log,
                       "base_step": self.base_step, "max_steps": cfg.max_steps,
                       "settings": {**{k: getattr(cfg, k) for k in RESUME_KEYS}, "world": world,
                                    **{k: _where(getattr(cfg, k)) for k in DATA_KEYS}}}  # fmt: skip
        if resume:
            cur = load_state(self.state_dir, self.draft, self.opt)
            cur["settings"].pop("max_steps", None)  # states of older versions kept it
            cur["settings"].setdefault("resume_from", None)
            for k in DATA_KEYS:  # states of older versions did not record them
                cur["settings"].setdefault(k, self.cursor["settings"][k])
            was = cur["settings"].setdefault("world", 1)
            if was != world:
                raise InputError(f"{self.state_dir} holds a run of {was} process(es) and this run has "
                                 f"{world} (the global batch is --batch-tokens x processes).",
                                 hint=(f"resume with torchrun --nproc-per-node {was}" if was > 1 else "resume without torchrun") + ", or use another --out")  # fmt: skip
            if cur["settings"] != self.cursor["settings"]:
                diff = ", ".join(f"{k} {cur['settings'].get(k)!r} -> {v!r}" for k, v in self.cursor["settings"].items()
                                 if cur["settings"].get(k) != v)  # fmt: skip
                raise InputError(f"{self.state_dir} holds a run with other settings ({diff}).",
                                 hint="use the same options, another --out, or delete the state folder")  # fmt: skip
            cur.pop("adam_steps", None)
            self.base_step = cur.setdefault("base_step", 0)
            if cur.get("max_steps") != cfg.max_steps:
                cur["log"].append({"step": self.base_step + cur["step"], "event": "max_steps changed",
                                   "from": cur.get("max_steps"), "to": cfg.max_steps})  # fmt: skip
                cur["max_steps"] = cfg.max_steps
            self.cursor = cur
        elif cfg.resume_from:
            self.cursor["log"].append({"step": self.base_step, "event": "resumed from weights only",
                                       "from": cfg.resume_from, "optimizer": "fresh",
                                       "schedule": "fresh (warmup + cosine over this segment)"})  # fmt: skip
        self.total_steps = total
        if cfg.max_steps:
            if cfg.max_steps <= self.base_step:
                raise InputError(f"--max-steps {cfg.max_steps} is not above the {self.base_step} steps "
                                 f"already trained in {cfg.resume_from}.",
                                 hint="pass a larger --max-steps to train further")  # fmt: skip
            self.total_steps = min(total, cfg.max_steps - self.base_step)
        if cfg.attention == "flex" and self.device.type != "cuda":
            raise InputError("--attention flex trains on CUDA only (no FlexAttention backward on CPU).",
                             hint="use --attention auto or dense")  # fmt: skip
        self.flex = cfg.attention == "flex" or (
            cfg.attention == "auto" and self.device.type == "cuda"
        )
        self.autocast = torch.bfloat16 if self.device.type == "cuda" else None
        self.runner = ddp.wrap(self.draft, self.dist)  # runs the forward (syncs gradients)

    def _load_data(self):
        cfg = self.cfg
        samples = read_shards(cfg.data)
        _refuse_benchmark_data(cfg.data, samples)
        _check_data_target(cfg.data, samples, cfg.target, self._target_vocab)
        seqs = prepare(samples, cfg.max_len)
        if not seqs:
            raise DatasetError(f"No record in {cfg.data} has two response tokens within --max-len.")
        if cfg.eval_data:
            groups: dict[str, list] = {}
            for smp in read_shards(cfg.eval_data):
                group = groups.setdefault(dataset_of(smp.id), [])
                if len(group) < cfg.eval_per_dataset:
                    group.extend(prepare([smp], cfg.max_len))
            eval_sets = sorted(groups.items())
        else:  # hold out a few sequences (never trained on) for the τ estimate
            k = min(cfg.eval_max, max(1, len(seqs) // 50)) if len(seqs) >= 2 else 0
            idx = list(range(len(seqs)))
            random.Random(cfg.seed).shuffle(idx)
            held = set(idx[:k])
            eval_sets = [("heldout", [seqs[i] for i in sorted(held)])] if held else []
            seqs = [s for i, s in enumerate(seqs) if i not in held]
        self.lengths = [len(ids) for ids, _ in seqs]
        return seqs, eval_sets

    def _check_pair(self, draft, target_model) -> None:
        from dflash.backends.plain import check_pair

        rows = target_model.get_input_embeddings().weight.shape[0]
        check_pair(draft.config, target_model.config, rows, [])

    def _batch(self, idx: list[int], epoch: int, empty: bool = False) -> dict:
        """Tensors of one batch. Each sequence's anchors come from a generator seeded by
        (seed, epoch, sequence index): the same in any batch, whatever its padding. ``empty``:
        no block is kept (a data-parallel rank without a sequence this step; zero weight).
        With FlexAttention the shapes are bucketed (S to 128, N to 8; also
        N*L > 128 and B >= 2, by padding blocks and a copied row that keep nothing)."""
        mult = 128 if self.flex else 1
        ids, att, loss_mask = collate([self.seqs[i] for i in idx], self.pad_id, multiple=mult)
        base = (self.order_seed * 1_000_003 + epoch) * 10_000_019
        gens = [torch.Generator().manual_seed((base + i) % 2**63) for i in idx]
        anchors, keep = sample_anchors(loss_mask, self.cfg.anchors, gens)
        if empty:
            keep = torch.zeros_like(keep)
        if self.flex:  # fewer distinct shapes for the compiled kernel
            lsz = self.draft.config.block_size
            n = round_up(max(1, anchors.shape[1]), 8)
            # >= 2 query tiles: a size of 1 would specialise (recompile) the kernel
            n = max(n, round_up(FLEX_TILE // lsz + 1, 8))
            pad = n - anchors.shape[1]
            anchors = torch.cat((anchors, anchors.new_zeros(anchors.shape[0], pad)), 1)
            keep = torch.cat((keep, keep.new_zeros(keep.shape[0], pad)), 1)
            if ids.shape[0] == 1:  # and >= 2 rows: a copy of the row, nothing kept
                ids, att = ids.repeat(2, 1), att.repeat(2, 1)
                loss_mask = torch.cat((loss_mask, torch.zeros_like(loss_mask)))
                anchors = torch.cat((anchors, torch.zeros_like(anchors)))
                keep = torch.cat((keep, torch.zeros_like(keep)))
        t = {"input_ids": ids, "attention_mask": att, "loss_mask": loss_mask,
             "anchors": anchors, "keep": keep}  # fmt: skip
        # the supervised slots, found here: the step then needs no host sync
        t["rows"] = supervised_rows(ids, loss_mask, anchors, keep, self.draft.config.block_size, self.cfg.gamma)
        # No pin_memory(): measured on the H200 (scripts/train_profile.py), pinning each batch
        # made batch building wait for the previous step (142 ms a step against 8 ms).
        return {k: v.to(self.device, non_blocking=True) for k, v in t.items()}

    def step(self, batch: dict, lr: float):
        """One optimizer step; returns StepOutput (device tensors, no sync)."""
        for g in self.opt.param_groups:
            g["lr"] = lr
        with torch.autocast(self.device.type, dtype=self.autocast or torch.float32,
                            enabled=self.autocast is not None):  # fmt: skip
            out = batch_loss(self.draft, self.target, batch, flex=self.flex, gamma=self.cfg.gamma,
                             chunk=8192 if self.device.type == "cuda" else 1024, runner=self.runner,
                             selector_weight=self.cfg.selector_weight)  # fmt: skip
        loss = out.loss
        if self.dist.world > 1:  # global statistics; DDP's average = the global batch's gradient
            selector = out.selector
            loss, out = ddp.global_step_stats(out, self.dist)
            out.selector = selector  # this rank's
        loss.backward()
        out.grad_norm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.cfg.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return out

    def evaluate(self) -> dict | None:
        """Held-out acceptance estimate (see ``estimate_acceptance``), overall and per dataset
        (``per_dataset``: name -> τ); None without eval data. Data-parallel: rank 0 evaluates,
        every rank returns its result."""
        if not self.eval_seqs:
            return None
        if self.dist.world > 1:
            return ddp.from_rank0(self._evaluate() if self.dist.rank == 0 else None, self.dist)
        return self._evaluate()

    def _evaluate(self) -> dict:
        from dflash.train.objective import merge_acceptance

        parts = {name: estimate_acceptance(self.draft, self.target, group, pad_id=self.pad_id,
                                           autocast_dtype=self.autocast)
                 for name, group in self.eval_sets}  # fmt: skip
        res = merge_acceptance(list(parts.values()))
        if len(parts) > 1:
            res["per_dataset"] = {n: p["tau"] for n, p in parts.items()}
            res["per_dataset_position"] = {n: p["per_position"] for n, p in parts.items()}
        for key in ("attempts", "hits"):
            res.pop(key, None)
        return res

    def save(self) -> None:
        """Write the resume state and export the draft (loader format) into ``out``; rank 0
        writes and the other ranks wait for it."""
        if self.dist.rank == 0:
            self._save()
        ddp.barrier(self.dist)

    def _save(self) -> None:
        save_state(self.state_dir, self.draft, self.opt, self.cursor)
        export = self.draft.config
        dtype = getattr(torch, self.cfg.save_dtype)
        export.extra["dtype"] = self.cfg.save_dtype
        with torch.device("meta"):
            copy = type(self.draft)(export)  # DFlash v1 or DFlash2
        state = {k: v.detach().to("cpu", dtype) for k, v in self.draft.state_dict().items()}
        copy.load_state_dict(state, assign=True)
        copy.save(self.out)
        last = self.last_heldout()
        if last and last.get("per_position"):
            write_acceptance(self.out, last, self.draft.config.block_size,
                             self.base_step + self.cursor["step"])  # fmt: skip
        (self.out / "train_log.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in self.cursor["log"])
        )

    def last_heldout(self) -> dict | None:
        """The latest held-out evaluation in the log (``tau``, ``per_position``...), a resumed
        run's earlier segments included; None before the first."""
        return next((r["heldout"] for r in reversed(self.cursor["log"]) if r.get("heldout")), None)

    def _progress(self) -> float:
        p = self.cursor["step"] / self.total_steps
        if self.cfg.time_limit:
            p = max(p, self.cursor["elapsed"] / self.cfg.time_limit)
        return p

    def _record(self, rec: dict) -> None:
        self.cursor["log"].append(rec)
        self.on_log(rec)

    def finished(self) -> bool:
        """True once the epochs, ``max_steps`` or ``time_limit`` are used up."""
        cur = self.cursor
        return cur["epoch"] >= self.cfg.epochs or cur["step"] >= self.total_steps or \
            self._progress() >= 1.0  # fmt: skip

    def run(self, until_step: int | None = None, pause_after: float | None = None) -> dict:
        """Train until :meth:`finished`; saves, and returns the last log record.

        Args:
            until_step: pause (save and return) at this optimizer step; a later run resumes.
            pause_after: pause after this many seconds of this call (the schedule is unchanged).

        A first Ctrl-C or SIGTERM (single process) also pauses at the end of the current step,
        saved, with :attr:`interrupted` set; a second one stops at once.

        Wall time between steps (evals and saves included) counts towards ``time_limit``. Log
        records carry ``samples_per_s`` and ``tokens_per_s``: sequences and their (unpadded)
        tokens trained per second of training steps since the previous record, over all ranks
        (``samples`` sequences in ``train_s`` seconds, evals and saves left out);
        :attr:`speed` sums this call. Data-parallel runs follow rank 0's clock for
        ``time_limit`` and ``pause_after`` (one broadcast per step, only with those options).
        """
        cfg, cur = self.cfg, self.cursor
        if cur["step"] == 0 and self.eval_seqs:
            self._record({"step": self.base_step, "heldout": self.evaluate(), "elapsed": 0.0})
        t_mark, pending, t_call = time.perf_counter(), [], time.perf_counter()
        clocked = self.dist.world > 1 and (cfg.time_limit is not None or pause_after is not None)
        self.speed = {"samples": 0, "tokens": 0, "seconds": 0.0}
        seen = [0, 0, time.perf_counter()]  # sequences, tokens, start of the interval

        def paused() -> bool:
            if until_step is not None and cur["step"] >= until_step or self.interrupted:
                return True
            return pause_after is not None and time.perf_counter() - t_call >= pause_after

        restore = self._catch_interrupts()
        try:
            self._train_loop(cur, cfg, paused, pending, t_mark, clocked, seen)
        finally:
            restore()
        self.save()
        return cur["log"][-1] if cur["log"] else {}

    def _catch_interrupts(self) -> Callable[[], None]:
        """Single process in the main thread: the first Ctrl-C or SIGTERM pauses the run at the
        end of the current step (saved, ``interrupted`` set; run again to resume), a second one
        stops at once. Returns the function restoring the previous handlers."""
        import signal
        import threading

        self.interrupted = False
        if self.dist.world > 1 or threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum, frame):
            if self.interrupted:
                raise KeyboardInterrupt
            self.interrupted = True

        before = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        return lambda: [signal.signal(sig, h) for sig, h in before.items()] and None

    def _train_loop(self, cur, cfg, paused, pending, t_mark, clocked, seen) -> None:
        stop = paused()
        while not self.finished() and not stop:
            batches = self.epoch_batches[cur["epoch"]]
            # progress at the middle of this step: neither the first step (warmup) nor the last
            # (cosine end) trains at a learning rate of 0
            p = max((cur["step"] + 0.5) / self.total_steps, self._progress())
            lr = lr_at(min(1.0, p), cfg.lr, cfg.warmup)
            idx = batches[cur["batch"]]
            part, empty = ddp.rank_part(idx, self.dist)
            out = self._guarded_step(self._batch(part, cur["epoch"], empty), lr)
            sel = out.selector if out.selector is not None else out.accept.new_zeros(())
            pending.append((out.loss.detach(), out.accuracy, out.accept, out.grad_norm.detach(), sel))
            seen[0], seen[1] = seen[0] + len(idx), seen[1] + sum(self.lengths[i] for i in idx)
            cur["step"], cur["batch"] = cur["step"] + 1, cur["batch"] + 1
            if cur["batch"] >= len(batches):
                cur["epoch"], cur["batch"] = cur["epoch"] + 1, 0
            now = time.perf_counter()
            cur["elapsed"], t_mark = cur["elapsed"] + now - t_mark, now
            stop = paused()
            if clocked:  # every rank must stop at the same step
                cur["elapsed"], stop = ddp.from_rank0((cur["elapsed"], stop), self.dist)
            last, step = self.finished(), cur["step"]
            gstep = self.base_step + step  # the step count across resumed segments
            do_eval = gstep % cfg.eval_every == 0 or last
            if gstep % cfg.log_every == 0 or last or stop or do_eval:
                stats = (
                    torch.stack([torch.stack(x).float() for x in pending]).mean(0).tolist()
                )  # sync
                pending = []
                secs = max(time.perf_counter() - seen[2], 1e-9)
                rec = {"step": gstep, "epoch": cur["epoch"], "lr": lr, "loss": stats[0],
                       "accuracy": stats[1], "accept": stats[2], "grad_norm": stats[3],
                       "elapsed": round(cur["elapsed"], 2),
                       "samples_per_s": round(seen[0] / secs, 3), "tokens_per_s": round(seen[1] / secs, 1),
                       "samples": seen[0], "train_s": round(secs, 4),
                       **({"selector_loss": stats[4]} if out.selector is not None else {})}  # fmt: skip
                for key, v in zip(self.speed, (seen[0], seen[1], secs), strict=True):
                    self.speed[key] += v
                if do_eval:
                    rec["heldout"] = self.evaluate()
                self._record(rec)
            if gstep % cfg.save_every == 0 and not last:
                t_save = time.perf_counter()
                self.save()
                seen[2] += time.perf_counter() - t_save
            if gstep % cfg.log_every == 0 or last or stop or do_eval:
                seen[:] = [0, 0, time.perf_counter()]  # evals and saves are not training time

    def _guarded_step(self, batch: dict, lr: float):
        """With ``--attention auto``, a flex step that fails (a compile error on an odd setup)
        is redone with dense masks, which are then used for the rest of the run."""
        if not self.flex or self.cfg.attention == "flex":
            return self.step(batch, lr)
        try:
            return self.step(batch, lr)
        except Exception as e:  # noqa: BLE001 - any compile/runtime failure of the flex path
            self.on_log({"warning": f"flex attention failed ({type(e).__name__}: {str(e)[:300]}); "
                                    "using dense masks"})  # fmt: skip
            self.opt.zero_grad(set_to_none=True)
            self.flex = False
            return self.step(batch, lr)  # dense masks take the flex-padded batch as it is


def dataset_of(record_id: str) -> str:
    """Dataset name of a record id: the benchmark (``gsm8k``, ``humaneval``, ...) or the part
    before the first ``/`` (``gsm8k-train``, ``mmlu-test``, ...)."""
    from dflash.data.guard import benchmark_of

    return benchmark_of(record_id) or record_id.split("/", 1)[0].split("#", 1)[0]


def _refuse_benchmark_data(folder: str, samples) -> None:
    """Training data must not hold benchmark test prompts (``dflash.data.guard``)."""
    from dflash.data.guard import check_training_ids

    meta = Path(folder) / "meta.json"
    if meta.is_file() and json.loads(meta.read_text()).get("eval_only"):
        raise DatasetError(f"{folder} was regenerated with --eval-only (benchmark test prompts); "
                           "never train on it.", hint="pass it as --eval-data instead")  # fmt: skip
    check_training_ids((s.id for s in samples), folder)


def _check_data_target(folder: str, samples, target: str | None, vocab: int | None) -> None:
    """Refuse data whose token ids the target cannot embed (regenerated by another target,
    another tokenizer); warn on stderr when ``meta.json`` names another target than ``target``
    (the same model may be named by another path or id).

    Raises:
        DatasetError: a token id >= the target's vocabulary size.
    """
    top = max((max(s.prompt_ids + s.response_ids, default=0) for s in samples), default=0)
    meta = Path(folder) / "meta.json"
    made_by = json.loads(meta.read_text()).get("target") if meta.is_file() else None
    if vocab is not None and top >= vocab:
        raise DatasetError(f"{folder} holds token id {top}, past the target's vocabulary of {vocab}: it was "
                           f"regenerated by another target ({made_by or 'unknown'}).",
                           hint="regenerate the data with this target (dflash data regenerate --target ...)")  # fmt: skip
    given = str(target or "demo")
    if made_by is not None and made_by != given and Path(made_by).resolve() != Path(given).resolve():
        print(f"warning: {folder} was regenerated by {made_by}, and this run trains for {given}; "
              "the draft learns that target's replies.", file=sys.stderr)  # fmt: skip


def load_training_target(target: str | None, device: str = "auto"):
    """Load the target for training: bfloat16 on CUDA, float32 on CPU. Returns (model, tokenizer)."""
    from dflash.backends.plain import load_target, pick_device
    from dflash.models.target_torch import resolve_target

    dev = pick_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return load_target(resolve_target(target, "--target"), dev, dtype)
