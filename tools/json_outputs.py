"""Every command's ``--json`` output on every fixture, written to one folder, to compare two versions.

    python -m tools.json_outputs OUT_DIR            # from the repository root
    diff -r BEFORE_DIR AFTER_DIR                   # a refactor must leave this empty

A refactor that claims "no behaviour change" (issue 26) is checked by running this before and after
and comparing the folders byte for byte. Each run of a command writes one file: the exit code, then
stdout, then stderr (errors are behaviour too). Commands run in-process through click's test runner,
in a fixed order, on copies where they write (``rescale-step`` in place, ``convert``), with the
temporary folder's path replaced by ``$TMP`` so that two runs compare equal.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
#: Suffixes of the files in tests/fixtures that are fixtures' sources or documents, not checkpoints.
NOT_CHECKPOINTS = {".py", ".md", ".pyc"}


def targets() -> Iterator[Path]:
    """Every file and every directory under tests/fixtures, in sorted order (sources left out)."""
    for path in sorted(FIXTURES.rglob("*")):
        if "__pycache__" in path.parts or path.suffix in NOT_CHECKPOINTS:
            continue
        yield path


def pairs() -> Iterator[tuple[Path, Path]]:
    """The pairs ``diff`` is run on: every two neighbours of pairs/, and each fixture with itself."""
    files = sorted(p for p in (FIXTURES / "pairs").iterdir() if p.is_file())
    yield from itertools.pairwise(files)
    for path in targets():
        yield path, path


def run(runner: CliRunner, args: list[str], tmp: Path) -> str:
    """One command's exit code, stdout and stderr, with fixture and temp paths made relative."""
    from ckpttool.cli import cli

    result = runner.invoke(cli, args, catch_exceptions=True)
    text = f"exit {result.exit_code}\n--- stdout\n{result.stdout}--- stderr\n{result.stderr}"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        text += f"--- exception\n{type(result.exception).__name__}: {result.exception}\n"
    return text.replace(str(tmp), "$TMP").replace(str(FIXTURES), "$FIXTURES")


def name(path: Path) -> str:
    return str(path.relative_to(FIXTURES)).replace(os.sep, "__") or "."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", help="run only the commands whose name starts with this")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runner = CliRunner()
    with tempfile.TemporaryDirectory(prefix="ckpttool-json-") as tmp_name:
        tmp = Path(tmp_name)
        jobs: list[tuple[str, list[str], Path | None]] = []
        for path in targets():
            p = str(path)
            jobs += [
                (f"show__{name(path)}", ["show", "--json", p], None),
                (f"show-stats__{name(path)}", ["show", "--json", "--stats", p], None),
                (f"show-tree__{name(path)}", ["show", "--json", "--tree", p], None),
                (f"verify__{name(path)}", ["verify", "--json", "--values", p], None),
                (f"scan__{name(path)}", ["scan", "--json", p], None),
                (
                    f"convert__{name(path)}",
                    ["convert", "--json", p, str(tmp / "out.safetensors")],
                    None,
                ),
                (
                    f"convert-pth__{name(path)}",
                    ["convert", "--json", p, str(tmp / "out.pth")],
                    None,
                ),
                (
                    f"rescale-dry__{name(path)}",
                    ["rescale-step", "--json", "--dry-run", "--world-size", "3", p],
                    None,
                ),
                (
                    f"rescale__{name(path)}",
                    [
                        "rescale-step",
                        "--json",
                        "--world-size",
                        "3",
                        "-o",
                        str(tmp / "out" / path.name),
                        str(tmp / "in" / path.name),
                    ],
                    path,
                ),
            ]
        for a, b in pairs():
            jobs.append((f"diff__{name(a)}__{name(b)}", ["diff", "--json", str(a), str(b)], None))
        for job, argv_, copy_from in jobs:
            if args.only and not job.startswith(args.only):
                continue
            for stale in tmp.iterdir():
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
            if copy_from is not None:
                copy = tmp / "in" / copy_from.name
                (tmp / "out").mkdir()
                copy.parent.mkdir()
                shutil.copytree(copy_from, copy) if copy_from.is_dir() else shutil.copy(
                    copy_from, copy
                )
            (args.out / f"{job}.txt").write_text(run(runner, argv_, tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
