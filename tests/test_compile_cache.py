"""The persistent compilation cache: a second process loads the first one's compiled programs (counted
as jax's cache hits, not merely the cache being on), kept per CPU kind, and cleared on request."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specjax import compile_cache
from specjax.compile_cache import cpu_fingerprint

from conftest import build_tiny_hf

# A child process that runs one CLI command and reports jax's persistent-cache hits and misses.
_COUNTING = """
import json, sys
import jax.monitoring
counts = {"hits": 0, "misses": 0, "stored_hits": 0, "stored_misses": 0}
def count(event, **_):
    if event == "/jax/compilation_cache/cache_hits":
        counts["hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        counts["misses"] += 1
    elif event == "/specjax/executables/hits":
        counts["stored_hits"] += 1
    elif event == "/specjax/executables/misses":
        counts["stored_misses"] += 1
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
    assert off == {"hits": 0, "misses": 0, "stored_hits": 0, "stored_misses": 0}
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
    assert first["stored_misses"] >= 3 and first["stored_hits"] == 0
    # The server's programs come whole from the executable store: neither traced nor compiled anew.
    assert second["stored_hits"] == first["stored_misses"] and second["stored_misses"] == 0, (first, second)
    # jax's own cache is off in the server's process (the module's docstring says why).
    assert first["hits"] == first["misses"] == second["hits"] == second["misses"] == 0, (first, second)


_EVENTS: list[str] = []
_LISTENING: list[bool] = []


def _record(event, **_):
    _EVENTS.append(event)


def test_a_stored_executable_is_loaded_whole_and_keyed_by_what_changes_it(tmp_path, monkeypatch):
    """compile_or_load compiles once, then loads the executable without tracing (counted as a
    store hit) and computes the same, donation included; other static arguments, argument shapes or
    specjax source are misses; a damaged file is compiled anew; SPECJAX_COMPILE_CACHE=0 stores nothing."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import struct

    @struct.dataclass
    class State:
        x: jax.Array
        n: jax.Array

    def advance(params, state, scale):
        return state.replace(x=jnp.tanh(state.x @ params["w"]) * scale, n=state.n + 1)

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECJAX_COMPILE_CACHE", "1")
    if not _LISTENING:  # jax keeps listeners for the process
        jax.monitoring.register_event_listener(_record)
        _LISTENING.append(True)
    jitted = lambda scale: jax.jit(lambda p, s: advance(p, s, scale), donate_argnums=1)  # noqa: E731
    params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(16, 16)), jnp.float32)}
    state = lambda: State(jnp.ones((4, 16)), jnp.zeros((4,), jnp.int32))  # noqa: E731
    shape = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state())

    def run(scale, static=None, args=(params, shape)):
        _EVENTS.clear()
        compiled = compile_cache.compile_or_load(jitted(scale), "advance", static or f"scale={scale}", args,
                                                 out_like=shape)
        stored = [e.rsplit("/", 1)[-1] for e in _EVENTS if e.startswith("/specjax/executables/")]
        return compiled, stored

    first, events = run(2.0)
    assert events == ["misses"]
    second, events = run(2.0)
    assert events == ["hits"]
    want = jax.jit(lambda p, s: advance(p, s, 2.0))(params, state())
    got = second(params, state())
    assert np.array_equal(got.x, want.x) and got.n.tolist() == [1] * 4
    assert np.array_equal(first(params, state()).x, want.x)
    assert run(3.0)[1] == ["misses"]  # other static arguments
    wider = jax.tree.map(lambda a: jax.ShapeDtypeStruct((8, *a.shape[1:]), a.dtype), shape)
    assert run(2.0, args=(params, wider))[1] == ["misses"]  # other shapes
    monkeypatch.setattr(compile_cache, "source_digest", lambda: "other source")
    assert run(2.0)[1] == ["misses"]  # other specjax code
    monkeypatch.undo()
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECJAX_COMPILE_CACHE", "1")
    [stored] = [p for p in compile_cache.executables_dir().glob("*.bin")
                if p.name.startswith(compile_cache.executable_key("advance", "scale=2.0", (params, shape)))]
    stored.write_bytes(b"not an executable")
    again, events = run(2.0)
    assert events == ["misses"] and np.array_equal(again(params, state()).x, want.x)
    assert run(2.0)[1] == ["hits"]  # rewritten whole
    kept = len(list(tmp_path.rglob("*.bin")))
    monkeypatch.setenv("SPECJAX_COMPILE_CACHE", "0")
    assert run(5.0)[1] == [] and len(list(tmp_path.rglob("*.bin"))) == kept
    assert compile_cache.cache_bytes() > 0
    compile_cache.clear_compile_cache()
    assert compile_cache.cache_bytes() == 0 and not (tmp_path / "executables").exists()


_STORE_ONE = """
import sys
import jax, jax.numpy as jnp, numpy as np
from specjax import compile_cache
compile_cache.enable_compile_cache(whole_executables=sys.argv[1] == "whole")
hits = []
jax.monitoring.register_event_listener(lambda event, **_: hits.append(event == compile_cache.EXECUTABLE_HIT_EVENT))
def step(x, w):
    for layer in range(4):
        x = jax.nn.softmax(jnp.tanh(x @ w[layer]) * x.mean(-1, keepdims=True), axis=-1) + x
    return x
args = (jnp.ones((8, 64)), jnp.asarray(np.random.default_rng(0).normal(size=(4, 64, 64)) * 0.1, jnp.float32))
compiled = compile_cache.compile_or_load(jax.jit(step), "step", "", args, out_like=args[0])
assert np.array_equal(np.asarray(compiled(*args)), np.asarray(jax.jit(step)(*args)))
print("STORED", len(list(compile_cache.executables_dir().glob("*.bin"))), "LOADED", sum(hits))
"""


def test_only_a_process_without_jax_cache_stores_executables_and_they_run_in_the_next(tmp_path):
    """On XLA:CPU an executable that jax loaded from its own cache fails when stored and loaded in the
    next process: with jax's cache on (twice, so the second process hits it) nothing is stored; with
    it off the executable is stored, and a third process loads it and computes the same."""
    env = dict(os.environ, SPECJAX_CACHE=str(tmp_path), SPECJAX_COMPILE_CACHE="1")

    def stored(mode):
        done = subprocess.run([sys.executable, "-c", _STORE_ONE, mode], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        files, loaded = done.stdout.split("STORED ")[1].split(" LOADED ")
        return int(files), int(loaded)

    assert stored("jax") == (0, 0) and stored("jax") == (0, 0)
    assert stored("whole") == (1, 0)
    assert stored("whole") == (1, 1)  # loaded whole, run and compared
