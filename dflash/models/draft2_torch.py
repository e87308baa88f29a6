"""The DFlash2 draft in PyTorch (brief §4): v1 layers wrapped in dynamic in-block convolutions,
plus a candidate selector that walks one coherent path through per-position top-k candidates.

Everything else (context projection, attention with context K/V injection, RoPE, masks, cache,
shared embedding and LM head) is the v1 draft of :mod:`dflash.models.draft_torch`, reused here.
Tensor names follow the published checkpoints (brief §1.2), except that the two selector
codebooks are stored without a ``.weight`` suffix; :mod:`dflash.models.draft2_names` maps
between the two (brief §4.3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.errors import ConfigError
from dflash.models import draft2_names
from dflash.models.config import DraftConfig
from dflash.models.draft_torch import DFlashDraft, DraftLayer


class GroupedDynamicCausalConv(nn.Module):
    """Two grouped causal convolutions over the block, with per-position dynamic taps (§4.1).

    ``y[t] = sum_{o<K} (base[o] * x[t-o] + dyn[t, o, g] * x[t-o])`` with ``x[t-o] = 0`` for
    ``t < o``; ``base[o]`` is per channel, ``dyn[t, o, g]`` one scalar per position, tap and
    group of G consecutive channels. The sequence given is the block only (context rows never
    pass through it). ``prepare`` convolves the sublayer input with kernel 0 and also returns the
    dynamic taps of kernel 1, computed from that same input, which ``finish`` applies to the
    sublayer output.

    Args:
        hidden: H channels; group_size G must divide it.
        kernel_size: K taps.
        group_size: G channels per dynamic tap weight.
    """

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.groups = (
            kernel_size,
            group_size,
            hidden // group_size,
        )
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0  # identity until trained: prepare/finish pass x through
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)

    def conv(self, x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor,
             period: int | None = None) -> torch.Tensor:  # fmt: skip
        """x [B, T, H], dyn [B, T, K, H/G] (taps per output position), base [K, H] -> [B, T, H].

        ``period``: the T rows are T / period blocks of ``period`` rows each (the packed
        training layout), convolved one by one (a block never sees the block before it);
        None: the rows are one block.
        """
        b, t, h = x.shape
        if period is not None and period != t:
            n = t // period
            xs, ds = x.reshape(b * n, period, h), dyn.reshape(b * n, period, *dyn.shape[2:])
            y = self.conv(xs, ds, base)
            return y.reshape(b, t, h)
        y = torch.zeros_like(x)
        for o in range(min(self.kernel_size, t)):
            xs = x if o == 0 else F.pad(x, (0, 0, o, 0))[:, :t]  # xs[:, s] = x[:, s - o]
            grouped = xs.reshape(b, t, self.groups, self.group_size) * dyn[:, :, o, :, None]
            y = y + xs * base[o] + grouped.reshape(b, t, h)
        return y

    def prepare(self, x: torch.Tensor, period: int | None = None):
        """x [B, T, H] sublayer input -> (conv with kernel 0 [B, T, H], kernel-1 taps
        [B, T, K, H/G]); ``period`` as :meth:`conv`."""
        b, t, _ = x.shape
        dyn = self.kernel_projection(x).reshape(b, t, 2, self.kernel_size, self.groups)
        return self.conv(x, dyn[:, :, 0], self.base_kernel[0], period), dyn[:, :, 1]

    def finish(self, y: torch.Tensor, dyn: torch.Tensor, period: int | None = None) -> torch.Tensor:
        """y [B, T, H] sublayer output, dyn from :meth:`prepare` -> [B, T, H]."""
        return self.conv(y, dyn, self.base_kernel[1], period)


class DFlash2Layer(DraftLayer):
    """v1 decoder layer with a dynamic convolution around attention and around the MLP (§4.1)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg)
        s = cfg.dflash2
        self.attention_conv = GroupedDynamicCausalConv(
            cfg.hidden_size, s.conv_kernel_size, s.conv_group_size
        )
        self.mlp_conv = GroupedDynamicCausalConv(
            cfg.hidden_size, s.conv_kernel_size, s.conv_group_size
        )

    def forward(self, h, ctx, q_rope, ctx_rope, mask, cache, idx, period: int | None = None):
        """As the v1 layer; ``period``: rows per block when several blocks are packed (training)."""
        a, k1 = self.attention_conv.prepare(self.input_layernorm(h), period)
        h = h + self.attention_conv.finish(
            self.self_attn(a, ctx, q_rope, ctx_rope, mask, cache, idx), k1, period
        )
        m, k2 = self.mlp_conv.prepare(self.post_attention_layernorm(h), period)
        return h + self.mlp_conv.finish(self.mlp(m), k2, period)


class CandidateSelector(nn.Module):
    """Pairwise path selector over per-position top-k candidates (brief §4.2).

    Score of candidate j at draft position i given the previous pick ``prev`` (the anchor at
    i = 0): ``u[i, j] + sum_r pred[prev, r] * h'[i, r] * succ[c[i, j], r]`` with ``u`` the draft
    logits of the candidates and ``h' = hidden_projection(hidden)``. Computed in float32.

    Args:
        hidden: H; vocab: V (codebook rows); rank: r; top_k: k candidates per position.
    """

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, T, V] -> (candidate ids [B, T, k] int64, unary scores [B, T, k] float32)."""
        unary, ids = torch.topk(logits.float(), min(self.top_k, logits.shape[-1]), dim=-1)
        return ids, unary

    def edges(self, hidden: torch.Tensor, cand: torch.Tensor, anchor: torch.Tensor):
        """Edge scores of every candidate pair of neighbouring positions.

        Args:
            hidden: [B, T, H] draft hidden states of the draft positions.
            cand: [B, T, k] candidate ids; anchor: [B] token ids before position 0.

        Returns:
            (first [B, k]: anchor -> candidates of position 0,
             trans [B, T-1, k, k]: trans[:, i, a, b] = candidate a at i -> candidate b at i+1).
        """
        hp = self.hidden_projection(hidden).float()  # [B, T, r]
        pred = self.predecessor_codebook(cand).float()  # [B, T, k, r]
        succ = self.successor_codebook(cand).float()
        first = torch.einsum(
            "br,bkr->bk", self.predecessor_codebook(anchor).float() * hp[:, 0], succ[:, 0]
        )
        trans = torch.einsum("blar,blcr->blac", pred[:, :-1] * hp[:, 1:, None], succ[:, 1:])
        return first, trans

    @staticmethod
    def walk(unary: torch.Tensor, first: torch.Tensor, trans: torch.Tensor,
             temperature: float = 0.0, generator: torch.Generator | None = None):  # fmt: skip
        """Left-to-right walk over the candidates: argmax at T = 0, ancestral sampling at T > 0
        (:func:`select_walk` with [B, T] uniforms drawn from ``generator``).

        Args:
            unary: [B, T, k]; first: [B, k]; trans: [B, T-1, k, k] (see :meth:`edges`).
            temperature: 0 = greedy; > 0 = sample from softmax(score / temperature).
            generator: torch RNG for the draws (None = the global one).

        Returns:
            (picks [B, T] int64 candidate slots, q [B, T, k] float32 or None at T = 0): q[:, i]
            is the distribution pick i was drawn from, given picks 0..i-1.
        """
        if temperature <= 0:
            return select_walk(unary, first, trans)
        u = torch.rand(unary.shape[:2], generator=generator, device=unary.device)
        return select_walk(unary, first, trans, u, temperature)

    def forward(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
                temperature: float = 0.0, generator: torch.Generator | None = None):  # fmt: skip
        """Select one path.

        Args:
            hidden: [B, T, H] draft hidden states of the T = L-1 draft positions.
            logits: [B, T, V] processed draft logits of those positions.
            anchor: [B] the anchor token ids.

        Returns:
            (path tokens [B, T] int64, candidate ids [B, T, k], q [B, T, k] or None at T = 0).
        """
        cand, unary = self.candidates(logits)
        first, trans = self.edges(hidden, cand, anchor)
        picks, q = self.walk(unary, first, trans, temperature, generator)
        return cand.gather(-1, picks[..., None])[..., 0], cand, q


def select_walk(unary: torch.Tensor, first: torch.Tensor, trans: torch.Tensor,
                uniforms: torch.Tensor | None = None, temperature: float | torch.Tensor = 1.0):  # fmt: skip
    """The selector's walk as fixed-shape tensor ops (no host sync: it runs inside a CUDA graph).

    Step i scores candidate j as ``unary[:, i, j]`` plus the edge from the previous pick
    (``first`` at i = 0, ``trans[:, i-1, prev, j]`` after); greedy takes the argmax (the first
    on ties), sampling draws from q = softmax(score / temperature) by inverse CDF: the first
    slot whose cumulative mass exceeds ``u * total`` (as :func:`dflash.accept.draw`).

    Args:
        unary: [B, T, k]; first: [B, k]; trans: [B, T-1, k, k] (see :meth:`CandidateSelector.edges`).
        uniforms: [B, >= T] uniforms in [0, 1), one per position; None = greedy.
        temperature: > 0, a float or a tensor broadcasting against [B, 1] (a graph input).

    Returns:
        (picks [B, T] int64 candidate slots, q [B, T, k] float32, or None when greedy).
    """
    b, t, k = unary.shape
    picks, qs = [], []
    score = unary[:, 0] + first
    for i in range(t):
        if i:
            prev = picks[-1][:, None, None].expand(b, 1, k)
            score = unary[:, i] + trans[:, i - 1].gather(1, prev)[:, 0]
        if uniforms is None:
            picks.append(score.argmax(-1))
            continue
        q = torch.softmax(score / temperature, dim=-1)
        cdf = q.cumsum(-1)
        below = (cdf <= uniforms[:, i : i + 1] * cdf[:, -1:]).sum(-1)
        picks.append(below.clamp(max=k - 1))
        qs.append(q)
    return torch.stack(picks, 1), (torch.stack(qs, 1) if qs else None)


class DFlash2Draft(DFlashDraft):
    """DFlash2 draft: v1 context projection and attention, :class:`DFlash2Layer` layers and a
    :class:`CandidateSelector` (brief §4). One block per forward (the convolutions run over the
    given block; the packed training layout of ``dflash train`` is convolved block by block).

    Args:
        cfg: a DFlash2 draft configuration (``cfg.dflash2`` set).

    Raises:
        ConfigError: a v1 configuration.
    """

    layer_class = DFlash2Layer
    is_dflash2 = True

    def __init__(self, cfg: DraftConfig):
        if cfg.dflash2 is None:
            raise ConfigError(
                "DFlash2Draft needs a DFlash2 config (architectures DFlash2DraftModel)."
            )
        super().__init__(cfg)
        s = cfg.dflash2
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, s.selector_rank,
                                                    s.selector_top_k)  # fmt: skip

    @property
    def embed_scale(self) -> float:
        """Factor applied to the raw target embeddings of the block (brief §1.4)."""
        return float(self.config.dflash2.input_embedding_scale)

    def forward(self, block_embeds, target_hidden, q_pos, ctx_pos, cache=None, masks=None,
                packed: bool = False):  # fmt: skip
        """As :meth:`DFlashDraft.forward`, with the in-block convolutions.

        Args:
            packed: the Lq block rows are Lq / block_size blocks of block_size rows each (the
                training layout of :func:`dflash.train.masks.build_blocks`, ``masks`` given):
                each block is convolved on its own. False: the rows are one block (inference,
                any width).

        Raises:
            ConfigError: ``packed`` without masks, or Lq not a multiple of the block size.
        """
        period = None
        if packed:
            period = self.config.block_size
            if masks is None or block_embeds.shape[1] % period:
                raise ConfigError(f"A packed DFlash2 forward needs masks and whole blocks of "
                                  f"{period} rows, got {block_embeds.shape[1]} rows.")  # fmt: skip
        return self._forward(block_embeds, target_hidden, q_pos, ctx_pos, cache, masks, period)

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Output multiplier, then ``cap * tanh(logits / cap)`` when a soft cap is set (§1.4)."""
        s = self.config.dflash2
        logits = logits.float()
        if s.output_multiplier != 1.0:
            logits = logits * s.output_multiplier
        if s.final_logit_softcapping > 0:
            cap = s.final_logit_softcapping
            logits = cap * torch.tanh(logits / cap)
        return logits

    def propose(self, hidden: torch.Tensor, anchor: torch.Tensor, head: nn.Module,
                temperature: float = 0.0, generator: torch.Generator | None = None):  # fmt: skip
        """Proposals from the draft's hidden states of the draft positions (brief §4.3).

        Args:
            hidden: [B, L-1, H] final-normed hidden states of block positions 1..L-1.
            anchor: [B] anchor token ids; head: the target's LM head (H -> V).
            temperature: 0 = greedy walk; > 0 = ancestral sampling (temperature only, no
                top-k/top-p, brief §3.6).

        Returns:
            (tokens [B, L-1], candidate ids [B, L-1, k], q [B, L-1, k] float32 or None).
        """
        logits = self.process_logits(head(hidden))
        return self.candidate_selector(hidden, logits, anchor, temperature, generator)

    @torch.no_grad()
    def start_dflash2_parts(self) -> None:
        """The starting point of the DFlash2 parts for training: every convolution passes its
        input through (base tap 0 = 1, other taps and the dynamic-tap projection 0) and the
        selector's edge scores are 0 (hidden projection 0, codebooks ~ N(0, 1)), so the draft
        proposes what its v1 layers alone would. Neither part is stuck: the zero factors get
        gradients from the non-zero ones."""
        for layer in self.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0
                conv.kernel_projection.weight.zero_()
        sel = self.candidate_selector
        sel.hidden_projection.weight.zero_()
        sel.predecessor_codebook.weight.normal_(0.0, 1.0)
        sel.successor_codebook.weight.normal_(0.0, 1.0)

    @classmethod
    def from_v1(cls, v1: DFlashDraft, seed: int = 0) -> DFlash2Draft:
        """A DFlash2 draft that starts as the DFlash v1 draft ``v1`` (for training it further):
        v1's weights, the published DFlash2 settings and :meth:`start_dflash2_parts`, so its
        greedy proposals are v1's."""
        import copy

        from dflash.models.config import DFlash2Settings

        cfg = copy.deepcopy(v1.config)
        cfg.dflash2 = DFlash2Settings()
        cfg.validate()
        torch.manual_seed(seed)
        with torch.device(next(v1.parameters()).device):
            model = cls(cfg)
        model.start_dflash2_parts()
        missing, unexpected = model.load_state_dict(v1.state_dict(), strict=False)
        assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing)
        model.draft_vocab = getattr(v1, "draft_vocab", None)
        return model.to(next(v1.parameters()).dtype)

    # published <-> module names (the codebooks' ``.weight``, brief §4.3), shared with MLX
    checkpoint_names = staticmethod(draft2_names.checkpoint_names)
    module_names = staticmethod(draft2_names.module_names)
