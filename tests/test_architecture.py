"""The layering rules of docs/ARCHITECTURE.md, checked on the imports the source files make."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "specjax"

RULES = [
    # (files, imports they must not make, why)
    ("models", ("specjax.decode", "specjax.serve", "specjax.monitor"), "models never import decoding"),
    ("pallas_kernels", ("specjax.",), "kernels are leaves"),
    ("monitor", ("specjax.decode", "specjax.serve"), "the monitor is a sink that others report to"),
    ("decode", ("specjax.serve", "fastapi", "starlette", "uvicorn"), "nothing below serve knows about HTTP"),
    ("train", ("specjax.serve", "fastapi", "starlette", "uvicorn"), "nothing below serve knows about HTTP"),
    ("io", ("specjax.decode", "specjax.serve"), "loading weights knows nothing of decoding"),
]


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
    offences = [f"{path.relative_to(PACKAGE.parent)} imports {module}"
                for path in sorted((PACKAGE / folder).glob("*.py"))
                for module in imported_modules(path) if module.startswith(banned)]
    assert not offences, f"{why}: " + "; ".join(offences)


def test_the_check_sees_a_banned_import(tmp_path):
    """The rule can fail: a file importing decoding from a model module is caught."""
    offender = tmp_path / "bad.py"
    offender.write_text("def f():\n    from specjax.decode.engine import Engine\n")
    assert any(m.startswith("specjax.decode") for m in imported_modules(offender))
