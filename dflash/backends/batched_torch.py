"""Batched plain decoding of a target with static KV caches and CUDA graphs (continuous batching).

    gen = BatchedGenerator(model, max_batch=512, capacity=2048)
    for job, tokens in gen.run([Job(prompt_ids, max_new_tokens=512, temperature=0.0), ...], stops):
        ...

B rows decode one token per step. Each row holds one job (a prompt and its budget) at its own
positions 0..n-1: a prompt is prefilled into a free row (right-padded with other new prompts,
causal attention, so padding is never seen), then every step writes K/V at the row's own
position and attends to keys at positions <= it. Rows whose job ended (a stop token or the
budget) are refilled with the next prompts, so long and short answers share the batch without a
tail. On CUDA one graph per KV-length bucket replays ``steps_per_sync`` decode steps; the host
syncs once per replay to collect finished rows. The same code runs eagerly on CPU, where every
row's float32 output equals that row decoded alone (the tests check this).

Targets: dense full-attention Llama/Qwen2/Qwen3 (see ``static_torch.supports_static``). Written
for ``dflash data regenerate``; kept backend-level so a batched speculative loop or a server can
reuse the caches and the step (brief §8.2 regenerates training data with a batched server).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dflash.errors import InputError
from dflash.models.draft_torch import apply_rope, rope_cos_sin


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

    Memory: 2 x layers x B x kv_heads x capacity x head_dim elements of the model dtype.
    """

    def __init__(self, model: Any, *, max_batch: int = 256, capacity: int = 2048,
                 use_graphs: bool = True, steps_per_sync: int = 8, kv_bucket: int = 256,
                 refill_fraction: float = 0.125):  # fmt: skip
        if max_batch < 1 or capacity < 2 or steps_per_sync < 1:
            raise InputError("max_batch, capacity and steps_per_sync must be positive.")
        self.model = model
        cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.use_graphs = use_graphs and self.device.type == "cuda"
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
        shape = (b, self.kv_heads, capacity, self.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in self.layers]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in self.layers]
        self.key_pos = torch.arange(capacity, device=dev)
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

    def _step(self, width: int) -> None:
        """One decode step of every row, attending to the first ``width`` KV slots (graphable)."""
        b, rep = self.b, self.heads // self.kv_heads
        cos, sin = rope_cos_sin(self.pos[:, None], self.inv_freq, self.rope_scale, self.dtype)
        bias = torch.zeros(b, width, dtype=torch.float32, device=self.device)
        bias.masked_fill_(self.key_pos[None, :width] > self.pos[:, None], -math.inf)
        bias = bias[:, None, None]  # [B, 1, 1, W]
        x = F.embedding(self.tok[:, None], self.embed)  # [B, 1, H]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
            self.k[i][self.rows, :, self.pos] = k[:, :, 0]
            self.v[i][self.rows, :, self.pos] = v[:, :, 0]
            qg = q.reshape(b, self.kv_heads, rep, self.head_dim)  # query heads grouped by kv head
            s = (qg @ self.k[i][:, :, :width].transpose(-1, -2)).float() * layer.self_attn.scaling
            p = torch.softmax(s + bias, dim=-1).to(self.dtype)  # [B, kv_heads, rep, W]
            o = (p @ self.v[i][:, :, :width]).reshape(b, 1, -1)
            x = self._finish_layer(layer, x, o)
        nxt = self._pick(self._logits(x[:, 0]), self.temp)
        act = self.live & ~self.done
        slot = self.n.clamp(max=self.out.shape[1] - 1)
        self.out[self.rows, slot] = torch.where(act, nxt, self.out[self.rows, slot])
        self.n += act
        self.done |= act & (torch.isin(nxt, self.stops) | (self.n >= self.limit))
        self.tok.copy_(torch.where(act, nxt, self.tok))
        self.pos += act

    def _advance(self, width: int) -> None:
        """``steps_per_sync`` decode steps, replayed from a graph on CUDA."""
        if not self.use_graphs:
            with torch.inference_mode():
                for _ in range(self.steps):
                    self._step(width)
            return
        key = (width, self.sampling, self.out.shape[1])
        if key not in self.graphs:

            def body():
                for _ in range(self.steps):
                    self._step(width)

            saved = [x.clone() for x in self._state()]
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), torch.inference_mode():
                body()  # warm-up outside the graph
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph):
                body()
            for x, s in zip(self._state(), saved, strict=True):
                x.copy_(s)  # the warm-up and the capture advanced the state: undo
            self.graphs[key] = (graph, body)
        self.graphs[key][0].replay()

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
