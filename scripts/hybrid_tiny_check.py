"""The ``tiny`` part of ``scripts/gpu_check_hybrid.py``: tiny random float32 GatedDeltaNet hybrids
(the test suite's shapes: the device gets ``dflash/`` and ``scripts/`` only) on the graph path
against HF ``generate`` and the plain path, with scripted schedules and the committed recurrent
states after every step (see that script's docstring); ``rel``/``rel_norm``: the error measures
the parts share."""

from __future__ import annotations

import gc
import time
import traceback

import torch

FAMILIES = ("qwen3_5_text", "qwen3_5_moe", "qwen3_next")
# the tiny targets of tests/helpers/target_families.py (the device gets dflash/ and scripts/ only)
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, pad_token_id=1, bos_token_id=None,
            eos_token_id=3, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            initializer_range=0.3, tie_word_embeddings=False)  # fmt: skip
MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)
CONFIGS = {"qwen3_5_text": ("Qwen3_5TextConfig", {}), "qwen3_5_moe": ("Qwen3_5MoeTextConfig", MOE),
           "qwen3_next": ("Qwen3NextConfig", MOE)}  # fmt: skip
P, N = 70, 32  # tiny checks: prompt tokens (two prefill chunks), new tokens


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (float32)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius, float32): the tiny checks' relative difference of two states."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def committed(be, layers) -> list:
    """Per GatedDeltaNet layer (conv [C, K], recurrent [Hv, Dk, Dv]) committed, cloned, of a
    static backend (its slots) or the plain path (its cache)."""
    from dflash.backends.static.backend import StaticBackend

    if isinstance(be, StaticBackend):
        return [tuple(x.clone() for x in be.gdn.committed(i)) for i in layers]
    return [(be.cache.layers[i].conv_states[0][0].clone(), be.cache.layers[i].recurrent_states[0][0].clone())
            for i in layers]  # fmt: skip


def build_tiny(family: str, dev: torch.device):
    """A tiny random float32 target of ``family`` on ``dev`` (seed 0) and a random 2-layer draft."""
    import transformers

    from dflash.models.draft_torch import DFlashDraft
    from dflash.models.init_draft import draft_config_for

    cls, extra = CONFIGS[family]
    cfg = getattr(transformers, cls)(**BASE, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().to(dev)
    dcfg = draft_config_for(cfg, layers=2, block_size=16, mask_token_id=255, vocab_rows=256)
    torch.manual_seed(0)
    return model, DFlashDraft(dcfg).eval().to(dev)


def prompt_ids(n: int = P, seed: int = 1) -> list[int]:
    """n word ids (4..249), as tests/helpers/target_families.py."""
    return torch.randint(4, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Recording:
    """A backend whose draft proposes the true continuation for k positions and then a wrong
    token (k from ``schedule``, cycled); records the committed GatedDeltaNet states after every
    rollback as (committed length, :func:`committed`)."""

    draft_head_rows = False

    def __init__(self, inner, truth: list[int], schedule: list[int], layers: list[int]):
        self.inner, self.truth, self.schedule, self.layers = inner, truth, schedule, layers
        self.step, self.snapshots = 0, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, anchor, context, start, length):
        k = min(self.schedule[self.step % len(self.schedule)], length - 1)
        self.step += 1
        true = self.truth[start - P + 1 :][: length - 1]
        return torch.tensor(
            true[:k] + [(t + 1) % 256 for t in true[k:]], device=self.inner.device
        ), None

    def rollback(self, length: int) -> None:
        self.inner.rollback(length)
        self.snapshots.append((length, committed(self.inner, self.layers)))


def check_tiny(dev: torch.device, t0: float, budget_s: float) -> dict:
    from dflash.backends.plain import TransformersBackend
    from dflash.backends.static.backend import StaticBackend
    from dflash.loop import speculative_generate

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    def ids(be, block, n=N, wrap=None):
        rounds = speculative_generate(
            wrap or be, prompt_ids(), block_size=block, max_new_tokens=n, stop_ids=[]
        )
        return [t for r in rounds for t in r.tokens]

    out, ok = {}, True
    graphs = dev.type == "cuda"
    for family in FAMILIES:
        if time.perf_counter() - t0 > budget_s:
            out[family] = {"skipped": "time"}
            continue
        row: dict = {}
        try:
            model, draft = build_tiny(family, dev)
            truth = greedy_on(model, prompt_ids(), 60)
            layers = [i for i, k in enumerate(model.config.layer_types) if k == "linear_attention"]
            fast = StaticBackend(model, draft, dev, use_graphs=graphs)
            host = StaticBackend(model, draft, dev, use_graphs=graphs, device_loop=False)
            row["describe"] = {k: v for k, v in fast.describe().items()
                               if k in ("gdn_recurrence", "device_loop", "cuda_graphs", "moe_route")}  # fmt: skip
            row["ids"] = {f"device_loop_b{bs}": ids(fast, bs) == truth[:N] for bs in (1, 16)}
            row["ids"]["host_loop_b3"] = ids(host, 3) == truth[:N]
            plain = TransformersBackend(model, draft, dev)
            ref = one_by_one(model, prompt_ids() + truth, layers)
            worst, worst_max, baseline, steps = 0.0, 0.0, 0.0, 0
            for schedule in ([15, 0, 3, 0, 0, 15], [0, 0, 0]):
                runs = []
                for inner in (host, plain):
                    be = Recording(inner, truth, schedule, layers)
                    got = ids(inner, 16, 56, wrap=be)
                    row["ids"][f"scripted_{schedule}_{type(inner).__name__}"] = got == truth[:56]
                    runs.append(be.snapshots)
                for (n1, a), (n2, b) in zip(*runs, strict=True):
                    assert n1 == n2
                    pairs = [
                        (x, y)
                        for sa, sb in zip(a, b, strict=True)
                        for x, y in zip(sa, sb, strict=True)
                    ]
                    worst = max(worst, *(rel_norm(x, y) for x, y in pairs))
                    worst_max = max(worst_max, *(rel(x, y) for x, y in pairs))
                    base = [
                        (y, z)
                        for sb, sz in zip(b, ref[n1], strict=True)
                        for y, z in zip(sb, sz, strict=True)
                    ]
                    baseline = max(baseline, *(rel_norm(y, z) for y, z in base))
                    steps += 1
            # the plain path's own distance to one-by-one decoding: float32 rounding between
            # forward widths; the graph path may differ from the plain path by twice that
            tol = max(1e-5, 2 * baseline)
            row.update(states_worst_rel=worst, states_worst_rel_maxabs=worst_max,
                       plain_vs_one_by_one_rel=baseline, states_tol=tol, states_steps=steps)  # fmt: skip
            row["ok"] = all(row["ids"].values()) and worst <= tol
        except Exception as e:  # noqa: BLE001 - report and go on
            row.update(
                ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:]
            )
        ok &= row["ok"]
        out[family] = row
        print(
            f"tiny {family}: ok={row['ok']} states_worst_rel={row.get('states_worst_rel')} "
            f"(plain vs one-by-one {row.get('plain_vs_one_by_one_rel')}) {row.get('error', '')}",
            flush=True,
        )
        gc.collect()
    out["ok"] = ok
    return out


def one_by_one(model, ids: list[int], layers: list[int]) -> dict[int, list]:
    """transformers decoding the prompt (P tokens) in one forward, then one token at a time:
    committed length -> per GatedDeltaNet layer (conv [C, K], recurrent [Hv, Dk, Dv])."""
    from transformers import DynamicCache

    cache, out = DynamicCache(config=model.config), {}
    dev = model.device

    def states():
        return [(cache.layers[i].conv_states[0][0].clone(), cache.layers[i].recurrent_states[0][0].clone())
                for i in layers]  # fmt: skip

    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:P]], device=dev), past_key_values=cache, use_cache=True)
        out[P] = states()
        for i in range(P, len(ids)):
            model(input_ids=torch.tensor([[ids[i]]], device=dev), position_ids=torch.tensor([[i]], device=dev),
                  past_key_values=cache, use_cache=True)  # fmt: skip
            out[i + 1] = states()
    return out


def greedy_on(model, prompt: list[int], n: int) -> list[int]:
    """HF generate's greedy ids on the model's device."""
    ids = torch.tensor([prompt], device=model.device)
    got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=1)  # fmt: skip
    return got[0, len(prompt) :].tolist()
