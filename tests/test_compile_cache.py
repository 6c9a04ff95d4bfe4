"""The persistent compilation cache: a second process loads the first one's compiled programs (counted
as jax's cache hits, not merely the cache being on), kept per CPU kind, and cleared on request."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specjax.compile_cache import cpu_fingerprint

from conftest import build_tiny_hf

# A child process that runs one CLI command and reports jax's persistent-cache hits and misses.
_COUNTING = """
import json, sys
import jax.monitoring
counts = {"hits": 0, "misses": 0}
def count(event, **_):
    if event == "/jax/compilation_cache/cache_hits":
        counts["hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        counts["misses"] += 1
jax.monitoring.register_event_listener(count)
from specjax.cli import main
status = main(sys.argv[1:])
print("CACHE " + json.dumps(counts))
sys.exit(status)
"""


def _run(argv, cache_root, enabled="1"):
    env = dict(os.environ, SPECJAX_CACHE=str(cache_root), SPECJAX_COMPILE_CACHE=enabled)
    done = subprocess.run([sys.executable, "-c", _COUNTING] + argv, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("CACHE "))[6:])


def test_a_second_process_loads_the_compiled_programs_from_the_cache(tmp_path):
    tiny_folder = tmp_path / "model"
    build_tiny_hf("llama", seed=4).save_pretrained(tiny_folder)
    argv = ["generate", "--model", str(tiny_folder), "--prompt-ids", "1,2,3", "--max-new-tokens", "5",
            "--ignore-eos", "--json"]
    first = _run(argv, tmp_path)
    assert first["hits"] == 0 and first["misses"] >= 1
    second = _run(argv, tmp_path)
    assert second["hits"] >= 1 and second["misses"] == 0, second
    off = _run(argv, tmp_path, enabled="0")
    assert off == {"hits": 0, "misses": 0}
    kept = list((tmp_path / "xla").iterdir())
    assert len(kept) == 1 and kept[0].name.endswith(cpu_fingerprint())
    env = dict(os.environ, SPECJAX_CACHE=str(tmp_path))
    cleared = subprocess.run([sys.executable, "-m", "specjax.cli", "cache", "clear"], env=env, capture_output=True,
                             text=True, timeout=120)
    assert cleared.returncode == 0 and "removed" in cleared.stdout
    assert _run(argv, tmp_path)["hits"] == 0  # compiled anew after clearing


def test_a_cache_is_kept_per_cpu_kind():
    avx2 = "model name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma\n"
    amx = "model name\t: Intel Xeon\nflags\t\t: fpu sse avx avx2 fma avx512f avx512_bf16 amx_tile\n"
    assert cpu_fingerprint(avx2) != cpu_fingerprint(amx)
    assert cpu_fingerprint(avx2) == cpu_fingerprint(avx2.replace("avx avx2", "avx2 avx"))  # flag order is not a kind
    assert len(cpu_fingerprint()) == 12


@pytest.mark.slow  # 21 s; the generate test above checks cache hits in the default suite
def test_serve_compile_only_warms_the_cache_for_the_next_start(tmp_path):
    """`serve --compile-only` compiles what the server would run and exits without listening; a second
    one finds every program in the cache."""
    folder = tmp_path / "model"
    build_tiny_hf("llama", seed=4).save_pretrained(folder)
    argv = ["serve", "--model", str(folder), "--method", "ar", "--slots", "2", "--context-length", "64",
            "--max-new-tokens", "16", "--compile-only"]
    first = _run(argv, tmp_path)
    second = _run(argv, tmp_path)
    assert first["misses"] >= 3 and first["hits"] == 0
    assert second["misses"] == 0 and second["hits"] >= 3, (first, second)  # nothing compiled anew
