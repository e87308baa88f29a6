"""The static path's switches: checked on any device, and turned off one at a time after a failed
CUDA-graph capture (:meth:`dflash.backends.static.backend.StaticBackend._fall_back`)."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import torch

from dflash.backends.static.device_loop import queue_ahead, step_compile_default
from dflash.backends.static.graph_plan import warm_replays
from dflash.kernels.head_argmax import head_argmax_default
from dflash.kernels.l2_prefetch import prefetch_setting
from dflash.kernels.linear_settings import (
    fuse_norm_setting,
    glu_setting,
    kernel_config,
    linear_mode,
    preload_bytes,
)
from dflash.kernels.norm_partials import norm_form
from dflash.kernels.pdl import disable_pdl, pdl_setting
from dflash.kernels.qkv_rope import qkv_rope_setting
from dflash.kernels.rms_norm import norm_kernel_setting
from dflash.kernels.rope_cache import rope_parts
from dflash.kernels.small_linear import one_tile_setting
from dflash.kernels.split_attention import (
    attention_mode,
    early_setting,
    iter_keys,
    one_slice_setting,
    split_setting,
)


def check_env() -> None:
    """Check every switch of the static path (``DFLASH_ATTN``, ``DFLASH_ATTN_SPLIT``,
    ``DFLASH_LINEAR``, ``DFLASH_LINEAR_CONFIG``, ``DFLASH_GLU``, ``DFLASH_FUSE_NORM``,
    ``DFLASH_FUSE_NORM_FORM``, ``DFLASH_PDL``, ``DFLASH_PDL_PREFETCH``, ``DFLASH_ROPE``, ``DFLASH_QKV_ROPE``,
    ``DFLASH_PREFETCH``, ``DFLASH_STEP_COMPILE``, ``DFLASH_HEAD_ARGMAX``, ``DFLASH_GRAPH_WARM``,
    ``DFLASH_QUEUE_AHEAD``, ``DFLASH_DRAFT_ATTN_SPLIT``, ``DFLASH_ATTN_BLOCK``, ``DFLASH_ATTN_ONE_SLICE``, ``DFLASH_ATTN_EARLY``,
    ``DFLASH_NORM_KERNEL``, ``DFLASH_LINEAR_ONE_TILE``)
    on any device: a typo fails at load on a laptop too, not first on the GPU machine.

    Raises:
        InputError: the first bad value, naming the variable.
    """
    cpu = torch.device("cpu")
    attention_mode(cpu)
    split_setting()
    split_setting(draft=True)
    one_slice_setting()
    early_setting()
    iter_keys()
    linear_mode(cpu)
    kernel_config(16, 1024, 1024)
    pdl_setting()
    glu_setting()
    fuse_norm_setting()
    norm_form()
    preload_bytes()
    rope_parts()
    qkv_rope_setting()
    prefetch_setting(cpu)
    step_compile_default()
    queue_ahead()
    head_argmax_default()
    norm_kernel_setting()
    one_tile_setting()
    warm_replays()


@contextmanager
def inductor_pdl(on: bool, device: torch.device):
    """Inductor's PDL code (``torch._inductor.config.triton.enable_pdl``, a process-wide setting
    read when a forward compiles) set to ``on`` meanwhile, on CUDA where this torch has it, and
    restored afterwards (other ``torch.compile`` users in the process keep their setting).

    Dynamo does not guard compiled code on it: a frame shared by the draft's and the target's
    forwards keeps the setting of its first compile under ``DFLASH_PDL=draft``; both are exact."""
    import torch._inductor.config as inductor_config

    if device.type != "cuda" or not hasattr(inductor_config.triton, "enable_pdl"):
        yield
        return
    before = inductor_config.triton.enable_pdl
    inductor_config.triton.enable_pdl = on
    try:
        yield
    finally:
        inductor_config.triton.enable_pdl = before


def fall_back(be, error: Exception, part: str | None = None, kind: str | None = None) -> bool:
    """After a failed capture of a :class:`~dflash.backends.static.backend.StaticBackend` (``be``)
    graph, turn off the next optional piece, with one line on stderr:
    the L2 weight prefetch (``DFLASH_PREFETCH``), then the whole-step compile
    (``DFLASH_STEP_COMPILE``), then the LM head + argmax kernel (``DFLASH_HEAD_ARGMAX``), then
    the qkv projection inside the RoPE + cache-write kernel (``DFLASH_QKV_ROPE``, where the
    forwards run it), then the RMSNorm kernel (``DFLASH_NORM_KERNEL``), then programmatic dependent launch (when it was on for the failed capture
    of ``part``, "draft" or "target"; the forwards compile again), then the norms inside the projections
    (``DFLASH_FUSE_NORM``), then the SiLU * up epilogue (``DFLASH_GLU``), then the RoPE +
    cache-write kernel (``DFLASH_ROPE``), then the Triton projections (cuBLAS instead),
    then the split-KV kernel (SDPA), then ``torch.compile`` (eager ops). Returns False when
    nothing is left to turn off.

    The whole-step compile and the LM head + argmax kernel are skipped when the failed graph
    (``kind``) is not one of the device loop's (``dverify``, ``ddraft``), which use neither.
    The forwards read these switches while tracing, so the next capture traces again;
    graphs captured before keep what they had (every variant gives the target's tokens)."""
    why = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
    device_graph = kind is None or kind.startswith("d")
    if be.prefetch:
        be.prefetch = 0
        what, fix = "the L2 weight prefetch", "no prefetch (DFLASH_PREFETCH=0 silences this)"
    elif device_graph and be.step_compile and be.compile and be.device_loop is not None:
        be.step_compile = False
        what, fix = "the whole-step compile", "forward and glue compiled apart (unset DFLASH_STEP_COMPILE)"
    elif device_graph and be.head_argmax:
        be.head_argmax = False
        what, fix = "the LM head + argmax kernel", "the logits and an argmax (unset DFLASH_HEAD_ARGMAX)"
    elif hasattr(be, "qkv_rope_live") and any(be.qkv_rope_live()):
        be.qkv_rope_target = be.qkv_rope_draft = False
        what, fix = "the qkv + RoPE kernel", "the projection and the RoPE kernel apart (DFLASH_QKV_ROPE=0 silences this)"
    elif getattr(be, "norm_kernel", False):
        be.norm_kernel = False
        what, fix = "the RMSNorm kernel", "Inductor's norms (DFLASH_NORM_KERNEL=0 silences this)"
    elif disable_pdl(be.device, part):  # compiled code has no guard on it: compile again
        be._compiled.clear()
        if be.device_loop is not None:
            be.device_loop._compiled.clear()
        torch._dynamo.reset()
        what, fix = "programmatic dependent launch", "plain launches (DFLASH_PDL=0 silences this)"
    elif getattr(be, "norm_partials", False):  # the squares form next, the folded weights kept
        be.norm_partials = False
        what, fix = "the norms' partial sums", "sums from the input tiles (DFLASH_FUSE_NORM_FORM=squares silences this)"
    elif be.fuse_norm or be.draft_fuse_norm:
        be.fuse_norm = be.draft_fuse_norm = be.norm_partials = False
        be.folded_target = be.folded_draft = None  # the folded weight copies: memory back
        what, fix = "the norms inside the projections", "norm kernels (DFLASH_FUSE_NORM=0 silences this)"
    elif be.glu or be.draft_glu:
        be.glu = be.draft_glu = False
        what, fix = "the SiLU * up epilogue", "its own kernel (DFLASH_GLU=0 silences this)"
    elif be.draft_rope or be.target_rope:
        be.draft_rope = be.target_rope = False
        what, fix = "the RoPE + cache-write kernel", "torch ops (DFLASH_ROPE=0 silences this)"
    elif be.linear != "torch" or be.draft_linear:
        be.linear, be.draft_linear, be.draft_linear_in, be.linear_in = "torch", False, False, 0
        be.glu = be.draft_glu = be.fuse_norm = be.draft_fuse_norm = be.norm_partials = False
        be.draft_rope = be.target_rope = False
        what, fix = "the Triton projection kernel", "cuBLAS (DFLASH_LINEAR=torch silences this)"
    elif be.attention != "sdpa":
        be.attention = "sdpa"
        what, fix = "the split-KV attention kernel", "SDPA (DFLASH_ATTN=sdpa silences this)"
    elif be.compile:
        be.compile = False
        mode = os.environ.get("DFLASH_COMPILE_MODE")
        what = "torch.compile"
        fix = f"eager ops (check DFLASH_COMPILE_MODE={mode!r}, or --no-compile)" if mode else \
            "eager ops (--no-compile silences this)"
    else:
        return False
    print(f"dflash: {what} failed ({why}); continuing with {fix}.", file=sys.stderr)
    return True
