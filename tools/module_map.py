"""Write the module map in docs/development.md from each module's docstring.

    python -m tools.module_map            # from the repository root: rewrite the map
    python -m tools.module_map --check    # exit 1 if the map is not what this writes

The map lists the package floor by floor, top to bottom, in the order of the layers contract
in pyproject.toml (``[tool.importlinter]``, the one ``lint-imports`` checks), so the page and
the contract cannot disagree. Each line is a module's (or package's) name and the first line
of its docstring; a module without a docstring is an error. ``tests/test_docs.py`` runs the
check, as it does for docs/cli.md.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ckpttool"
PAGE = ROOT / "docs" / "development.md"
BEGIN = "<!-- module map: written by tools/module_map.py from the docstrings; do not edit -->"
END = "<!-- end of module map -->"
WIDTH = 100
NAME_COLUMN = 26


def floors() -> list[str]:
    """The top-level modules and packages in the layers contract's order, top floor first."""
    # read with a pattern, not tomllib: the package supports Python 3.10, which has none
    found = re.search(
        r'^type = "layers"\nlayers = \[\n(.*?)^\]',
        (ROOT / "pyproject.toml").read_text(),
        re.M | re.S,
    )
    if found is None:
        raise SystemExit("pyproject.toml: no layers contract under [tool.importlinter]")
    layers = re.findall(r'"([^"]+)"', found.group(1))
    names = [part.strip() for layer in layers for part in layer.split("|")]
    return [name.removeprefix("ckpttool.") for name in names]


def summary(path: Path) -> str:
    """The docstring's first sentence (its first paragraph, up to the first full stop that ends
    a line or is followed by a space)."""
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    if not docstring:
        raise SystemExit(f"{path.relative_to(ROOT)}: no docstring (every module opens with one)")
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[: end + 1]


def entry(name: str, text: str, depth: int) -> list[str]:
    """One module's lines: its name, then its summary wrapped in the second column."""
    indent = "  " * depth
    head = f"{indent}{name}"
    column = max(NAME_COLUMN, len(head) + 2)
    lines = textwrap.wrap(text, WIDTH - column) or [""]
    first = head.ljust(column) + lines[0]
    return [first] + [" " * column + line for line in lines[1:]]


def walk(path: Path, depth: int) -> list[str]:
    """A package's modules (alphabetical, ``__init__`` as the package's own line) and
    subpackages after them."""
    out: list[str] = []
    modules = sorted(p for p in path.glob("*.py") if p.name != "__init__.py")
    for module in modules:
        out += entry(module.name, summary(module), depth)
    for sub in sorted(p for p in path.iterdir() if (p / "__init__.py").is_file()):
        out += entry(sub.name + "/", summary(sub / "__init__.py"), depth)
        out += walk(sub, depth + 1)
    return out


def module_map() -> str:
    lines = ["ckpttool/"]
    lines += entry("__init__.py", summary(PACKAGE / "__init__.py"), 1)
    placed: set[str] = {"__init__"}
    for floor in floors():
        path = PACKAGE / floor
        if (path / "__init__.py").is_file():
            lines += entry(floor + "/", summary(path / "__init__.py"), 1)
            lines += walk(path, 2)
        else:
            lines += entry(floor + ".py", summary(path.with_suffix(".py")), 1)
        placed.add(floor)
    rest = sorted(
        p
        for p in PACKAGE.iterdir()
        if p.stem not in placed and (p.suffix == ".py" or (p / "__init__.py").is_file())
    )
    for path in rest:  # modules no floor names (``__main__``): listed last, never lost
        if path.suffix == ".py":
            lines += entry(path.name, summary(path), 1)
        else:
            lines += entry(path.name + "/", summary(path / "__init__.py"), 1)
            lines += walk(path, 2)
    return "\n".join(lines)


def rewritten(page: str) -> str:
    """The page with the text between the markers replaced by the map."""
    start, stop = page.find(BEGIN), page.find(END)
    if start < 0 or stop < start:
        raise SystemExit(f"{PAGE.relative_to(ROOT)}: the module map's markers are missing")
    block = f"{BEGIN}\n\n```\n{module_map()}\n```\n\n"
    return page[:start] + block + page[stop:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the map is out of date")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    new = rewritten(page)
    if args.check:
        if new != page:
            print(
                "docs/development.md: the module map is out of date; run python -m tools.module_map"
            )
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
