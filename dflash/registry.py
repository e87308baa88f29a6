"""The published DFlash drafts, by target: ``dflash models`` and ``--model X`` without ``--draft``.

    dflash models                     # the table: target, draft, family, block size, what runs it
    dflash generate transformers -m Qwen/Qwen3-8B "Hi"   # uses z-lab/Qwen3-8B-DFlash-b16

The pairs are the ones the DFlash authors publish on the Hugging Face hub (their README and model
cards); the draft ids follow the authors' naming and are worth checking on the hub card before a
large download. What runs each family here follows from what the backends accept today:

- transformers, CUDA-graph path: ``llama``, ``qwen2``, ``qwen3``, ``mistral`` and ``qwen3_moe``
  targets, full-attention, sliding-window or interleaved layers (a window is a position mask
  over the static cache), dense MLPs or top-k expert blocks
  (:func:`dflash.backends.static.support.supports_static`); ``gpt_oss`` (attention sinks, its
  expert blocks as bf16 tensors), ``gemma3_text`` and ``gemma4`` text models (wrappers load their
  text model) through their own forward (:mod:`dflash.backends.static.families`); a wrapper whose
  text model has no causal LM class (Muse-Glimmer) runs on the plain path; the GatedDeltaNet hybrids
  ``qwen3_next``, ``qwen3_5``, ``qwen3_5_moe`` through theirs (:mod:`dflash.backends.static.hybrid`).
- transformers, plain path (CPU, or CUDA without graphs): full-attention and sliding-window
  causal LMs, dense or MoE (``qwen3_moe``, ``gemma4``, ``gpt_oss``), the GatedDeltaNet hybrids
  ``qwen3_next``, ``qwen3_5`` and ``qwen3_5_moe`` (:mod:`dflash.backends.gdn_torch`), multimodal
  wrappers for text prompts; chunked attention and other recurrent layers are refused
  (:func:`dflash.models.target_torch.check_target_layers`).
- mlx: full-attention KV caches, the rotating (sliding-window) caches of mlx-lm's
  ``gemma3_text``, ``gemma4_text``/``gemma4`` and ``gpt_oss`` models
  (:mod:`dflash.backends.mlx_rotating`), and the GatedDeltaNet hybrids of mlx-lm's
  ``qwen3_next`` and ``qwen3_5`` modules (``qwen3_5_moe`` reuses the latter); other cache kinds
  are refused (:func:`dflash.backends.mlx.check_caches`). Other families with windows are
  untested there (mlx-lm's own model decides whether it keeps a window: its qwen2/qwen3 do not).

Torch-free and mlx-free: the CLI imports it before anything heavy.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import typer

# what each backend path does with a family: "yes", "no: <why>" or "untested: <why>"
SLIDING = ("no: a multimodal wrapper whose text model has no causal LM class "
           "(the plain transformers path runs it)")
SLIDING_MLX = ("untested: rotating (sliding-window) caches roll back exactly on mlx (tiny gemma3, "
               "gemma4 and gpt-oss targets tested), this family's mlx-lm model was not run")
HYBRID_GRAPHS = ("untested: GatedDeltaNet layers in the graphs (tiny targets checked on the CPU without "
                 "graphs; scripts/gpu_check_hybrid.py checks CUDA)")


@dataclass(frozen=True)
class Pair:
    """One published target/draft pair.

    Attributes:
        target: the target's hub id.
        draft: the DFlash draft's hub id.
        family: the target's ``model_type`` (text model); ``?`` marks an unconfirmed one.
        block_size: the draft's trained block size L (tokens per verify, anchor included) as
            published; None where only the draft's config.json says.
        arch: ``dflash`` (v1) or ``dflash2``.
        layers: what the target's layers need (dense/MoE, full attention, sliding, hybrid).
        note: a remark for users (thinking mode, quantization advice); may be empty.
    """

    target: str
    draft: str
    family: str
    block_size: int | None
    arch: str
    layers: str
    note: str = ""

    def runs(self) -> dict[str, str]:
        """What runs this pair here today, per backend path: ``cuda_graphs`` (transformers on
        CUDA), ``transformers`` (the plain path, CPU or CUDA), ``mlx``; each value is ``yes``,
        ``no: <why>`` or ``untested: <why>``."""
        return family_support(self.family, self.layers)

    def to_dict(self) -> dict:
        return {**asdict(self), "runs": self.runs()}


def family_support(family: str, layers: str = "") -> dict[str, str]:
    """Per backend path (``cuda_graphs``, ``transformers``, ``mlx``): ``yes``, ``no: <why>`` or
    ``untested: <why>`` for a target ``model_type`` (a trailing ``?`` marks it unconfirmed)
    whose layers ``layers`` describes (sliding-window layers run on the plain transformers path)."""
    base = family.rstrip(" ?")
    sliding = "sliding" in layers
    if base in ("llama", "qwen2", "qwen3", "mistral"):  # windows too: a mask on the graph path
        return {"cuda_graphs": "yes", "transformers": "yes", "mlx": SLIDING_MLX if sliding else "yes"}
    if base == "qwen3_moe":
        return {"cuda_graphs": "yes", "transformers": "yes",
                "mlx": SLIDING_MLX if sliding else "untested: full-attention KV caches"}  # fmt: skip
    if base in ("gemma3", "gemma3_text", "gemma4", "gemma4_text", "gpt_oss"):  # static/families.py
        return {"cuda_graphs": "yes", "transformers": "yes", "mlx": "yes"}
    if sliding:
        return {"cuda_graphs": SLIDING, "transformers": "yes", "mlx": SLIDING_MLX}
    if base in ("qwen3_next", "qwen3_5"):
        return {"cuda_graphs": HYBRID_GRAPHS, "transformers": "yes", "mlx": "yes"}
    if base == "qwen3_5_moe":  # mlx-lm's qwen3_5_moe reuses qwen3_5's layers, not run here
        return {"cuda_graphs": HYBRID_GRAPHS, "transformers": "yes",
                "mlx": "untested: hybrid MoE (no tiny qwen3_5_moe mlx target tested)"}  # fmt: skip
    why = "untested: family not confirmed" if family.endswith("?") else "untested"
    return {"cuda_graphs": "no: not a Llama/Qwen/Mistral/Qwen3-MoE target", "transformers": why, "mlx": why}


_DENSE, _MOE = "dense, full attention", "MoE, full attention"
_HYBRID = "GatedDeltaNet + attention hybrid (3:1)"
_NO_THINK = "draft trained without thinking traces: use --reasoning off"
_MXFP4 = ("MXFP4 experts: the CUDA-graph path takes them as transformers dequantizes them (bf16); "
          "kept in MXFP4 kernels they run on the plain path")

PAIRS: tuple[Pair, ...] = (
    Pair("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", "qwen3", 16, "dflash", _DENSE, _NO_THINK),
    Pair("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "qwen3", 16, "dflash", _DENSE, _NO_THINK),
    Pair("meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", "llama",
         10, "dflash", _DENSE),
    Pair("Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash", "qwen3_moe", 16,
         "dflash", _MOE),
    Pair("Qwen/Qwen3-Coder-Next", "z-lab/Qwen3-Coder-Next-DFlash", "qwen3_next", None, "dflash",
         _HYBRID + ", MoE", "draft trained at 4k context"),
    Pair("Qwen/Qwen3.5-4B", "z-lab/Qwen3.5-4B-DFlash", "qwen3_5", None, "dflash", _HYBRID),
    Pair("Qwen/Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash", "qwen3_5", None, "dflash", _HYBRID),
    Pair("Qwen/Qwen3.5-27B", "z-lab/Qwen3.5-27B-DFlash", "qwen3_5", None, "dflash", _HYBRID),
    Pair("Qwen/Qwen3.5-35B-A3B", "z-lab/Qwen3.5-35B-A3B-DFlash", "qwen3_5_moe", None, "dflash",
         _HYBRID + ", MoE"),
    Pair("Qwen/Qwen3.5-122B-A10B", "z-lab/Qwen3.5-122B-A10B-DFlash", "qwen3_5_moe", None, "dflash",
         _HYBRID + ", MoE"),
    Pair("Qwen/Qwen3.5-397B-A17B", "z-lab/Qwen3.5-397B-A17B-DFlash", "qwen3_5_moe", None, "dflash",
         _HYBRID + ", MoE"),
    Pair("Qwen/Qwen3.6-27B", "z-lab/Qwen3.6-27B-DFlash", "qwen3_5", None, "dflash", _HYBRID),
    Pair("Qwen/Qwen3.6-35B-A3B", "z-lab/Qwen3.6-35B-A3B-DFlash", "qwen3_5_moe", None, "dflash",
         _HYBRID + ", MoE"),
    Pair("Qwen/Qwen3.8-27B", "z-lab/Qwen3.8-27B-DFlash2", "qwen3_5 ?", 8, "dflash2", _HYBRID,
         "4-bit targets: the authors use --block-size 5 or less on mlx"),
    Pair("google/gemma-4-31B-it", "z-lab/gemma-4-31B-it-DFlash", "gemma4", None, "dflash",
         "sliding-window + full layers, multimodal wrapper"),
    Pair("google/gemma-4-26B-A4B-it", "z-lab/gemma-4-26B-A4B-it-DFlash", "gemma4", None, "dflash",
         "sliding-window + full layers, MoE"),
    Pair("openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash", "gpt_oss", None, "dflash",
         "128-token sliding windows + full layers, attention sinks, MoE", _MXFP4),
    Pair("openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash", "gpt_oss", None, "dflash",
         "128-token sliding windows + full layers, attention sinks, MoE", _MXFP4),
    Pair("meta-models/Muse-Glimmer-30B", "z-lab/Muse-Glimmer-30B-DFlash2", "muse_glimmer ?", None, "dflash2",
         "3:1 sliding (window 2048) + full layers, multimodal wrapper"),
    Pair("MiniMaxAI/MiniMax-M2.5", "z-lab/MiniMax-M2.5-DFlash", "minimax_m2 ?", None, "dflash",
         _MOE + " (?)", "preview draft"),
    Pair("moonshotai/Kimi-K2.5", "z-lab/Kimi-K2.5-DFlash", "deepseek_v3 ?", None, "dflash",
         "MLA attention, MoE, ~1T parameters"),
    Pair("moonshotai/Kimi-K2.6", "z-lab/Kimi-K2.6-DFlash", "deepseek_v3 ?", None, "dflash",
         "MLA attention, MoE, ~1T parameters"),
)  # fmt: skip

# what a quantized or converted copy adds to a target's name (mlx-community/Qwen3-8B-4bit,
# Qwen3-8B-Q4_K_M.gguf, Qwen3-8B-MLX-bf16): stripped before matching a name to the registry
_COPY_SUFFIX = re.compile(
    r"([-_.](\d+bit|bf16|fp16|f16|f32|fp8|int[48]|mlx|gguf|awq|gptq|dwq|mxfp4|nvfp4|q\d\w*|iq\d\w*))+$",
    re.IGNORECASE,
)


def base_name(model: str) -> str:
    """The model name a registry match compares: the last path part, without ``.gguf`` and
    without quantization/conversion suffixes, lower-cased (``mlx-community/Qwen3-8B-4bit`` ->
    ``qwen3-8b``)."""
    name = Path(model.rstrip("/\\")).name
    name = name[:-5] if name.lower().endswith(".gguf") else name
    return _COPY_SUFFIX.sub("", name).lower()


def find(model: str) -> tuple[Pair, bool] | None:
    """The registered pair of a ``--model`` value and whether it matched exactly.

    An exact match is the target's hub id (case-insensitive); otherwise a value whose
    :func:`base_name` equals a target's (a quantized copy, a local folder or a ``.gguf`` file
    named after it) matches by name. None when nothing matches.
    """
    low = model.strip().lower()
    for pair in PAIRS:
        if pair.target.lower() == low:
            return pair, True
    name = base_name(model)
    for pair in PAIRS:
        if name and base_name(pair.target) == name:
            return pair, False
    return None


_NOTED: set[tuple[str, str]] = set()  # (model, draft) notes already printed by this process


def registered_draft(model: str) -> str | None:
    """The draft hub id registered for ``model`` (see :func:`find`), announced once per process
    on stderr (``dflash: --draft not given; using z-lab/... (the published draft for ...)``);
    None when no pair matches."""
    found = find(model)
    if found is None:
        return None
    pair, exact = found
    if (model, pair.draft) not in _NOTED:
        _NOTED.add((model, pair.draft))
        why = f"the published draft for {pair.target}" + ("" if exact else f", matched by name to {model}")
        note = f"; {pair.note}" if pair.note else ""
        print(f"dflash: --draft not given; using {pair.draft} ({why}{note}); --draft overrides it.",
              file=sys.stderr, flush=True)  # fmt: skip
    return pair.draft


def status_text(value: str) -> str:
    """A ``runs()`` value for the table: ``yes``, ``no`` or ``untested`` (the reason is in
    ``--json`` and the docs)."""
    return value.split(":", 1)[0]


def models(
    json_out: bool = typer.Option(False, "--json", help="Print the registry as one JSON list."),
) -> None:
    """List the published target/draft pairs: --model TARGET without --draft uses the draft."""
    if json_out:
        print(json.dumps([p.to_dict() for p in PAIRS], ensure_ascii=False))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Published DFlash drafts (--model TARGET picks DRAFT; --draft overrides)",
                  title_justify="left")  # fmt: skip
    for name in ("target", "draft", "family", "L", "graphs", "torch", "mlx"):
        wide = name in ("target", "draft")
        table.add_column(name, overflow="fold" if wide else "ellipsis", no_wrap=not wide,
                         min_width=None if wide else len(name))  # fmt: skip
    colour = {"yes": "green", "no": "red", "untested": "yellow"}
    for p in PAIRS:
        runs = [status_text(v) for v in p.runs().values()]
        table.add_row(p.target, p.draft, p.family, str(p.block_size or "cfg"),
                      *(f"[{colour[r]}]{r}[/]" for r in runs))  # fmt: skip
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    console.print(table)
    console.print("L: the draft's trained block size (cfg: read from its config.json). graphs: the "
                  "transformers backend's CUDA-graph path; torch: its plain path (CPU, or CUDA with "
                  "--no-cuda-graphs). Why not: dflash models --json.")  # fmt: skip
