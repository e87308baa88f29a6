"""The CUDA-graph path's kill switches and tuning constants: one frozen :class:`KernelSettings`,
resolved once at load (:meth:`KernelSettings.resolve`) and passed down to the static backend
and its kernels, recorded in ``dflash generate --json``, benchmark records and
``Pipeline.describe()``.

What a user may change is a CLI option: ``--kernels auto|off`` (``off``: the graph path with
torch ops in the graphs instead of this project's Triton kernels, what the fall-back after
failed captures ends with). Each field also has an environment override for tuning runs,
documented in ``docs/kernel-settings.md`` and read here only (:data:`ENV`).

After a failed graph capture :func:`fall_back` gives the settings with the next live kernel
turned off; the backend then rebuilds its graphs.

Torch-free: the settings are checked before torch loads.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from dflash.errors import InputError

BLOCK_N = 64  # granularity of the split-KV attention's keys per program
KERNELS = ("auto", "off")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


@dataclass(frozen=True)
class KernelSettings:
    """Every switch of the CUDA-graph path (transformers backend), with its default.

    Attributes:
        kernels: ``auto`` (this project's Triton kernels where they fit) or ``off`` (torch
            ops in the graphs: every kernel field below off, ``pdl`` "0").
        attention: the static forwards' attention, ``auto`` (split-KV kernel for forwards of
            up to 32 rows in bf16/fp16, SDPA in float32), ``split`` (the kernel in every dtype)
            or ``sdpa``.
        attn_split: keys per program of the split-KV attention (a multiple of 64).
        attn_one_slice: filled keys up to which one program takes them all (0 = always
            slices); None = 640 for head dims <= 64, 448 above (0 when ``attn_split`` is given).
        attn_block: keys per inner iteration of the split-KV attention (32, 64 or 128).
        attn_early: under PDL the attention and RoPE kernels load buffers written before the
            kernel just before them ahead of their wait.
        linear: which projections of forwards of <= 32 rows run the few-row projection kernel:
            ``auto``/``all`` (every one), ``triton`` (o_proj and down_proj), ``torch`` (cuBLAS).
        linear_config: tiles of that kernel, ``BN,BK,warps,stages`` for every shape or
            ``NxK[@M]=BN,BK,warps,stages;...`` per shape; "" = the built-in choice.
        glu: SiLU(gate) * up as the gate+up projection kernel's epilogue.
        fuse_norm: RMSNorms inside the in-projections' kernels; None = on for hidden sizes
            <= 1024 in bf16/fp16 where every width runs the kernel.
        norm_kernel: the target's stand-alone RMSNorms through this project's kernel.
        rope_target, rope_draft: q/k norm + RoPE + cache writes as one kernel in the target's
            (the draft's) layers.
        qkv_rope: the qkv projection inside that kernel too; None = where there are no q/k
            norms and the qkv weight is at most 8 MiB.
        rope_table: the draft's RoPE kernel reads cos/sin tables made once per cache size.
        pdl: programmatic dependent launch, ``1`` (this project's kernels and Inductor's),
            ``kernels`` (this project's only), ``draft`` (both, in the draft's forward only),
            ``0`` (none); Hopper and newer GPUs only.
        device_loop: greedy fixed-block requests accept and commit on the device.
        queue_ahead: what the device loop queues while the host reads a step: ``draft`` (the
            next step's draft) or ``step`` (the whole next step).
        compile_glue: ``torch.compile`` the device loop's glue with the forwards.
        compile_mode: ``torch.compile`` mode of the forwards; None = torch's default.
        graph_warm: replays of each new graph before the first token.
        draft_vocab: use a draft folder's ``draft_vocab.json`` (every backend).
        batched_kv_lengths: batched decoding (``dflash data regenerate``) attends each row
            over its own length (FlexAttention); None = on for CUDA.
        batched_compile: ``torch.compile`` the batched step; None = on with ``batched_kv_lengths``.
    """

    kernels: str = "auto"
    attention: str = "auto"
    attn_split: int = 256
    attn_one_slice: int | None = None
    attn_block: int = 128
    attn_early: bool = True
    linear: str = "auto"
    linear_config: str = ""
    glu: bool = True
    fuse_norm: bool | None = None
    norm_kernel: bool = True
    rope_target: bool = True
    rope_draft: bool = True
    qkv_rope: bool | None = None
    rope_table: bool = True
    pdl: str = "1"
    device_loop: bool = True
    queue_ahead: str = "draft"
    compile_glue: bool = True
    compile_mode: str | None = None
    graph_warm: int = 3
    draft_vocab: bool = True
    batched_kv_lengths: bool | None = None
    batched_compile: bool | None = None

    @classmethod
    def resolve(cls, kernels: str = "auto", environ: Mapping[str, str] | None = None) -> KernelSettings:
        """The settings for ``--kernels`` ``kernels``, with the environment overrides of
        :data:`ENV` (``environ``, default ``os.environ``) applied and checked.

        Raises:
            InputError: an unknown ``kernels`` value or a bad override, naming the variable.
        """
        if kernels not in KERNELS:
            raise InputError(f"--kernels must be auto or off, got {kernels!r}.",
                             hint="auto runs this project's Triton kernels where they fit; off runs torch ops")  # fmt: skip
        env = os.environ if environ is None else environ
        given = {name: env[var].strip() for name, var in ENV.items() if env.get(var, "").strip()}
        values = {name: _PARSE[name](ENV[name], raw) for name, raw in given.items()}
        if "rope" in values:  # one variable for both forwards: 1, draft or 0
            mode = values.pop("rope")
            values["rope_target"], values["rope_draft"] = mode == "1", mode in ("1", "draft")
        if "attn_split" in values and "attn_one_slice" not in values:
            values["attn_one_slice"] = 0  # a split given is the split run
        settings = cls(**values)
        return settings.without_kernels() if kernels == "off" else settings

    def without_kernels(self) -> KernelSettings:
        """These settings with every Triton kernel and PDL off (``--kernels off``)."""
        return dataclasses.replace(self, kernels="off", attention="sdpa", linear="torch", glu=False,
                                   fuse_norm=False, norm_kernel=False, rope_target=False, rope_draft=False,
                                   qkv_rope=False, pdl="0")  # fmt: skip

    def record(self) -> dict:
        """The fields as a JSON-ready dict (for ``--json`` output and benchmark records)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Launch:
    """How this project's kernels launch in one forward: the settings and whether PDL is on
    there (the backend decides it per forward, see :func:`pdl_wanted`)."""

    settings: KernelSettings = field(default_factory=KernelSettings)
    pdl: bool = False


def pdl_wanted(mode: str, part: str, inductor: bool = False) -> bool:
    """Whether ``pdl`` mode ``mode`` asks for PDL in the forward ``part`` ("target" or
    "draft"), for this project's kernels or (``inductor``) Inductor's; the device must also
    support it (:func:`dflash.kernels.pdl.pdl_supported`)."""
    return mode == "1" or (mode == "kernels" and not inductor) or (mode == "draft" and part == "draft")


def one_slice(settings: KernelSettings, head_dim: int | None) -> int:
    """Filled keys up to which the split-KV attention's first program takes every key alone:
    ``attn_one_slice``, else 640 for head dims <= 64 and 448 above (None: 448); 0 when not above
    ``attn_split``, where it would change nothing.

    Measured on the H200 (``scripts/attn_sweep.py``): merging slices costs about 1.9-2.4 us
    and one more inner iteration of 128 keys 0.77-1.37 us, so a second slice pays off past
    about 630 keys for head dim 64 and past about 450 for 128."""
    value = settings.attn_one_slice
    if value is None:
        value = 640 if head_dim is not None and head_dim <= 64 else 448
    return value if value > settings.attn_split else 0


def config_override(raw: str, m: int, n: int, k: int) -> tuple[int, int, int, int] | None:
    """(BN, BK, warps, stages) that a ``linear_config`` value gives an [m, k] x [n, k]^T product
    (n = weight rows), None where it names other shapes or is empty.

    Raises:
        InputError: a malformed value (every entry is checked, used or not).
    """
    def numbers(text: str) -> tuple[int, int, int, int]:
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 4 or not all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts):
            raise InputError(f"{ENV['linear_config']} must be BN,BK,warps,stages or NxK=BN,BK,warps,stages;..., "
                             f"got {raw!r}.", hint="e.g. 32,256,4,3 or 4096x4096=16,512,4,4; unset it for the "
                             "built-in choice")  # fmt: skip
        return tuple(int(p) for p in parts)  # type: ignore[return-value]

    if not raw:
        return None
    if "=" not in raw:
        return numbers(raw)
    picked = None
    for entry in filter(None, (e.strip() for e in raw.split(";"))):
        shape, _, cfg = entry.partition("=")
        shape, _, rows = shape.strip().partition("@")
        dims = shape.lower().split("x")
        if len(dims) != 2 or not all(d.strip().isdigit() for d in dims) or (rows and not rows.strip().isdigit()):
            numbers("")  # raises with the format
        tiles = numbers(cfg)
        if picked is None and (int(dims[0]), int(dims[1])) == (n, k) and (not rows or int(rows) == m):
            picked = tiles
    return picked


# -- the fall-back after a failed capture ---------------------------------------------------
# (piece the backend reports live, what it is, what runs instead, the override that keeps it
# off, the fields turned off), in order
LADDER: tuple[tuple[str, str, str, str, dict], ...] = (
    ("qkv_rope", "the qkv + RoPE kernel", "the projection and the RoPE kernel apart", "qkv_rope=0",
     {"qkv_rope": False}),
    ("norm_kernel", "the RMSNorm kernel", "Inductor's norms", "norm_kernel=0", {"norm_kernel": False}),
    ("pdl", "programmatic dependent launch", "plain launches", "pdl=0", {"pdl": "0"}),
    ("fuse_norm", "the norms inside the projections", "norm kernels", "fuse_norm=0", {"fuse_norm": False}),
    ("glu", "the SiLU * up epilogue", "its own kernel", "glu=0", {"glu": False}),
    ("rope", "the RoPE + cache-write kernel", "torch ops", "rope=0", {"rope_target": False, "rope_draft": False}),
    ("linear", "the Triton projection kernel", "cuBLAS", "linear=torch",
     {"linear": "torch", "glu": False, "fuse_norm": False, "rope_target": False, "rope_draft": False,
      "qkv_rope": False}),
    ("attention", "the split-KV attention kernel", "SDPA", "attention=sdpa", {"attention": "sdpa"}),
)  # fmt: skip


def fall_back(settings: KernelSettings, live: Collection[str]) -> tuple[KernelSettings, str, str] | None:
    """After a failed graph capture: ``settings`` with the first piece of :data:`LADDER` that
    is ``live`` (in use by the failed graph's forwards, as the backend reports it: "qkv_rope",
    "norm_kernel", "pdl", "fuse_norm", "glu", "rope", "linear", "attention") turned off.

    Returns:
        (new settings, what was turned off, what runs instead, with the override that keeps it
        off), or None when nothing live is left (the backend may then turn ``torch.compile`` off).
    """
    for piece, what, instead, keep_off, changes in LADDER:
        if piece in live:
            name, value = keep_off.split("=")
            silence = f"{ENV[name]}={value} or --kernels off silences this"
            return dataclasses.replace(settings, **changes), what, f"{instead} ({silence})"
    return None


# -- environment overrides (documented in docs/kernel-settings.md) ---------------------------
ENV: dict[str, str] = {
    "attention": "DFLASH_ATTN", "attn_split": "DFLASH_ATTN_SPLIT", "attn_one_slice": "DFLASH_ATTN_ONE_SLICE",
    "attn_block": "DFLASH_ATTN_BLOCK", "attn_early": "DFLASH_ATTN_EARLY", "linear": "DFLASH_LINEAR",
    "linear_config": "DFLASH_LINEAR_CONFIG", "glu": "DFLASH_GLU", "fuse_norm": "DFLASH_FUSE_NORM",
    "norm_kernel": "DFLASH_NORM_KERNEL", "rope": "DFLASH_ROPE", "qkv_rope": "DFLASH_QKV_ROPE",
    "rope_table": "DFLASH_ROPE_TABLE", "pdl": "DFLASH_PDL", "device_loop": "DFLASH_DEVICE_LOOP",
    "queue_ahead": "DFLASH_QUEUE_AHEAD", "compile_glue": "DFLASH_COMPILE_GLUE",
    "compile_mode": "DFLASH_COMPILE_MODE", "graph_warm": "DFLASH_GRAPH_WARM",
    "draft_vocab": "DFLASH_DRAFT_VOCAB", "batched_kv_lengths": "DFLASH_BATCHED_KV_LENGTHS",
    "batched_compile": "DFLASH_BATCHED_COMPILE",
}  # fmt: skip


def _bad(var: str, raw: str, what: str, default: str) -> InputError:
    return InputError(f"{var} must be {what}, got {raw!r}.", hint=f"unset it for the default ({default})")


def _switch(var: str, raw: str, default: str = "1") -> bool:
    low = raw.lower()
    if low in _ON or low in _OFF:
        return low in _ON
    raise _bad(var, raw, "1 or 0 (on/off, true/false, yes/no)", default)


def _choice(*choices: str):
    def parse(var: str, raw: str) -> str:
        if raw.lower() not in choices:
            raise _bad(var, raw, f"{', '.join(choices[:-1])} or {choices[-1]}", choices[0])
        return raw.lower()

    return parse


def _count(var: str, raw: str, what: str, default: str, ok=lambda v: True) -> int:
    if not (raw.isascii() and raw.isdigit()) or not ok(int(raw)):
        raise _bad(var, raw, what, default)
    return int(raw)


def _auto_switch(var: str, raw: str) -> bool | None:
    return None if raw.lower() == "auto" else _switch(var, raw, "auto")


def _mode(*choices: str):
    """A choice among ``choices`` ("1" first) where the switch words mean "1" and "0"."""
    def parse(var: str, raw: str) -> str:
        low = raw.lower()
        return "1" if low in _ON else "0" if low in _OFF else _choice(*choices)(var, raw)

    return parse


def _compile_mode(var: str, raw: str) -> str:
    if raw not in COMPILE_MODES:
        raise _bad(var, raw, ", ".join(COMPILE_MODES), "torch's default mode")
    return raw


def _linear_config(var: str, raw: str) -> str:
    config_override(raw, 16, 1024, 1024)  # every entry checked
    return raw


_PARSE = {
    "attention": _choice("auto", "split", "sdpa"),
    "attn_split": lambda v, r: _count(v, r, f"a positive multiple of {BLOCK_N}", "256",
                                      lambda x: x > 0 and x % BLOCK_N == 0),
    "attn_one_slice": lambda v, r: _count(v, r, "a whole number of keys (0 = off)", "640 keys for head dims "
                                          "<= 64, 448 above"),
    "attn_block": lambda v, r: _count(v, r, "32, 64 or 128", "128", lambda x: x in (32, 64, 128)),
    "attn_early": _switch,
    "linear": _choice("auto", "all", "triton", "torch"),
    "linear_config": _linear_config,
    "glu": _switch,
    "fuse_norm": lambda v, r: _switch(v, r, "on for hidden sizes <= 1024 in bf16/fp16"),
    "norm_kernel": _switch,
    "rope": _mode("1", "draft", "0"),
    "qkv_rope": _auto_switch,
    "rope_table": _switch,
    "pdl": _mode("1", "0", "kernels", "draft"),
    "device_loop": _switch,
    "queue_ahead": _choice("draft", "step"),
    "compile_glue": _switch,
    "compile_mode": _compile_mode,
    "graph_warm": lambda v, r: _count(v, r, "a whole number >= 0 (0 skips the warm replays)", "3"),
    "draft_vocab": _switch,
    "batched_kv_lengths": lambda v, r: _switch(v, r, "on for CUDA"),
    "batched_compile": lambda v, r: _switch(v, r, "on with the per-row lengths"),
}  # fmt: skip
