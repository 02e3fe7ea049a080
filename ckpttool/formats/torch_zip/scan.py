"""``scan`` of a zip archive: the globals of every ``.pkl`` record ``torch.load`` (or
``torch.jit.load``, for a TorchScript archive: a note, it carries code) would unpickle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, BinaryIO

from ckpttool.errors import CkptError
from ckpttool.formats.base import Findings
from ckpttool.formats.torch_zip.reader import ambiguous_names, is_torchscript, open_zip, read_record
from ckpttool.formats.torch_zip.zip_index import case_collision, fold
from ckpttool.io.source import source_size
from ckpttool.pickle.scan import walk_globals


def scan_zip(path: Any, opener: Callable[[Any], BinaryIO]) -> Findings | None:
    """The zip's pickles' globals; None for a file that does not start as a zip's first record."""
    with opener(path) as handle:
        if handle.read(4) != b"PK\x03\x04":
            return None
    found = _pickles_of_zip(path, opener)
    for name, data in found.pickles:
        counts, attack, problem = walk_globals(data, found.findings.written)
        found.findings.counts.update(counts)
        if attack:
            found.findings.notes.append(f"{name}: {attack}")
        if problem:
            found.findings.problems.append(f"{name}: {problem}")
    return found.findings


class _Pickles:
    def __init__(self, findings: Findings, pickles: list[tuple[str, bytes]]) -> None:
        self.findings, self.pickles = findings, pickles


def _pickles_of_zip(path: Any, opener: Callable[[Any], BinaryIO]) -> _Pickles:
    """The format, notes and unreadable records as findings, and (record name, pickle bytes) for
    a zip's .pkl records."""
    with opener(path) as handle:
        archive = open_zip(handle)
        names = archive.namelist()
        findings = Findings("torch-zip")
        if is_torchscript(names):
            findings.format = "torchscript"
            findings.notes.append(
                "a TorchScript archive: it carries code that torch.jit.load would run"
            )
        collision = case_collision(names)
        if collision is not None:
            findings.notes.append(f"ambiguous: {ambiguous_names(*collision)}")
        pickles = []
        file_size = source_size(handle)
        for info in archive.infolist():
            if fold(info.filename).endswith(".pkl"):  # torch's reader ignores case
                try:  # bounded: a deflated record could inflate to gigabytes
                    pickles.append((info.filename, read_record(handle, info, archive, file_size)))
                except CkptError as error:  # not scanned: the file could not be (fully) checked
                    findings.problems.append(f"{info.filename}: unreadable ({error})")
        return _Pickles(findings, pickles)
