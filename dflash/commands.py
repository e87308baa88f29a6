"""The ``generate`` and ``init-draft`` commands (registered on the Typer app in cli.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from dflash.backend_names import CLIENT_BACKENDS, LOCAL_BACKENDS, backend_help, check_backend
from dflash.errors import InputError
from dflash.options import (  # noqa: F401 - re-exported
    SERVER_SIDE,
    WARMUP_DEFAULT,
    check_recalibrate,
    check_warmup,
    parse_block_size,
    refuse_foreign_options,
)
from dflash.types import SamplingParams

Backend = Annotated[str, typer.Argument(help=backend_help())]
ModelOpt = Annotated[str | None, typer.Option("--model", "-m",
                     help="Target: hub id, local folder or .gguf file (default: demo SmolLM2-135M-Instruct); openai: the served model name (default: the first of /v1/models).")]  # fmt: skip
BaseUrlOpt = Annotated[str, typer.Option(help="openai: server URL, with or without /v1.")]
ApiKeyOpt = Annotated[str | None, typer.Option(help="openai: API key (default: $OPENAI_API_KEY); never printed.", show_default=False)]  # fmt: skip
TimeoutOpt = Annotated[float, typer.Option(help="openai: HTTP timeout per connect/read, seconds.")]
DraftOpt = Annotated[str | None, typer.Option("--draft", "-d",
                     help="DFlash draft: hub id or folder (default: the shipped demo draft, for the demo target only: no --model, or its .gguf).")]  # fmt: skip

BASE_URL_DEFAULT = "http://127.0.0.1:30000"  # SGLang's default port
TIMEOUT_DEFAULT = 3600.0
DraftBitsOpt = Annotated[int | None, typer.Option(help="mlx: quantize the draft to 4 or 8 bits at load (group size 64).")]
KernelsOpt = Annotated[str, typer.Option(help="transformers: auto runs this project's Triton kernels in the CUDA graphs where they fit; off runs torch ops there (if a kernel fails on your GPU).")]  # fmt: skip
RecalibrateOpt = Annotated[bool, typer.Option("--recalibrate", help="Measure the --block-size auto step costs again instead of reading them from the dflash cache (and cache the new ones).")]  # fmt: skip
WarmupOpt = Annotated[int, typer.Option(help="transformers, CUDA graphs: untimed warm-up tokens per block size before the request (0 = none).")]  # fmt: skip
DraftWindowOpt = Annotated[int | None, typer.Option(help="The draft attends to at most the N most recent context rows (tokens; transformers: plain path).")]


def check_utf8(name: str, text: str | None) -> None:
    """Refuse text that cannot be sent as UTF-8: bytes that were not UTF-8 on the command line
    reach Python as lone surrogates (``surrogateescape``), which the tokenizer and HTTP refuse
    with a traceback.

    Raises:
        InputError: naming ``name`` and the first bad byte's position (in characters).
    """
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"character U+{ord(bad):04X}"
        raise InputError(f"{name} is not valid UTF-8 ({byte} at character {e.start}).",
                         hint="pass UTF-8 text, e.g. convert it with iconv -t UTF-8") from None  # fmt: skip


def context_notice(max_new_tokens: int, prompt_tokens: int, context: int) -> str | None:
    """The stderr line of ``dflash generate`` when ``--max-new-tokens`` is more than the target's
    context leaves after the prompt (the request stops there, finish reason "length"), else None.
    A prompt that fills the context is an error elsewhere."""
    left = context - prompt_tokens
    if 0 < left < max_new_tokens:
        return (f"dflash: --max-new-tokens {max_new_tokens} is more than the target's context leaves after the "
                f"{prompt_tokens}-token prompt; at most {left} new tokens (context {context}).")  # fmt: skip
    return None


def generate(
    backend: Backend,
    prompt: Annotated[str, typer.Argument(help="The user message.")],
    model: ModelOpt = None,
    draft: DraftOpt = None,
    block_size: Annotated[str, typer.Option(help="Verify width incl. the anchor, or auto: chosen per step from measured costs and acceptance; 1 = no drafting.")] = "auto",
    max_new_tokens: Annotated[int, typer.Option(help="Token budget (tokens).")] = 2048,
    temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 = lossless rejection sampling.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus mass in (0, 1]; 1 disables.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens; 0 disables.")] = 0,
    reasoning: Annotated[str | None, typer.Option(help="on, off or a template-supported level.")] = None,
    system: Annotated[str | None, typer.Option(help="System message prepended to the chat.")] = None,
    device: Annotated[str, typer.Option(help="auto, cuda, cuda:N or cpu (mlx: auto, gpu or cpu).")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16, float32.")] = "auto",
    seed: Annotated[int, typer.Option(help="Seed for sampling.")] = 0,
    cuda_graphs: Annotated[bool | None, typer.Option("--cuda-graphs/--no-cuda-graphs", help="Static caches + CUDA graphs (default: on for CUDA with Llama/Qwen-style targets).")] = None,
    compile: Annotated[bool | None, typer.Option("--compile/--no-compile", help="torch.compile the CUDA-graph forwards (default: on with CUDA graphs; ~30 s per graph the first time, then cached on disk).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (text, token ids, stats) instead of streaming.")] = False,
    base_url: BaseUrlOpt = BASE_URL_DEFAULT,
    api_key: ApiKeyOpt = None,
    timeout_s: TimeoutOpt = TIMEOUT_DEFAULT,
    draft_bits: DraftBitsOpt = None,
    draft_window: DraftWindowOpt = None,
    kernels: KernelsOpt = "auto",
    recalibrate: RecalibrateOpt = False,
    warmup: WarmupOpt = WARMUP_DEFAULT,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print each step's block size with the predicted τ and cost (auto) to stderr.")] = False,
) -> None:  # fmt: skip
    """Generate a reply with DFlash speculative decoding; text streams to stdout, stats to stderr."""
    import os
    import time

    check_backend(backend, "generate")  # before the option checks: they name the backend
    local, remote = LOCAL_BACKENDS, CLIENT_BACKENDS
    refuse_foreign_options(backend, {
        "--block-size": str(block_size).strip().lower() != "auto", "--draft": draft is not None,
        "--device": device != "auto", "--dtype": dtype != "auto",
        "--cuda-graphs/--no-cuda-graphs": cuda_graphs is not None, "--compile/--no-compile": compile is not None,
        "--draft-bits": draft_bits is not None, "--draft-window": draft_window is not None,
        "--verbose": verbose, "--base-url": base_url != BASE_URL_DEFAULT, "--api-key": api_key is not None,
        "--timeout-s": timeout_s != TIMEOUT_DEFAULT, "--kernels": kernels != "auto", "--recalibrate": recalibrate,
        "--warmup": warmup != WARMUP_DEFAULT,
    }, {"--block-size": local, "--draft": local, "--device": local, "--dtype": local,
        "--cuda-graphs/--no-cuda-graphs": ("transformers",), "--compile/--no-compile": ("transformers",),
        "--draft-bits": ("mlx",), "--draft-window": local, "--verbose": local,
        "--base-url": remote, "--api-key": remote, "--timeout-s": remote, "--kernels": ("transformers",),
        "--recalibrate": local, "--warmup": ("transformers",)})  # fmt: skip
    check_utf8("PROMPT", prompt)
    check_utf8("--system", system)
    if not prompt.strip():  # refused here for every backend: a server may answer it with a bare 400
        raise InputError("The prompt is empty.", hint="pass a question or instruction as PROMPT")
    if backend == "openai":  # torch-free path: the server does the speculative decoding
        from dflash.backends.openai_generate import generate_openai

        generate_openai(prompt, base_url=base_url, model=model, api_key=api_key or os.environ.get("OPENAI_API_KEY"),
                        timeout_s=timeout_s, max_new_tokens=max_new_tokens, reasoning=reasoning, system=system,
                        sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
                        json_out=json_out)  # fmt: skip
        return

    if backend == "mlx":  # no torch next to mlx (dflash.mlx_process)
        from dflash.mlx_process import keep_torch_out

        keep_torch_out()
    import dflash
    from dflash.api import TextStream

    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {max_new_tokens}.", hint="e.g. --max-new-tokens 256")
    from dflash.models.target_torch import local_draft_block_size  # torch-free

    block_size = parse_block_size(block_size, local_draft_block_size(draft, model))
    check_warmup(warmup)
    check_recalibrate(recalibrate, [block_size])
    pipe = dflash.load(model, draft, backend=backend, device=device, dtype=dtype, cuda_graphs=cuda_graphs,
                       compile=compile, draft_bits=draft_bits, draft_window=draft_window, kernels=kernels)  # fmt: skip
    pipe.recalibrate = recalibrate
    ids = pipe.chat_prompt([{"role": "user", "content": prompt}], system=system, reasoning=reasoning)
    notice = context_notice(max_new_tokens, len(ids), pipe.backend.max_context)
    if notice:
        print(notice, file=sys.stderr)
    kwargs = dict(block_size=block_size, max_new_tokens=max_new_tokens, sampling=sampling)
    pipe.calibrate_for(ids, block_size, max_new_tokens)  # before the clock; cached per device and pair
    warmup_s = 0.0  # untimed warm-up as the benchmark does before it measures (graph path only)
    if getattr(pipe.backend, "use_graphs", False):
        warmup_s = pipe.warm_up(ids, max_new_tokens=max_new_tokens, sampling=sampling, tokens=warmup)
    try:
        import torch

        torch.manual_seed(seed)  # after the warm-up: the same seed gives the same sample
    except ImportError:  # pragma: no cover
        pass
    if json_out:  # --verbose: the step lines on stderr as they come, the JSON at the end
        r = pipe.generate(ids, on_step=(lambda i, s: print_step(i, s, pipe.last_policy)) if verbose else None,
                          **kwargs)  # fmt: skip
        settings = getattr(pipe.backend, "settings", None)  # the transformers backend's, resolved at load
        print(json.dumps({
            "text": r.text, "token_ids": r.token_ids, "prompt_tokens": r.prompt_tokens,
            "new_tokens": r.num_new_tokens, "finish_reason": r.finish_reason,
            "block_size": r.block_size, "verify_steps": r.verify_steps,
            "acceptance_lengths": r.acceptance_lengths,
            "mean_acceptance_length": r.mean_acceptance_length,
            "ttft_s": r.ttft_s, "decode_s": r.decode_s, "decode_tok_per_s": r.decode_tok_per_s,
            "warmup_s": warmup_s,
            "text_truncated_mid_character": r.truncated_mid_character,
            **({"block_policy": r.block_policy} if r.block_policy else {}),
            **({"kernel_settings": settings.record()} if settings is not None else {}),
        }))  # fmt: skip
        return
    stream = TextStream(pipe.tokenizer)
    steps: list[int] = []
    n = 0
    t0 = time.perf_counter()
    t1 = None
    shared = verbose and same_stream(sys.stdout, sys.stderr)
    midline = False  # the text on stdout stops mid-line (a step note must start a new line)
    for r in pipe.stream(ids, **kwargs):
        n += len(r.tokens)
        if r.accepted is None:
            t1 = time.perf_counter()
        else:
            steps.append(r.accepted)
            if verbose:
                if shared and midline:
                    sys.stderr.write("\n")
                print_step(len(steps), r, pipe.last_policy)
        text = stream.feed(r.tokens, final=r.finish_reason is not None)
        sys.stdout.write(text)
        sys.stdout.flush()
        midline = (not text.endswith("\n")) if text else midline
    t2 = time.perf_counter()
    sys.stdout.write("\n")
    sys.stdout.flush()  # the summary on stderr must come after the text
    decode = t2 - (t1 or t0)
    print(summary_line(n, steps, decode, (t1 or t0) - t0), file=sys.stderr)


def same_stream(a, b) -> bool:
    """Whether two text streams write to the same file or terminal (``2>&1``, a console), where
    stderr notes and stdout text interleave on one screen."""
    try:
        x, y = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (AttributeError, OSError, ValueError):  # in-memory streams (tests)
        return False
    return (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)


def plural(count: int, noun: str) -> str:
    """``1 verify step``, ``2 verify steps``."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def summary_line(new_tokens: int, steps: list[int], decode_s: float, ttft_s: float) -> str:
    """The stderr summary of ``generate``: counts, decode tok/s, mean τ, TTFT (no nan: a figure
    that does not exist, such as τ without a verify step, reads n/a)."""
    speed = f"{(new_tokens - 1) / decode_s:.1f} tok/s" if new_tokens > 1 and decode_s > 0 else "n/a"
    tau = f"{sum(steps) / len(steps):.2f}" if steps else "n/a"
    return (f"[{plural(new_tokens, 'new token')} | decode {speed} | mean acceptance length τ {tau} | "
            f"{plural(len(steps), 'verify step')} | TTFT {ttft_s * 1000:.0f} ms]")  # fmt: skip


def print_step(i: int, r, policy) -> None:
    """One ``--verbose`` line on stderr: the step's block size, prediction (auto) and outcome."""
    if policy is not None and policy.history:
        if i == 1:
            costs = " ".join(f"{w}:{1000 * c:.1f}" for w, c in policy.step_cost.items())
            print(f"[auto: {policy.costs.describe()}]", file=sys.stderr)
            print(f"[auto: step cost ms by L {costs}; acceptance prior: {policy.prior.source}]",
                  file=sys.stderr)  # fmt: skip
        c = policy.history[-1]
        print(f"[step {i}: L={c.block_size} predicted τ {c.tau:.2f} cost {1000 * c.cost_s:.1f} ms "
              f"({c.rate:.1f} tok/s){' probe' if c.probe else ''}{' held' if c.held else ''} "
              f"-> committed {r.accepted}]",
              file=sys.stderr)  # fmt: skip
    else:
        print(f"[step {i}: L={r.proposed + 1} -> committed {r.accepted}]", file=sys.stderr)


def init_draft(
    target: Annotated[str | None, typer.Option("--target", help="Target hub id, folder or .gguf (default: demo target).")] = None,
    out: Annotated[Path, typer.Option("--out", help="Output folder.")] = Path("draft"),
    layers: Annotated[int, typer.Option(help="Draft decoder layers (= target feature layers).")] = 5,
    block_size: Annotated[int, typer.Option(help="Block size L the draft is made for.")] = 16,
    mask_token_id: Annotated[int | None, typer.Option(help="Mask token id (default: an unused/special token).")] = None,
    seed: Annotated[int, typer.Option(help="Weight-initialisation seed.")] = 0,
    dtype: Annotated[str, typer.Option(help="Storage dtype: bfloat16 or float32.")] = "bfloat16",
    force: Annotated[bool, typer.Option("--force", help="Overwrite a folder that already holds a draft.")] = False,
    arch: Annotated[str, typer.Option(help="dflash (v1) or dflash2 (dynamic convolutions + candidate selector).")] = "dflash",
) -> None:  # fmt: skip
    """Write an untrained DFlash (or DFlash2) draft shaped for a target (config.json + safetensors)."""
    from dflash.models.config import DraftConfig
    from dflash.models.init_draft import init_draft as make

    folder = make(target, out, layers=layers, block_size=block_size,
                  mask_token_id=mask_token_id, seed=seed, dtype=dtype, force=force, arch=arch)  # fmt: skip
    cfg = DraftConfig.load(folder)
    kind = "DFlash2 draft" if cfg.is_dflash2 else "DFlash draft"
    layers_text = f"{cfg.num_hidden_layers} layer" + ("" if cfg.num_hidden_layers == 1 else "s")
    print(f"wrote {folder}: {kind}, {layers_text}, block size {cfg.block_size}, "
          f"mask token {cfg.mask_token_id}, target layers {cfg.target_layer_ids}")  # fmt: skip
