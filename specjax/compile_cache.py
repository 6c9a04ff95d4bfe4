"""JAX's persistent compilation cache, on by default for every `specjax` command.

A second start of `serve`, `demo`, `generate` or `bench` then loads its compiled programs from disk
instead of compiling them again (minutes on 2 CPU cores). Entries live under
`$SPECJAX_CACHE/xla/<jax and jaxlib versions>-<CPU fingerprint>/`: jax's own key covers the program,
the XLA flags, the backend and its version, but on CPU not the instruction set XLA compiled for, so
a cache filled on an AVX-512 host must never be read on an AVX2-only one (its code would not run).
`SPECJAX_COMPILE_CACHE=0` turns it off; `specjax cache clear` empties it.

jax's cache still traces and lowers a program before it can look it up (about 2.5 s for a SmolLM2
slot step on 2 cores). The server's programs therefore go through `compile_or_load`, which keeps
each compiled executable itself under `$SPECJAX_CACHE/executables/`, keyed without tracing: by
specjax's own source, the jax versions, the CPU fingerprint, the backend, the XLA flags, the
program's static arguments and its arguments' shapes. A warm start loads each in well under a second.

The two caches do not mix in one process. On XLA:CPU an executable that jax loaded from its own
cache serialises without complaint but fails at its first run in the next process ("Function
slice_bitcast_fusion.5 not found"); only a fresh compile serialises soundly (measured, jax 0.10.2).
So `specjax serve` runs with jax's cache off and keeps its programs whole
(`enable_compile_cache(whole_executables=True)`), every other command uses jax's cache, and
`compile_or_load` writes an executable only in a process where jax's cache is off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
from pathlib import Path
from typing import Any

from specjax.files import cache_root, make_dir

COMPILE_CACHE_ENV = "SPECJAX_COMPILE_CACHE"
"""Set to 0 (or off, false, no) to compile everything anew in every process."""

MAX_BYTES = 4 << 30
"""jax evicts the least recently used entries past this size."""

MIN_COMPILE_SECONDS = 0.0
"""Programs that compile faster than this get no disk entry. Zero: every program is kept, so whether
a second start hits does not depend on how busy the machine was when the first one compiled (a
threshold of 0.2 s kept a tiny model's programs on a loaded host and none on a quiet one); the LRU
limit bounds the disk either way."""


def cpu_fingerprint(cpuinfo: str | None = None) -> str:
    """12 hex digits naming this CPU's model and instruction-set flags (AVX2, AVX-512, AMX, ...), from
    /proc/cpuinfo (or the text given)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: the machine name and Python's idea of the processor must do
            cpuinfo = ""
    model, flags = platform.processor(), ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        if key.strip() in ("flags", "Features") and not flags:
            flags = " ".join(sorted(value.split()))
    return hashlib.sha256(f"{platform.machine()}|{model}|{flags}".encode()).hexdigest()[:12]


def compile_cache_dir() -> Path:
    """This machine's and this jax's folder of the persistent compilation cache."""
    import jax
    import jaxlib

    return cache_root() / "xla" / f"jax{jax.__version__}-jaxlib{jaxlib.__version__}-{cpu_fingerprint()}"


def compile_cache_enabled() -> bool:
    return os.environ.get(COMPILE_CACHE_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def enable_compile_cache(whole_executables: bool = False) -> Path | None:
    """Point jax's persistent cache at compile_cache_dir(), unless SPECJAX_COMPILE_CACHE turns it off;
    with whole_executables, turn jax's cache off instead, so that `compile_or_load` may keep what this
    process compiles (see the module's docstring). Call before the first compilation: jax decides once
    per process whether it reads its cache. Returns the folder programs are kept in, or None when off."""
    if not compile_cache_enabled():
        return None
    import jax

    if whole_executables:
        jax.config.update("jax_enable_compilation_cache", False)
        return executables_dir()

    folder = make_dir(compile_cache_dir(), "the compilation cache")
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return folder


CACHE_FOLDERS = ("xla", "executables", "converted")
"""jax's persistent cache, specjax's store of whole executables and the models converted from GGUF
(io/gguf.py), under $SPECJAX_CACHE: what `specjax cache clear` empties."""


def cache_bytes(root: Path | None = None) -> int:
    """Bytes the compilation caches hold, every jax version and CPU kind together (or one folder's)."""
    folders = [root] if root is not None else [cache_root() / name for name in CACHE_FOLDERS]
    return sum(p.stat().st_size for folder in folders if folder.exists() for p in folder.rglob("*") if p.is_file())


def clear_compile_cache() -> int:
    """Remove every compiled program kept (all versions and CPU kinds); returns the bytes freed."""
    freed = cache_bytes()
    for name in CACHE_FOLDERS:
        if (cache_root() / name).exists():
            shutil.rmtree(cache_root() / name)
    return freed


# ---- whole executables, loaded without tracing ----

EXECUTABLE_HIT_EVENT = "/specjax/executables/hits"
EXECUTABLE_MISS_EVENT = "/specjax/executables/misses"
"""jax.monitoring events that compile_or_load records, so a caller (or a test) counts hits as it
counts jax's own cache hits."""


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of every .py file of the installed specjax: any change to the code that traces a
    program makes every stored executable a miss."""
    package = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def executables_dir() -> Path:
    """This machine's and this jax's folder of stored executables."""
    import jax
    import jaxlib

    return cache_root() / "executables" / f"jax{jax.__version__}-jaxlib{jaxlib.__version__}-{cpu_fingerprint()}"


def _avals(tree) -> str:
    """The tree's structure and each leaf's shape, dtype, weak type and placement, as text."""
    import jax

    leaves, structure = jax.tree.flatten(tree)
    return str(structure) + "|" + ";".join(
        f"{getattr(leaf, 'shape', ())}/{getattr(leaf, 'dtype', type(leaf).__name__)}/"
        f"{getattr(leaf, 'weak_type', False)}/{getattr(leaf, 'sharding', None)}" for leaf in leaves)


def executable_key(name: str, static: str, args: tuple) -> str:
    """What a stored executable depends on, hashed: the program (its name and static arguments as
    text), its arguments' shapes, specjax's source, the jax versions, the backend and its flags."""
    import jax

    device = jax.devices()[0]
    parts = [name, static, _avals(args), source_digest(), jax.__version__, device.platform, device.device_kind,
             device.client.platform_version, os.environ.get("XLA_FLAGS", ""),
             str(jax.config.jax_enable_x64), str(jax.config.jax_default_matmul_precision), str(jax.device_count())]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def jax_cache_in_use() -> bool:
    """Whether jax's persistent cache may serve this process's compiles (then nothing it compiles
    may be stored whole: the module's docstring says why)."""
    import jax

    return bool(jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)


def compile_or_load(jitted, name: str, static: str, args: tuple, out_like: Any):
    """jitted.lower(*args).compile(), or the same executable loaded from the store when an earlier
    process compiled it. static: the program's static arguments as text (their repr must name every
    value that changes the program); out_like: a tree with the structure of the program's output.
    A fresh compile is stored only where jax's own cache is off (`jax_cache_in_use`). Off with
    SPECJAX_COMPILE_CACHE=0; an executable that cannot be serialised is compiled every time."""
    import jax
    from jax.experimental import serialize_executable

    if not compile_cache_enabled():
        return jitted.lower(*args).compile()
    path = executables_dir() / f"{executable_key(name, static, args)}.bin"
    in_tree, out_tree = jax.tree.structure((args, {})), jax.tree.structure(out_like)
    if path.is_file():
        try:
            compiled = serialize_executable.deserialize_and_load(path.read_bytes(), in_tree, out_tree)
        except Exception:  # written by a process that died mid-way, or unreadable: compile anew
            path.unlink(missing_ok=True)
        else:
            os.utime(path)  # most recently used
            jax.monitoring.record_event(EXECUTABLE_HIT_EVENT)
            return compiled
    jax.monitoring.record_event(EXECUTABLE_MISS_EVENT)
    compiled = jitted.lower(*args).compile()
    if jax_cache_in_use():  # it may have come from jax's cache, and would then not run when loaded
        return compiled
    try:
        payload, _, _ = serialize_executable.serialize(compiled)
    except (ValueError, NotImplementedError):  # constants closed over, or a backend that cannot
        return compiled
    make_dir(path.parent, "the executable store")
    partial_path = path.with_suffix(f".{os.getpid()}.part")
    partial_path.write_bytes(payload)
    partial_path.replace(path)  # atomic: a reader sees the whole file or none
    _evict(path.parent.parent, MAX_BYTES)
    return compiled


def _evict(root: Path, limit: int) -> None:
    """Drop the least recently used stored executables (every version) until they fit in limit bytes."""
    files = sorted((p for p in root.rglob("*.bin") if p.is_file()), key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in files)
    for path in files:
        if total <= limit:
            break
        total -= path.stat().st_size
        path.unlink(missing_ok=True)
