"""Batched plain decoding of a target with static KV caches and CUDA graphs (continuous batching).

    gen = BatchedGenerator(model, max_batch=512, capacity=2048)
    for job, tokens in gen.run([Job(prompt_ids, max_new_tokens=512, temperature=0.0), ...], stops):
        ...

B rows decode one token per step. Each row holds one job (a prompt and its budget) at its own
positions 0..n-1: a prompt is prefilled into a free row (right-padded with other new prompts,
causal attention, so padding is never seen), then every step writes K/V at the row's own
position and attends to keys at positions <= it. Rows whose job ended (a stop token or the
budget) are refilled with the next prompts, so long and short answers share the batch without a
tail. On CUDA one graph replays ``steps_per_sync`` decode steps; the host syncs once per replay
to collect finished rows. The same code runs eagerly on CPU, where every row's float32 output
equals that row decoded alone (the tests check this).

Attention cost. The dense path attends every row over the first ``width`` KV slots, ``width``
bucketed on the longest live row (one graph per bucket); with continuous refill some row is
always near its end, so every row pays for about ``capacity`` keys. The ``kv_lengths`` path
(FlexAttention, default on CUDA) gives each row a block mask of its own filled length
(``pos // 128 + 1`` blocks of 128 keys, updated on the device every step), so a row reads only its
own keys and one graph covers every length. ``compile`` wraps the forward of a step in
``torch.compile`` (Inductor, kernels cached under ``$DFLASH_CACHE/inductor``) before capture.
If compiling or capturing fails, the generator warns and goes on without compile, then (if
that fails too) with the dense attention, restoring the decode state of the failed attempt;
an error of the dense path is raised. The ``batched_kv_lengths`` and ``batched_compile``
settings (:class:`~dflash.kernels.settings.KernelSettings`) turn them off.

Targets: dense full-attention Llama/Qwen2/Qwen3 (see
:func:`dflash.backends.static.backend.supports_static`). Written
for ``dflash data regenerate``; kept backend-level so a batched speculative loop or a server can
reuse the caches and the step (brief §8.2 regenerates training data with a batched server).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dflash.backends.static.graph_plan import allow_recompiles, inductor_cache_dir
from dflash.errors import InputError
from dflash.kernels.settings import ENV
from dflash.models.draft_torch import apply_rope, rope_cos_sin

KV_BLOCK = 128  # keys per FlexAttention block (the kv_lengths path rounds capacity up to it)
_FLEX: dict[str, Any] = {}


def _flex_fn(device: torch.device):
    """FlexAttention: compiled on CUDA (the eager one materializes every score), eager on CPU
    and inside a compiled region (Dynamo inlines it)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda" or torch.compiler.is_compiling():
        return flex_attention
    if "cuda" not in _FLEX:
        inductor_cache_dir()
        _FLEX["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["cuda"]


def length_block_mask(pos: torch.Tensor, capacity: int, block: int = KV_BLOCK, q_len: int = 1):
    """A decode BlockMask over ``capacity`` keys: row r sees keys 0..pos[r] (its own length).

    Grouped-query heads are packed as ``q_len`` queries of one KV head ([B, kv_heads, q_len, D]
    queries, all at pos): FlexAttention's decoding kernel then reads each KV head once (its
    enable_gqa path needs a power-of-two group, SmolLM2 has 3).

    Args:
        pos: [B] int64 position each row's query is at; the mask reads it (and its block count
            buffer, see returns) at every use, so both may be updated in place between steps.
        capacity: keys per row, a multiple of ``block``.
        q_len: queries per (row, KV head): the query heads sharing a KV head (1 without GQA).

    Returns:
        (block_mask, n_blocks): n_blocks [B, 1, 1] int32 is the buffer of visited blocks per
        row; refresh it with :func:`update_blocks` after ``pos`` changes.

    Raises:
        ValueError: capacity not a positive multiple of block.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if capacity < block or capacity % block:
        raise ValueError(f"capacity {capacity} is not a positive multiple of {block}")
    b, nb = pos.shape[0], capacity // block
    n_blocks = torch.ones(b, 1, 1, dtype=torch.int32, device=pos.device)
    idx = torch.arange(nb, dtype=torch.int32, device=pos.device).expand(b, 1, 1, nb).contiguous()

    def causal_to_own_length(b, h, q_idx, kv_idx):
        return kv_idx <= pos[b]

    mask = BlockMask.from_kv_blocks(n_blocks, idx, BLOCK_SIZE=(KV_BLOCK, block),
                                    mask_mod=causal_to_own_length, seq_lengths=(q_len, capacity),
                                    compute_q_blocks=False)  # fmt: skip
    update_blocks(n_blocks, pos, block)
    return mask, n_blocks


def update_blocks(n_blocks: torch.Tensor, pos: torch.Tensor, block: int = KV_BLOCK) -> None:
    """In place: n_blocks [B, 1, 1] = blocks covering keys 0..pos (graphable, no host sync)."""
    n = torch.div(pos, block, rounding_mode="floor") + 1
    n_blocks.copy_(n.to(torch.int32)[:, None, None])


@dataclass
class Job:
    """One generation request.

    Attributes:
        prompt_ids: prompt token ids (chat-templated already).
        max_new_tokens: response budget (tokens), the stop token included.
        temperature: 0 = greedy; > 0 samples from softmax(logits / T) (no top-k/top-p).
    """

    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0


class BatchedGenerator:
    """Continuous-batching decoder over an HF Llama-family model's own modules.

    Args:
        model: HF causal LM (Llama/Qwen2/Qwen3, full attention) on its device, in eval mode.
        max_batch: rows decoded together (B).
        capacity: KV slots per row (prompt + response tokens must fit).
        use_graphs: replay CUDA graphs (CUDA only; ignored on CPU).
        steps_per_sync: decode steps per graph replay / host check.
        kv_bucket: attention reads the first multiple of this many KV slots that covers every
            live row (fewer bytes early in a response; one graph per bucket).
        refill_fraction: prefill new prompts once this share of rows is free (or none is live).
        kv_lengths: attend each row over its own filled length (FlexAttention block mask) instead
            of the longest row's; None = on for CUDA (the ``batched_kv_lengths`` setting).
            Allocates capacity rounded up to 128 slots.
        compile: ``torch.compile`` the forward of a step before graph capture (graphs only);
            None = on with kv_lengths (the ``batched_compile`` setting; the dense path
            compiles once per width bucket, about a minute each, so it is off there).

    Memory: 2 x layers x B x kv_heads x capacity x head_dim elements of the model dtype
    (capacity rounded up to 128 with kv_lengths).
    """

    def __init__(self, model: Any, *, max_batch: int = 256, capacity: int = 2048,
                 use_graphs: bool = True, steps_per_sync: int = 8, kv_bucket: int = 256,
                 refill_fraction: float = 0.125, kv_lengths: bool | None = None,
                 compile: bool | None = None):  # fmt: skip
        if max_batch < 1 or capacity < 2 or steps_per_sync < 1:
            raise InputError("max_batch, capacity and steps_per_sync must be positive.")
        self.model = model
        cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.kv_lengths = self.device.type == "cuda" if kv_lengths is None else bool(kv_lengths)
        self.compile = (self.kv_lengths if compile is None else bool(compile)) and self.use_graphs
        self._compiled: dict[bool, Any] = {}
        self._eager_ok = False
        self.b, self.capacity = max_batch, capacity
        self.steps, self.bucket = steps_per_sync, max(1, kv_bucket)
        self.refill_min = max(1, int(max_batch * refill_fraction))
        self.layers = list(model.model.layers)
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rot = model.model.rotary_emb
        self.inv_freq, self.rope_scale = rot.inv_freq.float(), float(rot.attention_scaling)
        self.embed = model.get_input_embeddings().weight
        dev, b = self.device, max_batch
        slots = -(-capacity // KV_BLOCK) * KV_BLOCK if self.kv_lengths else capacity
        shape = (b, self.kv_heads, slots, self.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in self.layers]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in self.layers]
        self.key_pos = torch.arange(slots, device=dev)
        self.rows = torch.arange(b, device=dev)
        self.tok = torch.zeros(b, dtype=torch.long, device=dev)  # token at position pos
        self.pos = torch.zeros(b, dtype=torch.long, device=dev)
        self.n = torch.zeros(b, dtype=torch.long, device=dev)  # tokens generated so far
        self.limit = torch.ones(b, dtype=torch.long, device=dev)
        self.temp = torch.zeros(b, dtype=torch.float32, device=dev)
        self.live = torch.zeros(b, dtype=torch.bool, device=dev)
        self.done = torch.zeros(b, dtype=torch.bool, device=dev)
        self.out = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.stops = torch.full((1,), -1, dtype=torch.long, device=dev)
        self.sampling = False
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Any]] = {}
        if self.kv_lengths:
            rep = self.heads // self.kv_heads
            self.block_mask, self.n_blocks = length_block_mask(self.pos, slots, q_len=rep)

    # ------------------------------------------------------------------------- forward pieces
    def _qkv(self, layer, h: torch.Tensor, cos, sin):
        """h [R, T, H] -> q [R, heads, T, D], k/v [R, kv_heads, T, D] (rope applied)."""
        a, (r, t, _) = layer.self_attn, h.shape
        q = a.q_proj(h).view(r, t, self.heads, self.head_dim)
        k = a.k_proj(h).view(r, t, self.kv_heads, self.head_dim)
        if hasattr(a, "q_norm"):  # Qwen3
            q, k = a.q_norm(q), a.k_norm(k)
        v = a.v_proj(h).view(r, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin), v

    def _finish_layer(self, layer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Residual adds around o_proj (o [R, T, heads*D]) and the MLP."""
        x = x + layer.self_attn.o_proj(o)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head of h [R, H] -> float32 logits [R, V]."""
        return self.model.lm_head(self.model.model.norm(h)).float()

    def _pick(self, logits: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
        """Greedy rows (temp 0) take the argmax; others sample by the Gumbel-max trick."""
        greedy = logits.argmax(-1)
        if not self.sampling:
            return greedy
        u = torch.rand_like(logits).clamp_(1e-10, 1.0 - 1e-7)
        sampled = (logits / temp.clamp(min=1e-6)[:, None] - torch.log(-torch.log(u))).argmax(-1)
        return torch.where(temp > 0, sampled, greedy)

    @torch.inference_mode()
    def _prefill(self, rows: list[int], prompts: list[list[int]], jobs: list[Job]) -> None:
        """Prefill prompts into the given rows (eager) and pick each row's first token."""
        dev, r = self.device, len(rows)
        t = max(len(p) for p in prompts)
        ids = torch.zeros(r, t, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        ids = ids.to(dev)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        rows_t = torch.tensor(rows, device=dev)
        pos = torch.arange(t, device=dev)[None].expand(r, t)
        cos, sin = rope_cos_sin(pos, self.inv_freq, self.rope_scale, self.dtype)
        x = F.embedding(ids, self.embed)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
            self.k[i][rows_t[:, None], :, pos] = k.transpose(1, 2)  # [r, T, kv_heads, D]
            self.v[i][rows_t[:, None], :, pos] = v.transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.self_attn.scaling,
                                               enable_gqa=self.heads != self.kv_heads)  # fmt: skip
            x = self._finish_layer(layer, x, o.transpose(1, 2).reshape(r, t, -1))
        logits = self._logits(x[torch.arange(r, device=dev), lens - 1])  # [r, V]
        temp = torch.tensor([j.temperature for j in jobs], dtype=torch.float32, device=dev)
        first = self._pick(logits, temp)
        limit = torch.tensor([min(j.max_new_tokens, self.capacity - len(p))
                              for j, p in zip(jobs, prompts, strict=True)], device=dev)  # fmt: skip
        self.tok[rows_t], self.pos[rows_t], self.temp[rows_t] = first, lens, temp
        self.n[rows_t], self.limit[rows_t] = 1, limit
        self.out[rows_t, 0] = first
        self.live[rows_t] = True
        self.done[rows_t] = torch.isin(first, self.stops) | (limit <= 1)

    def _forward(self, width: int) -> torch.Tensor:
        """Forward of one decode step: writes every row's K/V at its position and returns float32
        logits [B, V]; attends over the first ``width`` slots (dense) or each row's own length."""
        b, rep = self.b, self.heads // self.kv_heads
        cos, sin = rope_cos_sin(self.pos[:, None], self.inv_freq, self.rope_scale, self.dtype)
        if not self.kv_lengths:
            bias = torch.zeros(b, width, dtype=torch.float32, device=self.device)
            bias.masked_fill_(self.key_pos[None, :width] > self.pos[:, None], -math.inf)
            bias = bias[:, None, None]  # [B, 1, 1, W]
        x = F.embedding(self.tok[:, None], self.embed)  # [B, 1, H]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
            self.k[i][self.rows, :, self.pos] = k[:, :, 0]
            self.v[i][self.rows, :, self.pos] = v[:, :, 0]
            if self.kv_lengths:
                qg = q.reshape(b, self.kv_heads, rep, self.head_dim)  # GQA packed as q length
                o = _flex_fn(self.device)(qg, self.k[i], self.v[i], block_mask=self.block_mask,
                                          scale=layer.self_attn.scaling)  # fmt: skip
                o = o.reshape(b, 1, -1)
            else:
                qg = q.reshape(b, self.kv_heads, rep, self.head_dim)  # query heads by kv head
                s = (qg @ self.k[i][:, :, :width].transpose(-1, -2)).float()
                s = s * layer.self_attn.scaling
                p = torch.softmax(s + bias, dim=-1).to(self.dtype)  # [B, kv_heads, rep, W]
                o = (p @ self.v[i][:, :, :width]).reshape(b, 1, -1)
            x = self._finish_layer(layer, x, o)
        return self._logits(x[:, 0])

    def _forward_fn(self):
        """The step forward: eager, or wrapped once in ``torch.compile`` (one per attention kind;
        the dense kind recompiles per width bucket)."""
        if not self.compile:
            return self._forward
        if self.kv_lengths not in self._compiled:
            inductor_cache_dir()
            self._compiled[self.kv_lengths] = torch.compile(self._forward, dynamic=False)
        return self._compiled[self.kv_lengths]

    def _step(self, width: int) -> None:
        """One decode step of every row (graphable)."""
        if self.kv_lengths:
            update_blocks(self.n_blocks, self.pos)
        nxt = self._pick(self._forward_fn()(width), self.temp)
        act = self.live & ~self.done
        slot = self.n.clamp(max=self.out.shape[1] - 1)
        self.out[self.rows, slot] = torch.where(act, nxt, self.out[self.rows, slot])
        self.n += act
        self.done |= act & (torch.isin(nxt, self.stops) | (self.n >= self.limit))
        self.tok.copy_(torch.where(act, nxt, self.tok))
        self.pos += act

    def _advance(self, width: int) -> None:
        """``steps_per_sync`` decode steps, replayed from a graph on CUDA. If compiling or
        capturing fails, warns and falls back: first without compile, then to dense attention."""
        if not self.use_graphs:
            saved = [x.clone() for x in self._state()] if self._untried() else None
            try:
                with torch.inference_mode():
                    for _ in range(self.steps):
                        self._step(width)
            except Exception as e:  # noqa: BLE001 - Inductor/Triton raise many types
                if saved is None:
                    raise
                self._fall_back(e, saved)
                return self._advance(width)
            self._eager_ok = True
            return
        key = (width, self.sampling, self.out.shape[1], self.kv_lengths, self.compile)
        if key not in self.graphs:
            saved = [x.clone() for x in self._state()]
            while True:
                try:
                    self.graphs[key] = self._capture(width)
                    break
                except Exception as e:  # noqa: BLE001 - Inductor/Triton/graphs raise many types
                    if not (self.compile or self.kv_lengths):
                        raise
                    self._fall_back(e, saved)
                    key = (width, self.sampling, self.out.shape[1], self.kv_lengths, self.compile)
            for x, s in zip(self._state(), saved, strict=True):
                x.copy_(s)  # the warm-up and the capture advanced the state: undo
        self.graphs[key][0].replay()

    def _untried(self) -> bool:
        """Eager CUDA steps with FlexAttention not yet run once (they may fail to compile)."""
        return self.kv_lengths and self.device.type == "cuda" and not self._eager_ok

    def _fall_back(self, e: Exception, saved: list[torch.Tensor]) -> None:
        """Warn, turn off compile (else kv_lengths attention) and restore the decode state."""
        what = "torch.compile" if self.compile else "kv_lengths attention"
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        print(f"dflash: batched {what} failed ({type(e).__name__}: {msg}); continuing without it "
              f"({ENV['batched_compile']}=0 / {ENV['batched_kv_lengths']}=0 silence this).",
              file=sys.stderr, flush=True)  # fmt: skip
        if self.compile:
            self.compile = False
        else:
            self.kv_lengths = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for x, s in zip(self._state(), saved, strict=True):
            x.copy_(s)

    def _capture(self, width: int):
        """Warm up (twice: compile, lazy inits) on a side stream, then capture the steps."""
        if self.compile:
            allow_recompiles()  # Dynamo's config is per thread; it compiles here

        def body():
            for _ in range(self.steps):
                self._step(width)

        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                body()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            body()
        return graph, body

    def _state(self) -> list[torch.Tensor]:
        return [self.tok, self.pos, self.n, self.done, self.out]

    # ------------------------------------------------------------------------- public API
    def run(self, jobs: Sequence[Job], stop_ids: Sequence[int] = (),
            seed: int | None = None) -> Iterator[tuple[int, list[int]]]:  # fmt: skip
        """Generate every job; yields ``(job index, response ids)`` as rows finish.

        A response ends with (and includes) its first stop token, or after ``max_new_tokens``
        (fewer if prompt + response would exceed ``capacity``). Jobs enter rows in order.

        Raises:
            InputError: an empty prompt or one that leaves no room in ``capacity``.
        """
        for j in jobs:
            if not j.prompt_ids or len(j.prompt_ids) >= self.capacity or j.max_new_tokens < 1:
                raise InputError(f"A prompt of {len(j.prompt_ids)} tokens does not fit the "
                                 f"generator's capacity of {self.capacity} tokens.",
                                 hint="raise the capacity or drop long prompts")  # fmt: skip
        if not jobs:
            return
        if seed is not None:
            torch.manual_seed(seed)
        dev = self.device
        self.stops = torch.tensor(list(stop_ids) or [-1], dtype=torch.long, device=dev)
        self.sampling = any(j.temperature > 0 for j in jobs)
        width_out = max(j.max_new_tokens for j in jobs)
        if self.out.shape[1] != width_out:
            self.out = torch.zeros(self.b, width_out, dtype=torch.long, device=dev)
        self.live.zero_()
        self.done.zero_()
        owner: list[int | None] = [None] * self.b
        free, nxt_job, live = list(range(self.b)), 0, 0
        while nxt_job < len(jobs) or live:
            if nxt_job < len(jobs) and free and (len(free) >= self.refill_min or not live):
                self._prefill_some(free, jobs, nxt_job, owner)
                taken = min(len(free), len(jobs) - nxt_job)
                nxt_job, live, free = nxt_job + taken, live + taken, free[taken:]
            snap = torch.stack((self.pos, self.done.long())).cpu()  # sync
            top = int(snap[0][[r for r in range(self.b) if owner[r] is not None]].max())
            if not bool(snap[1][[r for r in range(self.b) if owner[r] is not None]].all()):
                width = min(self.capacity, -(-(top + self.steps + 1) // self.bucket) * self.bucket)
                if self.kv_lengths:  # one graph for every length; unused by the attention
                    width = self.key_pos.shape[0]
                self._advance(width)
                snap = torch.stack((self.n, self.done.long())).cpu()  # sync
            else:
                snap = torch.stack((self.n, self.done.long())).cpu()
            finished = [r for r in range(self.b) if owner[r] is not None and snap[1][r]]
            if finished:
                outs = self.out[finished].cpu()
                for i, r in enumerate(finished):
                    yield owner[r], outs[i, : int(snap[0][r])].tolist()  # type: ignore[misc]
                    owner[r] = None
                    self.live[r] = False
                    free.append(r)
                live -= len(finished)

    def _prefill_some(self, free: list[int], jobs: Sequence[Job], start: int,
                      owner: list[int | None]) -> None:  # fmt: skip
        """Prefill the next jobs into free rows, in chunks of about 64 k prompt tokens."""
        take = list(range(start, min(len(jobs), start + len(free))))
        lo = 0
        while lo < len(take):
            hi, width = lo, 0
            while hi < len(take):
                width = max(width, len(jobs[take[hi]].prompt_ids))
                if hi > lo and (hi - lo + 1) * width > 65536:
                    break
                hi += 1
            chunk = take[lo:hi]
            rows = free[lo:hi]
            self._prefill(rows, [jobs[j].prompt_ids for j in chunk], [jobs[j] for j in chunk])
            for r, j in zip(rows, chunk, strict=True):
                owner[r] = j
            lo = hi

    def generate(self, prompts: Sequence[list[int]], max_new_tokens: int,
                 stop_ids: Sequence[int] = (), temperature: float = 0.0) -> list[list[int]]:  # fmt: skip
        """Convenience: responses of ``prompts`` in input order (see :meth:`run`)."""
        res: list[list[int]] = [[] for _ in prompts]
        jobs = [Job(list(p), max_new_tokens, temperature) for p in prompts]
        for i, toks in self.run(jobs, stop_ids):
            res[i] = toks
        return res
