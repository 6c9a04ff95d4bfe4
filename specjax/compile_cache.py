"""JAX's persistent compilation cache, on by default for every `specjax` command.

A second start of `serve`, `demo`, `generate` or `bench` then loads its compiled programs from disk
instead of compiling them again (minutes on 2 CPU cores). Entries live under
`$SPECJAX_CACHE/xla/<jax and jaxlib versions>-<CPU fingerprint>/`: jax's own key covers the program,
the XLA flags, the backend and its version, but on CPU not the instruction set XLA compiled for, so
a cache filled on an AVX-512 host must never be read on an AVX2-only one (its code would not run).
`SPECJAX_COMPILE_CACHE=0` turns it off; `specjax cache clear` empties it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
from pathlib import Path

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


def enable_compile_cache() -> Path | None:
    """Point jax's persistent cache at compile_cache_dir(), unless SPECJAX_COMPILE_CACHE turns it off.
    Call before the first compilation. Returns the folder, or None when off."""
    if not compile_cache_enabled():
        return None
    import jax

    folder = make_dir(compile_cache_dir(), "the compilation cache")
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return folder


def cache_bytes(root: Path | None = None) -> int:
    """Bytes the compilation cache holds, every jax version and CPU kind together."""
    root = root or cache_root() / "xla"
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def clear_compile_cache() -> int:
    """Remove every compiled program kept (all versions and CPU kinds); returns the bytes freed."""
    root = cache_root() / "xla"
    freed = cache_bytes(root)
    if root.exists():
        shutil.rmtree(root)
    return freed
