"""Static-cache fast path of the transformers backend, with CUDA graphs (gpt-fast style).

For Llama/Qwen2/Qwen3/Mistral/Qwen3-MoE targets (sliding-window and interleaved layers
included: a window is a position mask over a cache that keeps every row) the target forward is re-expressed over the HF model's own
modules with preallocated K/V buffers written by position, so rollback is free (stale rows
sit at positions >= the committed length and are overwritten before any query can see them)
and every step has fixed shapes. On CUDA the verify forward (per width) and the draft forward
are captured as CUDA graphs and replayed; prefill and a few edge steps run eagerly through the
same code. Target features of every position go to a position-indexed buffer, and the draft
re-reads the last L committed rows each step (re-writing identical context K/V), which keeps
its input shape fixed. ``../shared/gpu/FACTS.md`` explains why HF's own static cache is avoided.

Every graph a request can need is captured in :meth:`StaticBackend.reset`, before the first token
(see :mod:`dflash.backends.static.graph_plan`); with ``compile`` the captured forwards are first wrapped
in ``torch.compile`` (Inductor, kernels cached on disk), which fuses the small kernels.

The graph capture methods live in :mod:`dflash.backends.static.capture` (the
:class:`~dflash.backends.static.capture.StaticGraphs` mixin that :class:`StaticBackend` inherits),
which targets the path runs in :mod:`dflash.backends.static.support`, which kernels the forwards
run in :mod:`dflash.backends.static.kernel_choice`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dflash.backends.base import SelectorProposal
from dflash.backends.plain import TransformersBackend
from dflash.backends.static.capture import StaticGraphs
from dflash.backends.static.device_loop import DeviceLoop
from dflash.backends.static.draft import StaticDraftCache, draft_forward_fused
from dflash.backends.static.families import (
    allocate,
    family_forward,
    family_type,
    layer_specs,
)
from dflash.backends.static.fused import (
    fuse_draft,
    fuse_target,
    row_argmax,
    target_forward_fused,
)
from dflash.backends.static.graph_plan import plan_graphs
from dflash.backends.static.hybrid import (
    HybridState,
    fuse_hybrid,
    hybrid_forward,
    is_hybrid,
)
from dflash.backends.static.kernel_choice import choose_kernels
from dflash.backends.static.moe import moe_route
from dflash.backends.static.support import (
    layer_windows,
    static_refusal,
    supports_dense_static,  # noqa: F401 - dflash.serve imports it here
)
from dflash.errors import BackendError
from dflash.kernels.pdl import pdl_supported
from dflash.kernels.settings import KernelSettings, one_slice, pdl_wanted
from dflash.kernels.small_linear import MAX_ROWS
from dflash.kernels.split_attention import uses_kernel
from dflash.models.draft2_torch import select_walk
from dflash.models.draft_torch import DFlashDraft, rope_cos_sin
from dflash.models.target_torch import layer_kinds

AUTO_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)  # widths --block-size auto may use on the graph path
SELECTOR_UNIFORMS = 64  # draft positions a DFlash2 sampled walk's uniform buffer holds (at least)


class StaticBackend(StaticGraphs, TransformersBackend):
    """TransformersBackend with static caches and (on CUDA) CUDA-graph replay.

    Args:
        target: HF Llama/Qwen2/Qwen3/Mistral/Qwen3-MoE causal LM (see :func:`~dflash.backends.static.support.supports_static`).
        draft: DFlashDraft or None; its per-layer types (sliding windows, causal overrides)
            are honoured through the same position masks as the plain path.
        device: torch device.
        use_graphs: capture and replay CUDA graphs (CUDA only).
        compile: wrap the captured forwards in ``torch.compile`` (graphs only); a compile
            failure falls back to eager with a warning on stderr.
        uniform_width: verify everything at the draft's block size, block-1 decoding included
            (see :func:`dflash.backends.static.graph_plan.plan_graphs`).
        settings: the resolved :class:`~dflash.kernels.settings.KernelSettings` (which kernels
            the forwards run, and how); None = the defaults.
        device_loop: run greedy fixed-block requests with acceptance and commit on the device
            (:mod:`dflash.backends.static.device_loop`); None = the ``device_loop`` setting,
            with CUDA graphs only. True without graphs runs the same glue eagerly (tests).

    Raises:
        BackendError: a target :func:`~dflash.backends.static.support.supports_static` refuses.

    A DFlash2 draft (brief §4) runs the same fused forward with its convolutions (torch ops)
    around the sublayers, then the candidate selector's walk on the device
    (:meth:`_select`): greedy in the draft graph and the device loop, sampled in its own
    graph (``sdraft``) whose uniforms and temperature are inputs the host writes before the
    replay.
    """

    def __init__(self, target: Any, draft: DFlashDraft | None, device: torch.device,
                 use_graphs: bool = True, compile: bool = False, uniform_width: bool = False,
                 settings: KernelSettings | None = None, device_loop: bool | None = None):  # fmt: skip
        why = static_refusal(target)
        if why is not None:
            raise BackendError(f"The static/CUDA-graph path cannot run this target: {why}.",
                               hint="drop --cuda-graphs")  # fmt: skip
        super().__init__(target, draft, device, settings)
        self.draft_head_rows = False  # the draft graph has one shape: the head on every row
        self.use_graphs = use_graphs and device.type == "cuda"
        self.compile = compile and self.use_graphs
        self.plan = plan_graphs(self.draft_block_size, draft is not None, uniform_width)
        self._compiled: dict[str, Any] = {}
        cfg = target.config
        # gpt-oss, Gemma 3/4: per-layer layouts and their own forward (dflash.backends.static.families)
        self.family = layer_specs(target) if family_type(target) else None
        self.n_layers, self.heads = cfg.num_hidden_layers, cfg.num_attention_heads
        if self.family is not None:  # layer 0's (Gemma 4's global layers have others)
            self.kv_heads, self.head_dim = self.family[0].kv_heads, self.family[0].head_dim
        else:
            self.kv_heads = cfg.num_key_value_heads
            self.head_dim = (
                getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            )
        rot = target.model.rotary_emb
        if self.family is None:
            self.inv_freq, self.rope_scale = rot.inv_freq.float(), float(rot.attention_scaling)
        self.dtype = self.embed_weight.dtype
        self.windows = layer_windows(cfg)  # per layer: sliding window W or None
        self.moe_route = moe_route(device, self.dtype)  # expert blocks: gather or grouped_mm
        self.hybrid = is_hybrid(cfg)  # GatedDeltaNet layers: state buffers in self.gdn
        self.gdn: HybridState | None = None
        self.feature_layers: dict[int, list[int]] = {}  # layer -> feature slots (ids may repeat)
        for n, i in enumerate(self.layer_ids):
            self.feature_layers.setdefault(i - 1, []).append(n)
        # one qkv (hybrids: one token-mixer input) and one gate+up matmul per layer; families: their own
        self.fused_target = (
            fuse_hybrid(target)
            if self.hybrid
            else fuse_target(target)
            if self.family is None
            else []
        )
        self.dflash2 = bool(getattr(draft, "is_dflash2", False))
        self.fused_draft = fuse_draft(draft) if draft is not None else None
        if self.dflash2:  # the sampled walk's graph inputs: uniforms [1, U] and temperature [1]
            width = max(SELECTOR_UNIFORMS, self.draft_block_size)
            self.sel_u = torch.zeros(1, width, device=device)
            self.sel_temp = torch.ones(1, device=device)
        if self.fused_draft is not None and not self.dflash2:  # the device loop's draft skips
            self.draft_head.fold_norm(draft.norm.weight)  # its final norm (v1: argmax head)
        self.folded_target = self.folded_draft = None
        self.configure(self.settings)
        self.capacity = 0
        if device_loop is None:
            device_loop = self.settings.device_loop and self.use_graphs
        self.device_loop = DeviceLoop(self) if device_loop else None
        self.graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, Any, tuple]] = {}
        # --block-size auto picks among these widths (graphs captured when costs are timed).
        b = self.draft_block_size
        self.auto_widths = (
            sorted({w for w in AUTO_WIDTHS if w < b} | {1, b}) if self.use_graphs else None
        )

    def configure(self, settings: KernelSettings) -> None:
        """Decide from ``settings`` (and what the target, the draft, the device and the dtype
        allow) which kernels the forwards run: ``attention``, ``linear``/``linear_in``,
        ``draft_linear``/``draft_linear_in``, ``glu``/``draft_glu``, ``target_rope``/``draft_rope``,
        ``qkv_rope_target``/``qkv_rope_draft``, ``fuse_norm``/``draft_fuse_norm`` (with the
        folded weight copies), ``norm_kernel``, ``rope_table``, and ``launch`` (the kernels'
        :class:`~dflash.kernels.settings.Launch` per forward). Run at build and after a
        fall-back (:meth:`~dflash.backends.static.capture.StaticGraphs._fall_back`); the choices
        are :func:`~dflash.backends.static.kernel_choice.choose_kernels`."""
        choose_kernels(self, settings)

    def pdl_on(self, part: str, inductor: bool = False) -> bool:
        """Whether the ``part`` ("target" or "draft") forward's kernels launch with PDL
        (``inductor``: Inductor's kernels, set while its graphs are captured)."""
        return pdl_wanted(self.settings.pdl, part, inductor) and pdl_supported(self.device)

    def live_kernels(self, part: str | None = None) -> set[str]:
        """The pieces of :data:`~dflash.kernels.settings.LADDER` the forwards run (``pdl``: in
        the ``part`` forward, this project's kernels or Inductor's), for
        :func:`~dflash.kernels.settings.fall_back`."""
        live = {
            "qkv_rope": self.qkv_rope_target or self.qkv_rope_draft,
            "norm_kernel": self.norm_kernel or self.hybrid_norms,
            "fuse_norm": self.fuse_norm or self.draft_fuse_norm,
            "glu": self.glu or self.draft_glu,
            "rope": self.draft_rope or self.target_rope,
            "linear": self.linear != "torch" or self.draft_linear,
            "attention": self.attention != "sdpa",
            "pdl": any(
                self.pdl_on(p, i)
                for p in ([part] if part else ["target", "draft"])
                for i in (False, True)
            ),
        }
        return {name for name, on in live.items() if on}

    # -- buffers --------------------------------------------------------------------------
    def reset(self, max_positions: int | None = None) -> None:
        """Size the caches for the request and capture every planned graph (before prefill)."""
        self._draft_rng = None  # DFlash2's sampled walk: re-seeded at the request's first draft
        need = (max_positions or 2048) + self.draft_block_size + 16  # padded verify rows
        if need > self.capacity:
            self._allocate(-(-need // 1024) * 1024)
        if self.use_graphs:
            self.capture_all()

    def _allocate(self, capacity: int) -> None:
        dev, dt = self.device, self.dtype
        shape = (1, self.kv_heads, capacity, self.head_dim)
        if (
            self.family is not None
        ):  # per-layer layouts; a layer sharing K/V holds its source's buffers
            self.k, self.v = allocate(self.family, capacity, dt, dev)
        else:
            linear = self.gdn_layers()  # GatedDeltaNet layers keep no K/V
            self.k = [
                None if i in linear else torch.zeros(shape, dtype=dt, device=dev)
                for i in range(self.n_layers)
            ]
            self.v = [
                None if i in linear else torch.zeros(shape, dtype=dt, device=dev)
                for i in range(self.n_layers)
            ]
        if self.hybrid and self.gdn is None:  # fixed for the backend's life: the graphs hold them
            self.gdn = HybridState(
                self.target, max(*self.plan.verify_widths, self.draft_block_size), dt, dev
            )
        self.key_pos = torch.arange(capacity, device=dev)
        width = len(self.layer_ids) * self.target.config.hidden_size
        self.feats = torch.zeros(capacity, max(width, 1), dtype=dt, device=dev)  # [S, F]
        if self.draft_model is not None:
            c = self.draft_model.config
            self.dcache = StaticDraftCache(c.num_hidden_layers, c.num_key_value_heads, capacity,
                                           c.head_dim, dt, dev)  # fmt: skip
            # cos/sin [S, D] of every position for the draft's RoPE kernel (the rope_table setting)
            d = self.draft_model
            cos, sin = rope_cos_sin(self.key_pos[None], d.inv_freq, d.rope_scale, dt)
            self.draft_rope_tables = (cos[0, 0].contiguous(), sin[0, 0].contiguous())
        self.capacity = capacity
        self.graphs.clear()

    def gdn_layers(self) -> set[int]:
        """The target's GatedDeltaNet layers (empty unless a hybrid)."""
        return {i for i, k in enumerate(layer_kinds(self.target.config)) if k == "linear_attention"}

    # -- forwards -------------------------------------------------------------------------
    def _target_forward(self, ids: torch.Tensor, pos: torch.Tensor, prefill: bool = False):
        """ids, pos [1, T] -> logits [T, V]; writes K/V and features at pos
        (:func:`~dflash.backends.static.fused.target_forward_fused`; gpt-oss and Gemma:
        :func:`~dflash.backends.static.families.family_forward`; hybrids
        :func:`~dflash.backends.static.hybrid.hybrid_forward`, whose GatedDeltaNet layers a
        ``prefill`` starts from zero states, a verify from the committed ones)."""
        if self.family is not None:
            return family_forward(self, ids, pos)
        if self.hybrid:
            return hybrid_forward(self, ids, pos, prefill)
        return target_forward_fused(self, ids, pos)

    def _draft_forward(self, block: torch.Tensor, start: torch.Tensor, ctx_pos: torch.Tensor,
                       logits: bool = True, sample: bool = False):  # fmt: skip
        """block [1, L] ids, start [1] position of the anchor, ctx_pos [Tc] context rows.

        Returns (proposals [L-1] int64, logits [L-1, V]); ``logits=False``: (proposals, None)
        (the device loop): no full-vocabulary scatter with a draft vocabulary, and on the fused
        path no final norm (its weight folded into the head's copy,
        :meth:`~dflash.backends.draft_head.DraftHead.fold_norm`). A DFlash2 draft returns
        (proposals, (candidates [L-1, k], q [L-1, k] or None)) from :meth:`_select` (``sample``:
        the sampled walk; :meth:`draft` makes the pair a
        :class:`~dflash.backends.base.SelectorProposal`), (proposals, None) with
        ``logits=False``."""
        length = block.shape[-1]
        q_pos = (start + torch.arange(length, device=self.device))[None]  # [1, L]
        self.dcache.write_pos = ctx_pos
        ones = torch.ones(length, dtype=torch.bool, device=self.device)
        valid = torch.cat((self.key_pos < start, ones))[None, None, None, :]  # [1, 1, 1, S+L]
        k_pos = torch.cat((self.key_pos, q_pos[0]))[None]  # [1, S+L] key positions
        rules = self.draft_model.inference_masks(q_pos, k_pos)  # causal / window per layer type
        masks = {kind: valid.expand(1, 1, length, -1) if rule is None else rule & valid
                 for kind, rule in rules.items()}  # fmt: skip
        embeds, ctx = F.embedding(block, self.embed_weight), self.feats[ctx_pos][None]
        if self.embed_scale != 1.0:
            embeds = embeds * self.embed_scale
        head = self.draft_head  # the draft vocabulary's rows when the draft has one
        fold = not logits and self.fused_draft is not None and head.folded is not None
        if self.fused_draft is not None:
            split = uses_kernel(self.attention, length)
            kinds = (
                frozenset(kind for kind, rule in rules.items() if rule is None)
                if split
                else frozenset()
            )
            lin = self.draft_linear and length <= MAX_ROWS  # residual adds fused in
            h = draft_forward_fused(self.draft_model, self.fused_draft, embeds, ctx, q_pos, ctx_pos[None],
                                    self.dcache, masks, self.launch["draft"], kinds, lin,
                                    lin and self.draft_linear_in, lin and self.draft_rope, lin and self.draft_glu,
                                    self.folded_draft if lin and self.draft_fuse_norm else None,
                                    lin and self.qkv_rope_draft, final_norm=not fold,
                                    tables=self.draft_rope_tables if self.rope_table else None)  # fmt: skip
        else:
            h = self.draft_model(embeds, ctx, q_pos, ctx_pos[None], cache=self.dcache, masks=masks)
        if self.dflash2:  # the selector's walk over the full head's candidates
            props, cand, q = self._select(h[:, 1:], block[:, 0], sample)
            chosen = (cand[0], None if q is None else q[0]) if logits else None  # a plain tuple:
            return props[0], chosen  # what a compiled graph returns; draft() wraps it
        if fold:  # no final norm: its weight is in the head's copy (DraftHead.fold_norm)
            return head.argmax_folded(h[0, 1:], row_argmax), None
        small = head.small_logits(h[0, 1:])  # [L-1, Vd]
        props = head.to_target(row_argmax(small))
        return props, (head.widen(small) if logits else None)  # [L-1, V] for sampling

    def _select(self, hidden: torch.Tensor, anchor: torch.Tensor, sample: bool):
        """The DFlash2 candidate selector on the device (brief §4.2), fixed shapes, no host sync.

        Args:
            hidden: [B, L-1, H] final-normed draft states of the draft positions (B = 1 in the
                forwards; the sampling test walks many rows at once).
            anchor: [B] anchor token ids.
            sample: walk with the uniforms ``sel_u`` [B, >= L-1] and temperature ``sel_temp``
                (graph inputs written by :meth:`draft`); False: the greedy walk.

        Returns:
            (proposals [B, L-1] int64, candidates [B, L-1, k], q [B, L-1, k] float32 or None).
        """
        d = self.draft_model
        sel = d.candidate_selector
        cand, unary = sel.candidates(d.process_logits(self.lm_head(hidden)))  # [1, L-1, k] each
        first, trans = sel.edges(hidden, cand, anchor)
        t = hidden.shape[1]
        picks, q = select_walk(unary, first, trans, self.sel_u[:, :t], self.sel_temp) if sample else \
            select_walk(unary, first, trans)  # fmt: skip
        return cand.gather(-1, picks[..., None])[..., 0], cand, q

    # -- protocol -------------------------------------------------------------------------
    def prefill(self, prompt_ids: list[int], with_features: bool):
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        pos = torch.arange(len(prompt_ids), device=self.device)[None]
        with torch.inference_mode():
            logits = self._target_forward(ids, pos, prefill=True)
            seen = 0
            if with_features and self.draft_model is not None:  # the prompt's draft context K/V:
                self.dcache.write_pos = pos[0]  # the first draft call then reads only its window
                self.draft_model.write_context(
                    self.feats[: len(prompt_ids)][None], pos, self.dcache
                )
                seen = len(prompt_ids)
        self._draft_seen = seen
        if self.gdn is not None:
            self.gdn.prefilled(len(prompt_ids))
        return logits[-1], (self.feats[: len(prompt_ids)] if with_features else None)

    def verify(self, anchor: int, proposals, start: int, with_features: bool):
        """Verify [anchor, proposals]; with graphs the width is padded to a captured one and
        the logits of the padding rows are dropped (returned logits [W, V], W = 1 + proposals)."""
        width = 1 + (0 if proposals is None else proposals.shape[0])
        if self.hybrid:  # the committed GatedDeltaNet states must hold `start` positions
            self.gdn.verifying(start, width)
        if not self.use_graphs:
            ids = torch.tensor([anchor], dtype=torch.long, device=self.device)
            ids = ids if proposals is None else torch.cat((ids, proposals))
            pos = torch.arange(start, start + width, device=self.device)[None]
            with torch.inference_mode():
                logits = self._target_forward(ids[None], pos)
            return logits, self.feats[start : start + width]
        padded = self.plan.verify_width(width)
        graph, out, (ids_in, pos_in) = self._verify_graph(padded)
        ids_in[0, 0].fill_(anchor)
        if proposals is not None:
            ids_in[0, 1:width].copy_(proposals)
        pos_in[0].copy_(self.key_pos[start : start + padded])
        graph.replay()
        return out[:width], self.feats[start : start + width]

    def draft(self, anchor: int, context, start: int, length: int, sampling=None):
        """Propose a block; reads context features by position (``context`` is not needed).

        A prefill with features wrote the prompt's draft context, so every call re-reads the
        last ``draft_block_size`` committed rows, which covers all rows committed since (after
        plain steps of ``--block-size auto`` every row since the last draft call, eagerly).
        ``sampling`` (DFlash2, temperature > 0): the selector samples its path; the host draws
        the walk's L-1 uniforms from the request's seeded generator (the plain path's draws) into
        the graph's input before the replay.
        """
        dev, window = self.device, self.draft_block_size
        seen, self._draft_seen = self._draft_seen, start  # rows < seen are in the draft cache
        sample = self.dflash2 and sampling is not None and float(sampling.temperature) > 0
        if sample:
            self._selector_uniforms(sampling, length - 1)
        if start < window or not self.use_graphs or start - seen > window:
            lo = max(0, min(start - window, seen))
            block = torch.full((1, length), self.mask_token_id, dtype=torch.long, device=dev)
            block[0, 0] = anchor
            with torch.inference_mode():
                out = self._draft_forward(block, self.key_pos[start : start + 1], self.key_pos[lo:start],
                                          sample=sample)  # fmt: skip
            return (out[0], SelectorProposal(*out[1])) if self.dflash2 else out
        graph, out, (blk, st, cp) = self._draft_graph(length, "sdraft" if sample else "draft")
        blk[0, 0].fill_(anchor)
        st.fill_(start)
        cp.copy_(self.key_pos[start - window : start])
        graph.replay()
        return (out[0], SelectorProposal(*out[1])) if self.dflash2 else out

    def _selector_uniforms(self, sampling, n: int) -> None:
        """Write the sampled walk's inputs: ``n`` uniforms from the request's selector generator
        (the same draws as the plain path's walk) and the temperature. A longer walk than the
        buffer holds gets a new buffer (its sampled graphs are captured again)."""
        if n > self.sel_u.shape[1]:
            self.sel_u = torch.zeros(1, n, device=self.device)
            for key in [k for k in self.graphs if k[0] == "sdraft"]:
                del self.graphs[key]
        gen = self._selector_rng(sampling)
        self.sel_u[:, :n].copy_(torch.rand(1, n, generator=gen, device=self.device))
        self.sel_temp.fill_(float(sampling.temperature))

    def rollback(self, length: int) -> None:
        """K/V: nothing to do (rows >= length are masked by position and overwritten later).
        GatedDeltaNet layers: the state after the accepted prefix of the last verify becomes
        the committed one (a gather on the device, :meth:`HybridState.rollback`).

        Raises:
            BackendError: (hybrids) ``length`` outside the last verify's positions.
        """
        if self.hybrid:
            self.gdn.settle(length)

    def _draft_head_dim(self) -> int | None:
        """The draft's attention head dim (None without a draft)."""
        return self.draft_model.config.head_dim if self.draft_model is not None else None

    def describe(self) -> dict[str, Any]:
        """What runs the forwards (stored with benchmark records): the kernels in use, and the
        resolved settings (``kernel_settings``, from :meth:`TransformersBackend.describe`)."""
        loop = self.device_loop
        return {**super().describe(), **({"queue_ahead": loop.ahead} if loop is not None else {}),
                "impl": "static", "cuda_graphs": self.use_graphs, "compile": self.compile,
                "verify_widths": list(self.plan.verify_widths),
                "device_loop": self.device_loop is not None,
                **({"sliding_windows": sorted({w for w in self.windows if w})} if any(self.windows) else {}),
                **({"moe_route": self.moe_route} if any(gu is None for _, gu in self.fused_target)
                   or family_type(self.target) == "gpt_oss"
                   or any(getattr(layer, "enable_moe_block", False) for layer in self.target.model.layers) else {}),
                **({"family": family_type(self.target)} if self.family is not None else {}),
                **({"gdn_layers": len(self.gdn_layers()),
                    "gdn_recurrence": "triton" if self.gdn is not None and self.gdn.triton else "torch",
                    "gdn_norms": "triton" if self.hybrid_norms else "torch"}
                   if self.hybrid else {}),
                "attention": self.attention, "linear": self.linear,
                # rows up to which the in-projections run small_linear (the draft: all or none)
                "linear_in": {"target": self.linear_in, "draft": MAX_ROWS if self.draft_linear_in else 0},
                "glu": {"target": self.glu, "draft": self.draft_glu},
                "norm_kernel": self.norm_kernel,
                **({"fuse_norm": {"target": self.fuse_norm, "draft": self.draft_fuse_norm}}
                   if self.fuse_norm or self.draft_fuse_norm else {}),
                **({"attn_split": self.settings.attn_split,
                    "attn_one_slice": {"target": one_slice(self.settings, self.head_dim),
                                       "draft": one_slice(self.settings, self._draft_head_dim())},
                    "attn_block": self.settings.attn_block, "attn_early": self.settings.attn_early}
                   if self.attention != "sdpa" else {}),  # the split-KV kernel's keys per program, per iteration
                "draft_linear": self.draft_linear,
                "rope_kernel": {"draft": self.draft_rope, "target": self.target_rope},
                "pdl": {part: kl.pdl for part, kl in self.launch.items()},
                **({"qkv_rope": {"target": self.qkv_rope_target, "draft": self.qkv_rope_draft}}
                   if self.qkv_rope_target or self.qkv_rope_draft else {})}  # fmt: skip
