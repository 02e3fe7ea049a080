"""ckpttool scan against other pickle scanners, over the differential corpus: a table.

    python -m tools.scanner_compare [--work DIR]

Builds the hostile files of :func:`tests.support.adversarial.hostile_pickles` (each with its own
marker) and the benign ones (:func:`tests.support.adversarial.write_benign` plus every torch
file among the repository's fixtures), learns which hostile files are live by loading each with
``torch.load(weights_only=False)`` in a throwaway child (:mod:`tests.workers.liveness_worker`),
then asks each scanner about every file, in file mode: ckpttool, and picklescan, modelscan and
fickling where installed (``pip install picklescan modelscan fickling``; they are not
dependencies of ckpttool). Prints, per tool, the live files it flags (as dangerous, or with a
warning), those it passes as clean, those it fails on, and the benign files it flags.

Levels: ckpttool "dangerous" (a dangerous global, an ambiguous file) / "warning" (an unknown
global); picklescan infected / suspicious; modelscan CRITICAL or HIGH / MEDIUM or LOW; fickling
LIKELY_UNSAFE and above / POSSIBLY_UNSAFE or SUSPICIOUS. No tool here runs the files' code.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl")
DANGEROUS, WARNING, ERROR, CLEAN = "dangerous", "warning", "error", "clean"


def ckpttool_verdict(path: Path) -> str:
    from ckpttool.pickle.policy import Verdict
    from ckpttool.scan import scan

    report = scan([path])
    scanned = report.files[0] if report.files else None
    if scanned is None:
        return CLEAN
    if scanned.dangerous:
        return DANGEROUS
    if any(g.verdict is Verdict.UNKNOWN for g in scanned.globals):
        return WARNING
    return ERROR if scanned.error is not None else CLEAN


def picklescan_verdict(path: Path) -> str:
    from picklescan.scanner import scan_file_path

    result = scan_file_path(str(path))
    if result.infected_files:
        return DANGEROUS
    if getattr(result, "suspicious_count", 0):
        return WARNING
    return ERROR if result.scan_err else CLEAN


def modelscan_verdict(path: Path) -> str:
    from modelscan.modelscan import ModelScan

    result = ModelScan().scan(path)
    severities = result["summary"]["total_issues_by_severity"]
    if severities.get("CRITICAL") or severities.get("HIGH"):
        return DANGEROUS
    if severities.get("MEDIUM") or severities.get("LOW"):
        return WARNING
    return ERROR if result["errors"] else CLEAN


def fickling_verdict(path: Path) -> str:
    import fickling
    from fickling.analysis import Severity

    result = fickling.scan_file(str(path), graceful=True)
    if result.severity >= Severity.LIKELY_UNSAFE:
        return DANGEROUS
    if result.severity > Severity.LIKELY_SAFE:
        return WARNING
    return ERROR if result.errors else CLEAN


TOOLS: dict[str, tuple[str | None, Callable[[Path], str]]] = {
    "ckpttool scan": (None, ckpttool_verdict),
    "picklescan": ("picklescan", picklescan_verdict),
    "modelscan": ("modelscan", modelscan_verdict),
    "fickling": ("fickling", fickling_verdict),
}


def build(work: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """(live hostile files, hostile files torch.load does not run, benign files)."""
    from tests.support import adversarial

    hostile, markers = work / "hostile", work / "markers"
    hostile.mkdir(parents=True)
    markers.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, data in adversarial.hostile_pickles(lambda name: markers / name).items():
            (hostile / name).write_bytes(data)
        benign = adversarial.write_benign(work / "benign")
    worker = [sys.executable, "-m", "tests.workers.liveness_worker", str(hostile), str(markers)]
    liveness = json.loads(subprocess.run(worker, cwd=REPO, capture_output=True, check=True).stdout)
    for marker in markers.iterdir():
        marker.unlink()
    live = [hostile / n for n, seen in sorted(liveness.items()) if seen["live"]]
    dead = [hostile / n for n, seen in sorted(liveness.items()) if not seen["live"]]
    fixtures = REPO / "tests" / "fixtures"
    benign += sorted(p for p in fixtures.rglob("*") if p.suffix in FIXTURE_SUFFIXES)
    return live, dead, benign


def verdicts(tool: Callable[[Path], str], paths: list[Path]) -> dict[Path, str]:
    out = {}
    for path in paths:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                out[path] = tool(path)
            except Exception:  # the tool itself failed on the file
                out[path] = ERROR
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, help="folder for the corpus (default: a temp one)")
    parser.add_argument("--details", action="store_true", help="each live file each tool missed")
    args = parser.parse_args(argv)
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as temp:
        work = args.work or Path(temp)
        live, dead, benign = build(work)
        print(f"{len(live)} live hostile files ({len(dead)} more that torch.load does not run), "
              f"{len(benign)} benign files\n")  # fmt: skip
        print(
            "| tool | live files flagged | live passed as clean | live: tool failed "
            "| benign flagged dangerous | benign with a warning |"
        )
        print("|---|---|---|---|---|---|")
        for name, (module, tool) in TOOLS.items():
            if module is not None:
                try:
                    __import__(module)
                except ImportError:
                    print(f"| {name} | not installed | | | | |")
                    continue
            on_live, on_benign = verdicts(tool, live), verdicts(tool, benign)
            flagged = sum(v in (DANGEROUS, WARNING) for v in on_live.values())
            clean = sum(v == CLEAN for v in on_live.values())
            failed = sum(v == ERROR for v in on_live.values())
            false_alarm = sum(v == DANGEROUS for v in on_benign.values())
            warned = sum(v == WARNING for v in on_benign.values())
            print(f"| {name} | {flagged} / {len(live)} | {clean} | {failed} "
                  f"| {false_alarm} / {len(benign)} | {warned} |")  # fmt: skip
            if args.details:
                missed = [p.name for p, v in on_live.items() if v in (CLEAN, ERROR)]
                print(f"|   missed: {', '.join(missed)} |")
        leftover = sorted(p.name for p in (work / "markers").iterdir())
        if leftover:
            raise SystemExit(f"a scanner ran a payload: {leftover}")


if __name__ == "__main__":
    main()
