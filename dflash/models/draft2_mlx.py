"""The DFlash2 draft in MLX: the same checkpoint as :mod:`dflash.models.draft2_torch`.

v1 layers (:mod:`dflash.models.draft_mlx`) wrapped in dynamic in-block convolutions, and the
candidate selector on the device: the top-k candidates of every draft position, the low-rank
pairwise scores and the left-to-right walk are mlx operations, so the proposals (and, when
sampling, the selector's q) stay on the device until the loop reads them. The maths, the order
of the candidates (top-k by logit, descending) and the parameter names are those of the torch
draft; the two codebooks are stored without a ``.weight`` suffix in checkpoints
(:mod:`dflash.models.draft2_names`). :func:`load_any_draft_mlx` picks the class from
``config.json`` (as :func:`dflash.models.draft_load.load_draft` does for torch).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from dflash.errors import ConfigError
from dflash.models import draft2_names
from dflash.models.config import DraftConfig
from dflash.models.draft_mlx import DFlashDraftMLX, DraftLayer, load_draft_mlx


class GroupedDynamicCausalConv(nn.Module):
    """Two grouped causal convolutions over the block with per-position dynamic taps.

    ``y[t] = sum_{o<K} (base[o] * x[t-o] + dyn[t, o, g] * x[t-o])``, ``x[t-o] = 0`` for t < o;
    ``base[o]`` per channel, ``dyn[t, o, g]`` one scalar per position, tap and group of G
    channels (:class:`dflash.models.draft2_torch.GroupedDynamicCausalConv`).

    Args:
        hidden: H channels; group_size G divides it; kernel_size: K taps.
    """

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.groups = (
            kernel_size,
            group_size,
            hidden // group_size,
        )
        base = mx.zeros((2, kernel_size, hidden))
        base[:, 0] = 1.0  # identity until trained
        self.base_kernel = base
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)

    def conv(self, x: mx.array, dyn: mx.array, base: mx.array) -> mx.array:
        """x [B, T, H], dyn [B, T, K, H/G], base [K, H] -> [B, T, H]."""
        b, t, h = x.shape
        y = mx.zeros_like(x)
        for o in range(min(self.kernel_size, t)):
            xs = x if o == 0 else mx.pad(x, [(0, 0), (o, 0), (0, 0)])[:, :t]  # xs[:, s] = x[:, s-o]
            grouped = xs.reshape(b, t, self.groups, self.group_size) * dyn[:, :, o, :, None]
            y = y + xs * base[o] + grouped.reshape(b, t, h)
        return y

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x [B, T, H] -> (conv with kernel 0 [B, T, H], kernel-1 taps [B, T, K, H/G])."""
        b, t, _ = x.shape
        dyn = self.kernel_projection(x).reshape(b, t, 2, self.kernel_size, self.groups)
        return self.conv(x, dyn[:, :, 0], self.base_kernel[0]), dyn[:, :, 1]

    def finish(self, y: mx.array, dyn: mx.array) -> mx.array:
        """y [B, T, H] sublayer output, dyn from :meth:`prepare` -> [B, T, H]."""
        return self.conv(y, dyn, self.base_kernel[1])


class DFlash2Layer(DraftLayer):
    """v1 decoder layer with a dynamic convolution around attention and around the MLP."""

    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg)
        s = cfg.dflash2
        self.attention_conv = GroupedDynamicCausalConv(
            cfg.hidden_size, s.conv_kernel_size, s.conv_group_size
        )
        self.mlp_conv = GroupedDynamicCausalConv(
            cfg.hidden_size, s.conv_kernel_size, s.conv_group_size
        )

    def __call__(self, h, ctx, *args):
        a, k1 = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(a, ctx, *args), k1)
        m, k2 = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(m), k2)


def _greedy_walk(unary: mx.array, first: mx.array, trans: mx.array) -> mx.array:
    """Picks [T] int32 of the greedy walk (see :meth:`CandidateSelector.walk`)."""
    picks = [mx.argmax(unary[0] + first).astype(mx.int32)]
    for i in range(1, unary.shape[0]):
        picks.append(
            mx.argmax(unary[i] + mx.take(trans[i - 1], picks[-1], axis=0)).astype(mx.int32)
        )
    return mx.stack(picks)


_GREEDY_WALK = mx.compile(_greedy_walk)  # one graph per number of rows


class CandidateSelector(nn.Module):
    """Pairwise path selector over per-position top-k candidates, on the device.

    Score of candidate j at draft position i after the previous pick ``prev`` (the anchor at
    i = 0): ``u[i, j] + sum_r pred[prev, r] * h'[i, r] * succ[c[i, j], r]``, ``u`` the processed
    draft logits of the candidates, ``h' = hidden_projection(hidden)``; float32.

    Args:
        hidden: H; vocab: V (codebook rows); rank: r; top_k: k candidates per position.
    """

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)

    def candidates(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """logits [T, V] float32 -> (ids [T, k] int32, unary [T, k] float32), by logit
        descending (as ``torch.topk``)."""
        k = min(self.top_k, logits.shape[-1])
        part = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]  # the top k, unordered
        vals = mx.take_along_axis(logits, part, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        ids = mx.take_along_axis(part, order, axis=-1).astype(mx.int32)
        return ids, mx.take_along_axis(vals, order, axis=-1)

    def edges(
        self, hidden: mx.array, cand: mx.array, anchor: mx.array
    ) -> tuple[mx.array, mx.array]:
        """(first [k]: anchor -> candidates of position 0, trans [T-1, k, k]: trans[i, a, b] =
        candidate a at i -> candidate b at i+1) for hidden [T, H], cand [T, k], anchor [1]."""
        hp = self.hidden_projection(hidden).astype(mx.float32)  # [T, r]
        pred = self.predecessor_codebook(cand).astype(mx.float32)  # [T, k, r]
        succ = self.successor_codebook(cand).astype(mx.float32)
        a = self.predecessor_codebook(anchor.reshape(1)).astype(mx.float32)[0]  # [r]
        first = (a * hp[0]) @ succ[0].T  # [k]
        trans = (pred[:-1] * hp[1:, None]) @ succ[1:].transpose(0, 2, 1)  # [T-1, k, k]
        return first, trans

    @staticmethod
    def walk(unary: mx.array, first: mx.array, trans: mx.array, temperature: float = 0.0,
             key: mx.array | None = None) -> tuple[mx.array, mx.array | None]:  # fmt: skip
        """Left-to-right walk: argmax at temperature 0, ancestral sampling above.

        Args:
            unary: [T, k]; first: [k]; trans: [T-1, k, k] (see :meth:`edges`).
            temperature: 0 = greedy; > 0 = draw from softmax(score / temperature).
            key: mlx PRNG key of the draws (None = mlx's global generator).

        Returns:
            (picks [T] int32 candidate slots, q [T, k] float32 or None at temperature 0): q[i]
            is the distribution pick i was drawn from, given picks 0..i-1.
        """
        if temperature <= 0:
            return _GREEDY_WALK(unary, first, trans), None
        t = unary.shape[0]
        keys = mx.random.split(key, t) if key is not None else [None] * t
        picks, qs = [], []
        score = unary[0] + first
        for i in range(t):
            if i:
                score = unary[i] + mx.take(trans[i - 1], picks[-1], axis=0)
            logits = score / temperature
            qs.append(mx.softmax(logits, axis=-1))
            picks.append(mx.random.categorical(logits, key=keys[i]).astype(mx.int32))
        return mx.stack(picks), mx.stack(qs)

    def __call__(self, hidden: mx.array, logits: mx.array, anchor: mx.array, temperature: float = 0.0,
                 key: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array | None]:  # fmt: skip
        """(path tokens [T] int32, candidate ids [T, k], q [T, k] or None) for hidden [T, H],
        processed logits [T, V] and anchor [1]."""
        cand, unary = self.candidates(logits)
        first, trans = self.edges(hidden, cand, anchor)
        picks, q = self.walk(unary, first, trans, temperature, key)
        return mx.take_along_axis(cand, picks[:, None], axis=-1)[:, 0], cand, q


class DFlash2DraftMLX(DFlashDraftMLX):
    """DFlash2 draft in MLX: v1 context projection and attention, :class:`DFlash2Layer` layers
    and a :class:`CandidateSelector`. One block per forward (the convolutions run over it).

    Raises:
        ConfigError: a v1 configuration.
    """

    layer_class = DFlash2Layer
    is_dflash2 = True

    def __init__(self, cfg: DraftConfig, window: int | None = None):
        if cfg.dflash2 is None:
            raise ConfigError(
                "DFlash2DraftMLX needs a DFlash2 config (architectures DFlash2DraftModel)."
            )
        super().__init__(cfg, window=window)
        s = cfg.dflash2
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, s.selector_rank,
                                                    s.selector_top_k)  # fmt: skip

    @property
    def embed_scale(self) -> float:
        """Factor on the raw target embeddings of the block."""
        return float(self.config.dflash2.input_embedding_scale)

    def process_logits(self, logits: mx.array) -> mx.array:
        """float32, times the output multiplier, then ``cap * tanh(logits / cap)`` if capped."""
        s = self.config.dflash2
        logits = logits.astype(mx.float32)
        if s.output_multiplier != 1.0:
            logits = logits * s.output_multiplier
        if s.final_logit_softcapping > 0:
            cap = s.final_logit_softcapping
            logits = cap * mx.tanh(logits / cap)
        return logits

    def propose(self, hidden: mx.array, anchor: mx.array, head, temperature: float = 0.0,
                key: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array | None]:  # fmt: skip
        """Proposals from the final-normed hidden states [R, H] of draft positions 1..R.

        The walk is causal (pick i depends on positions <= i only), so R < L-1 rows give the
        first R proposals of the full block.

        Args:
            anchor: [1] anchor token id; head: the target's LM head (H -> V).
            temperature: 0 = greedy walk; > 0 = ancestral sampling (temperature only).
            key: mlx PRNG key for the draws.

        Returns:
            (tokens [R] int32, candidate ids [R, k] int32, q [R, k] float32 or None).
        """
        logits = self.process_logits(head(hidden))
        return self.candidate_selector(hidden, logits, anchor, temperature, key)

    # checkpoint <-> module names (the codebooks' ``.weight``), shared with the torch draft
    module_names = staticmethod(draft2_names.module_names)
    checkpoint_names = staticmethod(draft2_names.checkpoint_names)


def load_any_draft_mlx(folder: str | Path, **kwargs) -> DFlashDraftMLX:
    """A :class:`DFlashDraftMLX` or :class:`DFlash2DraftMLX`, as ``config.json`` says
    (keyword arguments as :func:`dflash.models.draft_mlx.load_draft_mlx`).

    Raises:
        CheckpointError, ConfigError, InputError: as :func:`load_draft_mlx`.
    """
    cfg = DraftConfig.load(Path(folder))
    cls = DFlash2DraftMLX if cfg.is_dflash2 else DFlashDraftMLX
    return load_draft_mlx(folder, model_class=cls, **kwargs)
