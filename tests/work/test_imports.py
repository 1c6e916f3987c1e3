"""No import cycle between the worker packages: ``ember.jobs`` and ``ember.batch`` never
import each other (type-only imports included), and ``ember.work``, which both use,
imports neither."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ember

ROOT = Path(ember.__file__).parent
FORBIDDEN = {
    "jobs": {"ember.batch"},
    "batch": {"ember.jobs"},
    "work": {"ember.jobs", "ember.batch"},
}


def imported(path: Path) -> set[str]:
    """Every module an ``import`` or ``from … import`` names, anywhere in the file (in
    functions and ``if TYPE_CHECKING:`` blocks too); ``from ember import jobs`` counts as
    ``ember.jobs``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    bad = [
        f"{path.relative_to(ROOT.parent)}: {name}"
        for path in files
        for name in sorted(imported(path))
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package])
    ]
    assert not bad, bad
