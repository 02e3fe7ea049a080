"""``verify``: a full integrity check of a checkpoint file, trusting nothing in it.

Opening a file through the reader already checks the pickle, every storage's size against the
bytes present and every tensor's extent. ``verify`` adds what costs a full read, per format:
a zip's central directory against each local header, the CRC-32 of every record (streamed,
bounded memory) and records nothing refers to (``verify_zip``), every item of a DCP directory
(``verify_dcp``); optionally NaN/Inf in every floating tensor. It also reports temp files
that interrupted saves left next to the file. Problems are collected, not
raised, so one run lists all of them; with several paths, one that cannot be checked at all
(missing, not a checkpoint) gets its own verdict and the others are still checked.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckpttool.atomic import temp_name_pattern
from ckpttool.errors import EXIT_ERROR, EXIT_FOUND, CkptError, InputError, NotACheckpointError
from ckpttool.pickle.policy import Verdict, never_load_problem
from ckpttool.progress import ProgressCallback
from ckpttool.reader import Checkpoint, open_checkpoint
from ckpttool.source import is_url
from ckpttool.values import tensor_stats
from ckpttool.verify_zip import check_torch_zip


@dataclass
class VerifyResult:
    path: str
    format: str | None
    checked: list[str] = field(default_factory=list)  # what was checked, for the report
    problems: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)  # temp files of interrupted saves
    error: str | None = None  # why no check could run (missing, not a checkpoint)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.problems and not self.leftovers


def leftover_temp_files(path: Path) -> list[str]:
    """Temp files an interrupted save left beside ``path`` (ckpttool's and MiniMind's)."""
    directory = path.parent if str(path.parent) else Path(".")
    found = sorted(directory.glob(temp_name_pattern(path)))
    minimind_tmp = path.with_name(path.name + ".tmp")  # MiniMind: torch.save(tmp); os.replace
    if minimind_tmp.exists():
        found.append(minimind_tmp)
    return [str(p) for p in found]


def verify_file(
    path: str | os.PathLike[str],
    *,
    values: bool = False,
    progress: ProgressCallback | None = None,
) -> VerifyResult:
    """Check one file. Raises InputError/NotACheckpointError only when no check can run."""
    path = os.fspath(path) if is_url(path) else Path(path)
    result = VerifyResult(str(path), None, leftovers=_leftovers(path))
    try:
        ckpt = open_checkpoint(path, strict=False, refuse_dangerous=False)
    except (InputError, NotACheckpointError):
        raise
    except CkptError as error:  # corrupt, truncated, a resource bomb, BUILD on a global...
        result.problems.append(_without_path(error, path))
        return result
    with ckpt:
        result.format = ckpt.format
        extents = len(ckpt.tensors())
        result.checked.append(
            f"structure ({ckpt.format}), {extents} tensor extent{'s' * (extents != 1)}"
        )
        result.problems.extend(ckpt.problems)
        dangerous = {f"{m}.{n}" for m, n, v in _globals(ckpt) if v is Verdict.DANGEROUS}
        if dangerous:
            result.problems.append(never_load_problem("the pickle calls", dangerous))
        if ckpt.format == "torch-zip":
            zip_problems, spare = check_torch_zip(ckpt, progress)
            result.problems.extend(zip_problems)
            result.checked.append("zip directory vs local headers, CRC-32 of every record")
            if spare:
                records = f"{len(spare)} storage record{'s' * (len(spare) != 1)}"
                result.checked.append(f"note: {records} no tensor uses")
        if ckpt.format == "dcp":
            from ckpttool.verify_dcp import check_dcp

            dcp_problems, dcp_checked = check_dcp(ckpt, progress)
            result.problems.extend(dcp_problems)
            result.checked.extend(dcp_checked)
        if ckpt.format == "directory":
            from ckpttool.verify_directory import check_directory

            member_problems, member_checked = check_directory(ckpt, progress)
            result.problems.extend(member_problems)
            result.checked.extend(member_checked)
        if ckpt.format == "torch-legacy" and ckpt.details.get("trailing_bytes"):
            result.problems.append(
                f"{ckpt.details['trailing_bytes']:,} bytes after the last storage"
            )
        if values and not result.problems:
            result.problems.extend(_non_finite(ckpt))
            result.checked.append("values: NaN/Inf in floating tensors")
        ckpt.check_unchanged()  # a remote file replaced while it was checked: no verdict
    return result


def _leftovers(path: str | Path) -> list[str]:
    """Temp files beside a local file (a URL's neighbours are not listed)."""
    return [] if isinstance(path, str) else leftover_temp_files(path)


def _globals(ckpt: Checkpoint) -> list[tuple[str, str, Verdict]]:
    return list(ckpt.pickle.globals_seen) if ckpt.pickle is not None else []


def _non_finite(ckpt: Checkpoint) -> list[str]:
    problems = []
    for record in ckpt.tensors():
        if not record.is_floating or record.dtype.startswith("float8") or record.storage is None:
            continue
        stats = tensor_stats(ckpt, record)
        if stats.nan or stats.inf:
            problems.append(f"{record.key}: {stats.nan} NaN and {stats.inf} Inf values")
    return problems


def _without_path(error: CkptError, path: str | Path) -> str:
    """The error's message without the path the reader put first (the report names it)."""
    return str(error).removeprefix(f"{path}: ")


def verify(
    paths: Iterable[str | os.PathLike[str]],
    *,
    values: bool = False,
    progress: ProgressCallback | None = None,
) -> list[VerifyResult]:
    """Check every path on its own: one that cannot be checked at all (missing, a directory,
    not a checkpoint) gets a result with ``error`` set, and the run goes on."""
    results = []
    for raw in paths:
        try:
            results.append(verify_file(raw, values=values, progress=progress))
        except (InputError, NotACheckpointError) as error:
            path = os.fspath(raw) if is_url(raw) else Path(raw)
            results.append(
                VerifyResult(str(path), None, leftovers=_leftovers(path),
                             error=_without_path(error, path))
            )  # fmt: skip
    return results


def verify_exit_code(results: Sequence[VerifyResult]) -> int:
    """0 when every path was checked and is clean; 1 when a problem or a leftover temp file was
    found in any (this wins); 2 when some path could not be checked at all."""
    if any(r.problems or r.leftovers for r in results):
        return EXIT_FOUND
    if any(r.error is not None for r in results):
        return EXIT_ERROR
    return 0
