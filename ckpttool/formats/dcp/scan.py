"""``scan`` of a DCP directory: its ``.metadata``, then every stored item's pickles (torch reads
the first with ``pickle.load`` and the values with ``torch.load(weights_only=False)``, so they
matter as much as any checkpoint's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, BinaryIO

from ckpttool.errors import CkptError, UnsafePickleError
from ckpttool.formats.base import Findings
from ckpttool.formats.dcp.directory import METADATA, DcpFiles, load_metadata, present
from ckpttool.io.source import join, member_sizes
from ckpttool.pickle.scan import tally, walk_globals


def scan_dcp(path: Any, opener: Callable[[Any], BinaryIO]) -> Findings:
    """Globals of a DCP directory's every pickle: ``.metadata``, then each stored item's."""
    found = Findings("dcp")
    metadata = join(str(path), METADATA)
    with opener(metadata) as handle:
        found.counts, attack, problem = walk_globals(handle.read(), found.written)
    if attack or problem:  # the metadata cannot be trusted to say where the items are
        found.notes = [f"{METADATA}: {attack}"] if attack else []
        found.problems = [f"{METADATA}: {problem}"]
        return found
    try:
        with opener(metadata) as handle:
            _, meta = load_metadata(handle, refuse_dangerous=False)
    except CkptError as error:  # not DCP metadata (an attack's pickle?): report its globals
        found.problems = [f"{METADATA}: {error}"]
        return found
    sizes = member_sizes(str(path), list(meta.files))
    files = DcpFiles(path, sizes)
    try:
        for what, span in meta.items():
            if not present(span, sizes):
                found.problems.append(f"{what}: {span} is not in the directory")
            elif files.pread(span.file, span.offset, min(4, span.length)) == b"PK\x03\x04":
                try:
                    archive = files.archive(span, refuse_dangerous=False)
                except UnsafePickleError as error:  # BUILD on a global
                    found.notes.append(f"{what}: {error}")
                    continue
                except CkptError as error:
                    found.problems.append(f"{what}: {error}")
                    continue
                if archive.pickle is not None:
                    tally(found.counts, found.written, archive.pickle)
    finally:
        files.close()
    return found
