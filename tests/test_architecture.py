"""The layering rules of docs/ARCHITECTURE.md, checked on the imports the source files make."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "specjax"

RULES = [
    # (files, imports they must not make, why)
    ("models", ("specjax.decode", "specjax.serve", "specjax.monitor", "specjax.train", "specjax.data"),
     "models never import decoding, training or data"),
    ("monitor", ("specjax.decode", "specjax.serve", "specjax.train", "specjax.models"),
     "the monitor is a sink that others report to"),
    ("decode", ("specjax.serve", "specjax.train", "fastapi", "starlette", "uvicorn"),
     "decoding knows neither HTTP nor training"),
    ("train", ("specjax.serve", "specjax.monitor", "fastapi", "starlette", "uvicorn"),
     "training runs the decode loop, never the server"),
    ("io", ("specjax.decode", "specjax.serve", "specjax.train", "specjax.data"), "loading weights knows nothing of decoding"),
    ("data", ("specjax.decode", "specjax.serve", "specjax.train", "specjax.monitor", "specjax.models"),
     "corpora, prompts and retrieval sit below decoding and training"),
]

KERNEL_IMPORTS = ("jax", "numpy", "specjax.pallas_kernels")
"""Kernels are leaves: they import jax, numpy, each other and the standard library, so a bare GPU
machine can run them."""


def imported_modules(path: Path) -> list[str]:
    """Every module a file imports, at top level or inside functions."""
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.append(node.module)
        elif isinstance(node, ast.Import):
            modules.extend(alias.name for alias in node.names)
    return modules


@pytest.mark.parametrize("folder, banned, why", RULES, ids=[r[0] for r in RULES])
def test_layers_import_only_downwards(folder, banned, why):
    files = sorted((PACKAGE / folder).rglob("*.py"))
    assert files
    offences = [f"{path.relative_to(PACKAGE.parent)} imports {module}"
                for path in files for module in imported_modules(path) if module.startswith(banned)]
    assert not offences, f"{why}: " + "; ".join(offences)


def _kernel_import_allowed(module: str) -> bool:
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or any(module == m or module.startswith(m + ".") for m in KERNEL_IMPORTS)


def test_kernels_import_only_jax_numpy_and_each_other():
    files = sorted((PACKAGE / "pallas_kernels").rglob("*.py"))
    assert len(files) > 4  # the kernels' own folders are read, not only the package's top
    offences = [f"{path.relative_to(PACKAGE.parent)} imports {module}"
                for path in files for module in imported_modules(path) if not _kernel_import_allowed(module)]
    assert not offences, "kernels are leaves: " + "; ".join(offences)
    assert not _kernel_import_allowed("specjax.decode.engine") and not _kernel_import_allowed("flax.linen")


def test_the_check_sees_a_banned_import(tmp_path):
    """The rule can fail: a file importing decoding from a model module is caught."""
    offender = tmp_path / "bad.py"
    offender.write_text("def f():\n    from specjax.decode.engine import Engine\n")
    assert any(m.startswith("specjax.decode") for m in imported_modules(offender))


METHOD_NAMES = ("ar", "chain", "chain+refiner", "tree", "tree+refiner", "rapid", "rapid+block", "ngram", "auto",
                "adaptive")
"""Every registry method and the adaptive serving mode (kept in step with SLOT_METHODS below)."""


AMBIGUOUS = {"auto"}
"""Names that are also ordinary option values (`--dtype auto`): compared only with something named
after a method or policy do they count."""


def method_name_comparisons(path: Path) -> list[int]:
    """Lines where a method name is compared to a string literal (`m == "chain"`, `m in ("ar", ...)`,
    `"tree" in methods`)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for side in sides:
            elements = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            names = [e.value for e in elements if isinstance(e, ast.Constant) and e.value in METHOD_NAMES]
            others = " ".join(ast.unparse(o).lower() for o in sides if o is not side)
            if any(n not in AMBIGUOUS or "method" in others or "polic" in others for n in names):
                lines.append(node.lineno)
                break
    return lines


def test_only_the_registry_compares_method_names_to_literals():
    """The host side asks a method's registry entry (`SlotMethod`) what it needs; only the registry
    itself (decode/slots.py) and the serving config's ADAPTIVE constant spell method names."""
    from specjax.decode.slots import SLOT_METHODS

    assert set(SLOT_METHODS) | {"adaptive"} == set(METHOD_NAMES)
    allowed = {PACKAGE / "decode" / "slots.py", PACKAGE / "serve" / "config.py"}
    offences = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
                if path not in allowed for line in method_name_comparisons(path)]
    assert not offences, "method names compared to literals outside the registry: " + ", ".join(offences)


def test_the_method_name_check_sees_a_comparison(tmp_path):
    offender = tmp_path / "bad.py"
    offender.write_text('def f(method, stats):\n    if method == "tree":\n        pass\n'
                        '    ok = "auto" in stats and stats["dtype"] == "auto"\n    bad = method in ("ar", "chain")\n'
                        '    worse = "auto" in methods\n')
    assert method_name_comparisons(offender) == [2, 5, 6]
