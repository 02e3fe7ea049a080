"""ckpttool scan against other pickle scanners, over the whole hostile corpus: tables.

    python -m tools.scanner_compare [--work DIR] [--details]

Builds the hostile files of both corpora, each with its own marker: the pickle level
(:func:`tests.support.adversarial.hostile_pickles`) and the container level
(:data:`tests.support.containers.HOSTILE`: legacy streams in other protocols or with a payload
in another of their five pickles, torch's tar format, zip names differing in case, two zip end
records, a safetensors/pickle polyglot); and the benign ones: the torch-written files of both
builders (:func:`tests.support.adversarial.write_benign`, :data:`tests.support.containers.BENIGN`)
and every torch file among the repository's fixtures. Learns which hostile files are live by
loading each with ``torch.load(weights_only=False)`` in a throwaway child
(:mod:`tests.workers.liveness_worker`), then asks each scanner about every file, in file mode:
ckpttool, and picklescan, modelscan, fickling and modelaudit where installed (in a venv of
their own, never ckpttool's: ``python -m venv /work/scanners-venv``, a ``.pth`` file naming
ckpttool's venv's site-packages so torch is found, ``pip install picklescan modelscan fickling
modelaudit``, then run this module with that venv's Python; they are not dependencies of
ckpttool). Issue 50's corpus (:mod:`tests.support.effect_cases`) is part of the hostile side,
and its benign libraries' files and a transformers Trainer folder of the benign side. Prints, per tool, the live files
it flags (as dangerous, or with a warning), those it passes as clean, those it fails on, and
the benign files it flags; then, per class of the corpus, how many live files each tool
misses (``--details``: their names, and the benign files each tool calls dangerous).

Levels: ckpttool "dangerous" (a dangerous global, an ambiguous file) / "warning" (an unknown
global); picklescan infected / suspicious; modelscan CRITICAL or HIGH / MEDIUM or LOW; fickling
LIKELY_UNSAFE and above / POSSIBLY_UNSAFE or SUSPICIOUS. No tool here runs the files' code.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
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
    from ckpttool.commands.scan import scan
    from ckpttool.pickle.policy import Verdict

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


def modelaudit_verdict(path: Path) -> str:
    from modelaudit.core import scan_model_directory_or_file

    result = scan_model_directory_or_file(str(path))
    issues = result.get("issues", []) if isinstance(result, dict) else result.issues
    severities = {str(_field(issue, "severity")).lower().rpartition(".")[2] for issue in issues}
    if severities & {"critical", "error"}:
        return DANGEROUS
    if "warning" in severities:
        return WARNING
    return CLEAN


def _field(item: object, name: str) -> object:
    return item.get(name) if isinstance(item, dict) else getattr(item, name, None)


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
    "modelaudit": ("modelaudit", modelaudit_verdict),
}


#: Classes of the pickle-level corpus (:mod:`tests.support.adversarial`) by file name prefix.
PICKLE_CLASSES = {
    "frame_": "pickle: irregular FRAMEs",
    "first_opcode_": "pickle: any name, any first opcode",
    "stop_with_open_mark": "pickle: an error after the payload",
    "ext_after_payload": "pickle: an error after the payload",
    "garbage_after_payload": "pickle: an error after the payload",
    "deep_marks_then_payload": "pickle: an error after the payload",
}
#: Classes of the container-level corpus (:mod:`tests.support.containers`) by file name prefix.
CONTAINER_CLASSES = {
    "legacy_protocol": "container: legacy stream in protocol 4",
    "legacy_payload_in_": "container: payload in a legacy stream's other pickles",
    "tar_": "container: torch's pre-0.4 tar format",
    "zip_upper_case_": "container: zip names differing in case",
    "zip_two_": "container: two zip end records",
    "safetensors_pickle_polyglot": "container: safetensors that is also a pickle",
}


#: Classes of issue 50's corpus (:mod:`tests.support.effect_cases`) by file name prefix.
EFFECT_CLASSES = {
    "ext": "issue 50: EXT codes after copyreg.add_extension",
    "computed_": "issue 50: STACK_GLOBAL names computed at load time",
    "zip_": "issue 50: zips torch reads and a strict reader refuses",
    "load_from_bytes": "issue 50: bytes handed to a loader",
    "deserialize_": "issue 50: bytes handed to a loader",
    "npy_": "issue 50: bytes handed to a loader",
}


def file_class(name: str) -> str:
    """The corpus class of a hostile file, by its name."""
    from tests.support import adversarial, containers, effect_cases

    if name in effect_cases.HOSTILE:
        return next(
            (c for prefix, c in EFFECT_CLASSES.items() if name.startswith(prefix)),
            "issue 50: callables on no block-list that run code or touch files",
        )
    if name in containers.HOSTILE:
        return next(c for prefix, c in CONTAINER_CLASSES.items() if name.startswith(prefix))
    stem, _, suffix = name.partition(".")
    if stem in adversarial.PAYLOADS or stem == "unlisted_callable_p2":
        where = {"pkl": "a bare pickle", "zip.pth": "a torch zip", "legacy.pth": "a legacy stream"}
        return f"pickle: code execution in {where[suffix]}"
    for prefix, label in PICKLE_CLASSES.items():
        if name.startswith(prefix):
            return label
    return "pickle: gadgets of published scanner bypasses"


def build(work: Path) -> tuple[list[Path], list[Path], dict[str, list[Path]]]:
    """(live hostile files, hostile files torch.load does not run, benign files by source).

    The hostile files are the pickle-level corpus and the container-level one, in one folder,
    each with its own marker; the benign ones, those both corpora's builders write with torch
    and every torch file among the fixtures."""
    from tests.support import adversarial, containers, effect_cases

    hostile, markers = work / "hostile", work / "markers"
    hostile.mkdir(parents=True)
    markers.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = adversarial.hostile_pickles(lambda name: markers / name)
        assert not built.keys() & containers.HOSTILE.keys()
        built |= {name: make(markers / name) for name, make in containers.HOSTILE.items()}
        assert not built.keys() & effect_cases.HOSTILE.keys()
        built |= {name: make(markers / name) for name, make in effect_cases.HOSTILE.items()}
        for name, data in built.items():
            (hostile / name).write_bytes(data)
        benign = {"adversarial.write_benign": adversarial.write_benign(work / "benign")}
        (work / "benign-containers").mkdir()
        benign["containers.BENIGN"] = []
        for name, make_benign in containers.BENIGN.items():
            path = work / "benign-containers" / name
            path.write_bytes(make_benign())
            benign["containers.BENIGN"].append(path)
        (work / "benign-libraries").mkdir()
        benign["effect_cases.write_benign"] = effect_cases.write_benign(work / "benign-libraries")
        trainer = effect_cases.write_trainer_folder(work / "trainer")
        benign["a Trainer folder"] = sorted(
            p for p in trainer.rglob("*") if p.is_file() and p.suffix in (*FIXTURE_SUFFIXES, ".pth")
        )
    worker = [sys.executable, "-m", "tests.workers.liveness_worker", str(hostile), str(markers)]
    liveness = json.loads(subprocess.run(worker, cwd=REPO, capture_output=True, check=True).stdout)
    for marker in markers.iterdir():
        marker.unlink()
    live = [hostile / n for n, seen in sorted(liveness.items()) if seen["live"]]
    dead = [hostile / n for n, seen in sorted(liveness.items()) if not seen["live"]]
    fixtures = REPO / "tests" / "fixtures"
    benign["fixtures"] = sorted(p for p in fixtures.rglob("*") if p.suffix in FIXTURE_SUFFIXES)
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
        live, dead, benign_by_source = build(work)
        benign = [path for paths in benign_by_source.values() for path in paths]
        classes: dict[str, list[Path]] = {}
        for path in live:
            classes.setdefault(file_class(path.name), []).append(path)
        print(f"{len(live)} live hostile files ({len(dead)} more that torch.load does not run: "
              f"{', '.join(p.name for p in dead)}), {len(benign)} benign files ("
              + ", ".join(f"{len(p)} {s}" for s, p in benign_by_source.items()) + ")\n")  # fmt: skip
        print(
            "| tool | live files flagged | of them dangerous | live passed as clean "
            "| live: tool failed | benign flagged dangerous | benign with a warning |"
        )
        print("|---|---|---|---|---|---|---|")
        missed_by_tool: dict[str, set[Path]] = {}
        false_alarms: dict[str, list[Path]] = {}
        for name, (module, tool) in TOOLS.items():
            label = name
            if module is not None:
                try:
                    __import__(module)
                except ImportError:
                    print(f"| {name} | not installed | | | | | |")
                    continue
                label = f"{name} {importlib.metadata.version(module)}"
            on_live, on_benign = verdicts(tool, live), verdicts(tool, benign)
            flagged = sum(v in (DANGEROUS, WARNING) for v in on_live.values())
            dangerous = sum(v == DANGEROUS for v in on_live.values())
            clean = sum(v == CLEAN for v in on_live.values())
            failed = sum(v == ERROR for v in on_live.values())
            false_alarm = sum(v == DANGEROUS for v in on_benign.values())
            warned = sum(v == WARNING for v in on_benign.values())
            print(f"| {label} | {flagged} / {len(live)} | {dangerous} | {clean} | {failed} "
                  f"| {false_alarm} / {len(benign)} | {warned} |")  # fmt: skip
            missed_by_tool[label] = {p for p, v in on_live.items() if v in (CLEAN, ERROR)}
            false_alarms[label] = sorted(p for p, v in on_benign.items() if v == DANGEROUS)
        tools = list(missed_by_tool)
        print("\nLive files missed (passed as clean or failed on), by class:\n")
        print("| class | live files | " + " | ".join(tools) + " |")
        print("|---|---|" + "---|" * len(tools))
        for class_label, paths in sorted(classes.items()):
            cells = [str(len(missed_by_tool[t] & set(paths))) for t in tools]
            print(f"| {class_label} | {len(paths)} | " + " | ".join(cells) + " |")
        if args.details:
            print()
            for tool_label in tools:
                for class_label, paths in sorted(classes.items()):
                    missed = sorted(p.name for p in missed_by_tool[tool_label] & set(paths))
                    if missed:
                        print(f"{tool_label} misses, {class_label}: {', '.join(missed)}")
                for path in false_alarms[tool_label]:
                    shown = path.relative_to(work if path.is_relative_to(work) else REPO)
                    print(f"{tool_label} calls a benign file dangerous: {shown}")
        leftover = sorted(p.name for p in (work / "markers").iterdir())
        if leftover:
            raise SystemExit(f"a scanner ran a payload: {leftover}")


if __name__ == "__main__":
    main()
