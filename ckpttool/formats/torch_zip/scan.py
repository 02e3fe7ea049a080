"""``scan`` of a zip archive: every pickle the archive's own loader would unpickle, and what that
loader imports or runs by design (:mod:`ckpttool.formats.torch_zip.kinds`).

A ``torch.save`` zip's ``.pkl`` records (``torch.load``); a TorchScript archive's pickles and a
note (its code runs in ``torch.jit.load``); a torch.export archive's sample inputs, pickled
weights and constants, custom and opaque objects (each ``torch.load``-ed or unpickled by
``torch.export.load``), and a note for AOTInductor's compiled libraries; a torch.package
archive's pickles and a note naming the modules whose source ``PackageImporter`` would import.
Bytes a loader hands to ``torch.load`` are scanned as ``torch.load`` reads them: a zip is
walked as an archive of its own (recursively, to ``MAX_DEPTH`` archives deep and
``MAX_NESTED_BYTES`` read in all), anything else as a stream of pickles. Each finding inside an
archive names its place: ``data/sample_inputs/model.pt › model/data.pkl``.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any, BinaryIO

from ckpttool.errors import CkptError
from ckpttool.formats.base import CHECKPOINT_SUFFIXES, PLACE_SEPARATOR, Findings
from ckpttool.formats.torch_zip import kinds
from ckpttool.formats.torch_zip.reader import ambiguous_names, open_zip, read_record
from ckpttool.formats.torch_zip.zip_index import ZipIndex, ZipMember, case_collision, fold
from ckpttool.io.source import source_size
from ckpttool.pickle.scan import Counts, walk_globals, walk_stream_globals

ZIP_MAGIC = b"PK\x03\x04"
#: Archives inside archives scanned at most (a .pt2's sample inputs are one level down).
MAX_DEPTH = 4
#: Bytes of nested members read in all for one file: past it, a member is "could not scan".
MAX_NESTED_BYTES = 256 << 20
#: Protocols a torch.package pickle may start with (``\x80`` then the protocol).
_PROTOCOLS = frozenset(range(2, 6))


def scan_zip(path: Any, opener: Callable[[Any], BinaryIO]) -> Findings | None:
    """The zip's pickles' globals; None for a file that does not start as a zip's first record."""
    with opener(path) as handle:
        if handle.read(4) != ZIP_MAGIC:
            return None
    findings = Findings(kinds.TORCH_ZIP)
    with opener(path) as handle:
        _Walk(findings).archive(handle, (), 0)
    return findings


class _Walk:
    """One file's scan: the findings, and the nested bytes still allowed."""

    def __init__(self, findings: Findings) -> None:
        self.findings = findings
        self.budget = MAX_NESTED_BYTES

    def archive(
        self, handle: BinaryIO, place: tuple[str, ...], depth: int, size: int | None = None
    ) -> None:
        """Walk one zip archive, ``place`` the members it is nested in (none for the file),
        ``size`` its size when it is bytes in memory."""
        findings = self.findings
        archive = open_zip(handle)
        names = archive.namelist()
        kind = kinds.archive_kind(names)
        if depth == 0:
            findings.format = kind
        for note in _kind_notes(kind, names):
            findings.notes.append(_at(place, note))
        collision = case_collision(names)
        if collision is not None:
            findings.notes.append(_at(place, f"ambiguous: {ambiguous_names(*collision)}"))
        file_size = source_size(handle) if size is None else size
        roles = _roles(kind, archive, handle, file_size, findings, place)
        for info in archive.infolist():
            role = roles(info)
            if role is None:
                continue
            where = (*place, info.filename)
            limit = self.budget if depth or role != "pickle" else None
            try:  # bounded: a deflated record could inflate to gigabytes
                # as torch's reader reads it: a bad CRC-32 or a local header naming another
                # file does not stop torch.load from running the pickle
                if limit is None:
                    data = read_record(handle, info, archive, file_size, as_torch=True)
                else:
                    data = read_record(handle, info, archive, file_size, limit, as_torch=True)
            except CkptError as error:  # not scanned: the file could not be (fully) checked
                findings.problems.append(f"{_place(where)}: unreadable ({error})")
                continue
            if limit is not None:
                self.budget -= len(data)
            # a torch.save zip's (or TorchScript archive's) own records need no place
            plain = depth == 0 and kind in (kinds.TORCH_ZIP, kinds.TORCHSCRIPT)
            if role == "sniff" and data[:1] == b"\x80" and data[1:2] and data[1] in _PROTOCOLS:
                role = "pickle"  # a package resource that starts as the exporter's pickles
            if role == "sniff":
                self.resource(data, where)
            elif role == "pickle":
                self.pickle(data, where, plain, stream=False)
            elif role == "load":
                self.loaded(data, where, depth)

    def loaded(self, data: bytes, where: tuple[str, ...], depth: int) -> None:
        """Bytes a loader hands to ``torch.load``: a zip archive, or a stream of pickles."""
        if not data.startswith(ZIP_MAGIC):
            self.pickle(data, where, plain=False, stream=True)
        elif depth + 1 > MAX_DEPTH:
            self.findings.problems.append(
                f"{_place(where)}: an archive nested over {MAX_DEPTH} deep, not scanned"
            )
        else:
            try:
                self.archive(io.BytesIO(data), where, depth + 1, len(data))
            except CkptError as error:
                self.findings.problems.append(f"{_place(where)}: {error}")

    def resource(self, data: bytes, where: tuple[str, ...]) -> None:
        """A package resource that does not start as a protocol 2-5 pickle (text, binary, or a
        protocol 0-1 pickle ``load_pickle`` would still read when asked for it by name): its
        globals count when it is a whole pickle, or names an attack; otherwise it is taken for
        data (no "could not scan": a text or binary resource is no pickle)."""
        findings = self.findings
        counts, attack, problem = walk_globals(data, {})
        if problem and not attack:
            return
        findings.counts.update(counts)
        _record_places(findings, counts, _place(where))
        if attack:
            findings.notes.append(f"{_place(where)}: {attack}")

    def pickle(self, data: bytes, where: tuple[str, ...], plain: bool, stream: bool) -> None:
        findings = self.findings
        walk = walk_stream_globals if stream else walk_globals
        counts, attack, problem = walk(data, findings.written)
        findings.counts.update(counts)
        if not plain:
            _record_places(findings, counts, _place(where))
        if attack:
            findings.notes.append(f"{_place(where)}: {attack}")
        if problem:
            findings.problems.append(f"{_place(where)}: {problem}")


def _roles(
    kind: str,
    archive: ZipIndex,
    handle: BinaryIO,
    file_size: int,
    findings: Findings,
    place: tuple[str, ...],
) -> Callable[[ZipMember], str | None]:
    """What the kind's loader does with each member: ``"pickle"`` (unpickles it),
    ``"load"`` (``torch.load``-s it), ``"sniff"`` (unpickles it when asked for it by name: a
    torch.package resource that starts as a pickle), None (never unpickles it)."""

    def pickled(info: ZipMember) -> bool:  # torch's readers ignore case
        return fold(info.filename).endswith(".pkl")

    if kind == kinds.TORCH_EXPORT:
        configs = []
        for info in archive.infolist():
            inner = kinds.inner_name(info.filename)
            if inner.startswith((kinds.PT2_WEIGHTS, kinds.PT2_CONSTANTS)) and inner.endswith(
                ".json"
            ):
                try:
                    configs.append((info.filename, read_record(handle, info, archive, file_size)))
                except CkptError as error:
                    configs.append((info.filename, str(error).encode()))
        payloads, unreadable = kinds.pt2_pickled_payloads(configs)
        findings.problems.extend(_at(place, reason) for reason in unreadable)

        def export_role(info: ZipMember) -> str | None:
            if pickled(info):
                return "pickle"
            return kinds.pt2_member_role(kinds.inner_name(info.filename), payloads, not unreadable)

        return export_role
    if kind == kinds.TORCH_PACKAGE:

        def package_role(info: ZipMember) -> str | None:
            if pickled(info):
                return "pickle"
            inner = kinds.inner_name(info.filename)
            if inner.startswith(".data/") or inner.endswith(".py"):
                return None
            return "sniff"

        return package_role
    if not any(fold(name).endswith("data.pkl") for name in archive.namelist()):
        # no torch.save file: a zip of checkpoint files (stable-baselines3's model.zip), whose
        # reader torch.load-s each member named like one (docs/formats.md, "Containers")
        return lambda info: (
            "pickle"
            if pickled(info)
            else "load"
            if fold(info.filename).endswith(CHECKPOINT_SUFFIXES)
            else None
        )
    return lambda info: "pickle" if pickled(info) else None


def _kind_notes(kind: str, names: list[str]) -> list[str]:
    """What the kind's loader runs by design (a finding: dangerous whatever the pickles hold)."""
    if kind == kinds.TORCHSCRIPT:
        return ["a TorchScript archive: it carries code that torch.jit.load would run"]
    if kind == kinds.TORCH_PACKAGE:
        modules = kinds.package_modules(names)
        if modules:
            shown = ", ".join(modules[:10]) + (
                f" (+{len(modules) - 10} more)" if len(modules) > 10 else ""
            )
            return [
                "a torch.package archive that ships Python source PackageImporter imports "
                f"(runs) when a pickle or the user names it: {shown}"
            ]
    if kind == kinds.TORCH_EXPORT and any(
        kinds.inner_name(name).startswith(kinds.PT2_AOTINDUCTOR) for name in names
    ):
        return [
            "a torch.export archive with AOTInductor compiled code (data/aotinductor/): "
            "loading it runs native code"
        ]
    return []


def _record_places(findings: Findings, counts: Counts, place: str) -> None:
    for module, name, _ in counts:
        places = findings.places.setdefault((module, name), [])
        if place not in places:
            places.append(place)


def _place(where: tuple[str, ...]) -> str:
    return PLACE_SEPARATOR.join(where)


def _at(place: tuple[str, ...], text: str) -> str:
    return f"{_place(place)}: {text}" if place else text
