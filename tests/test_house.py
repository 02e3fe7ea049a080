"""The shape of the package: no import cycle and no import up a floor, type-only imports counted.

An import under ``if TYPE_CHECKING:`` runs nothing, but a reader still has to follow it: a
type that two floors share lives on the lower one (:class:`ckpttool.model.records.RecordReader`,
:class:`ckpttool.formats.base.FieldRewrite`). The floors are import-linter's contract
(pyproject.toml, run by ``.ci/run``); these tests check that the contract counts type-only
imports, and that the package has no cycle, which the floors alone do not rule out (a
format's module and the format registry stand on the same floor).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
_TYPE_ONLY_IMPORT = """from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from {target} import {name}


def held(value: {name}) -> {name}:
    return value
"""


def import_cycles(package: str, path: Path) -> list[list[str]]:
    """The import cycles of ``package`` (found under ``path``), imports under TYPE_CHECKING
    and inside functions counted: each a sorted list of modules (Tarjan's strongly connected
    components of more than one module)."""
    sys.path.insert(0, str(path))
    try:
        graph = grimp.build_graph(package, exclude_type_checking_imports=False, cache_dir=None)
    finally:
        sys.path.remove(str(path))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_the_package_has_no_import_cycle() -> None:
    assert import_cycles("ckpttool", ROOT) == []


def test_a_type_only_cycle_is_found(tmp_path: Path) -> None:
    # the positive control: two modules tied only through TYPE_CHECKING
    package = tmp_path / "circle"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "upper.py").write_text(_TYPE_ONLY_IMPORT.format(target="circle.lower", name="Low"))
    (package / "lower.py").write_text(
        _TYPE_ONLY_IMPORT.format(target="circle.upper", name="High") + "\n\nclass Low: ...\n"
    )
    assert import_cycles("circle", tmp_path) == [["circle.lower", "circle.upper"]]


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(lint), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": str(lint.parent)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_floors_contract_breaks_on_a_type_only_upward_import(tmp_path: Path) -> None:
    # A copy of the package with one module in io/ that names the door (checkpoint.py, five
    # floors up) only for a type annotation: the contract as configured must refuse it.
    shutil.copytree(
        ROOT / "ckpttool", tmp_path / "ckpttool", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    assert _lint_imports(tmp_path).returncode == 0, "the copy as it stands keeps its contracts"
    (tmp_path / "ckpttool" / "io" / "planted.py").write_text(
        _TYPE_ONLY_IMPORT.format(target="ckpttool.checkpoint", name="Checkpoint")
    )
    result = _lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ckpttool.io.planted -> ckpttool.checkpoint" in result.stdout
