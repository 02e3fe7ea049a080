"""The reader never runs code from a pickle and fails fast on resource bombs."""

from __future__ import annotations

import contextlib
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from ckpttool.errors import (
    CkptError,
    CorruptCheckpointError,
    ResourceLimitError,
    UnsafePickleError,
)
from ckpttool.model.records import BackReference
from ckpttool.pickle.interpreter import load_pickle
from tests.support import adversarial
from tests.support.timeouts import scaled

CONTAINERS = {
    "bare": lambda payload: payload,
    "zip": adversarial.torch_zip,
    "legacy": adversarial.legacy_stream,
}


@pytest.mark.parametrize("payload_name", sorted(adversarial.PAYLOADS))
def test_payloads_are_real(tmp_path: Path, payload_name: str) -> None:
    """Positive control: Python's own unpickler does run each payload."""
    marker = tmp_path / "ran"
    payload = adversarial.PAYLOADS[payload_name](marker)
    code = "import pickle, sys, time; pickle.loads(sys.stdin.buffer.read()); time.sleep(0.2)"
    subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, check=False)
    assert marker.exists()


@pytest.mark.parametrize("container", sorted(CONTAINERS))
@pytest.mark.parametrize("payload_name", sorted(adversarial.PAYLOADS))
def test_payload_refused_and_not_run(tmp_path: Path, payload_name: str, container: str) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / f"{payload_name}.{container}"
    path.write_bytes(CONTAINERS[container](adversarial.PAYLOADS[payload_name](marker)))
    with pytest.raises(UnsafePickleError, match="refusing to read"):
        open_checkpoint(path)
    result = CliRunner().invoke(cli, ["show", str(path)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {path}: refusing to read: the pickle calls ")
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.output + result.stderr
    assert not marker.exists()


def test_scan_mode_records_dangerous_globals_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    result = load_pickle(adversarial.global_reduce_p0(marker), refuse_dangerous=False)
    assert ("os", "system", "dangerous") in result.globals_seen
    assert result.root.cls == "os.system"  # an opaque record of the would-be call
    assert not marker.exists()


def test_build_on_a_global_is_refused() -> None:
    with pytest.raises(UnsafePickleError, match=r"BUILD to modify collections\.OrderedDict"):
        load_pickle(adversarial.build_on_allowed_global())
    import collections

    assert collections.OrderedDict.__repr__ is not 1  # noqa: F632 - the class is untouched


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize(
    ("build", "error"),
    [
        (adversarial.memo_bomb, None),  # a single memo entry: reads fine, a None
        (adversarial.binbytes8_terabyte, CorruptCheckpointError),
        (adversarial.deep_nesting, ResourceLimitError),
        (adversarial.deep_marks, ResourceLimitError),
        (adversarial.self_reference, [BackReference("list")]),  # a list holding itself: read
    ],
)
def test_resource_bombs_fail_fast_in_little_memory(build, error) -> None:  # type: ignore[no-untyped-def]
    before = _peak_rss_mb()
    start = time.monotonic()
    if error is None or isinstance(error, list):
        assert load_pickle(build()).root == error
    else:
        with pytest.raises(error):
            load_pickle(build())
    assert time.monotonic() - start < scaled(5)  # a hang's bound: they fail in milliseconds
    assert _peak_rss_mb() - before < 100


@pytest.mark.parametrize(("build", "message"), adversarial.BROKEN_ARCHIVES)
def test_broken_archives_are_refused(tmp_path: Path, build, message: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "broken.pth"
    with (
        pytest.warns(UserWarning)
        if build is adversarial.duplicate_data_pkl
        else contextlib.nullcontext()
    ):
        path.write_bytes(build())
    with pytest.raises(CorruptCheckpointError, match=message):
        open_checkpoint(path)


def test_corpus_script_writes_files_every_one_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with pytest.warns(UserWarning):  # zipfile warns about the duplicate name, as it should
        paths = adversarial.write_corpus(tmp_path / "corpus", marker)
    readable = []
    for path in paths:
        try:
            open_checkpoint(path).close()
            readable.append(path.name)
        except CkptError:
            pass
    assert sorted(readable) == [
        "bad_crc.pth",  # damage inside a record: verify's CRC check finds it
        "deflated_storage.pth",  # values unreadable in place: verify and convert say so
        "local_header_mismatch.pth",  # found when a record is read, and by verify
        "memo_bomb.pth",  # harmless: an index past the memo list is one dict entry
        "self_reference.pth",  # a list holding itself: a back-reference, as parent links are
        "text_line_flood.pkl",  # a long but valid protocol-0 pickle
        "unlisted_callable_p2.legacy.pth",  # unknown callables become opaque records
        "unlisted_callable_p2.pkl",
        "unlisted_callable_p2.zip.pth",
    ]
    assert not marker.exists()
