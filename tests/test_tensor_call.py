"""The walker's fast path for tensor calls (``ckpttool.pickle.tensor_call``) against the general
loop: the same tree, the same shared objects, the same memo, the same error at the same offset.

Three sources of input: every committed fixture and framework file (whole reader: ``show``'s
JSON report and ``verify``'s result), the hostile corpus, and every single-byte mutation of the
first tensor calls of a small ``torch.save`` pickle written here (shapes of 0 to 4 dimensions,
1-, 2- and 4-byte ints, views of one storage, parameters, memo indices past 255).
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpttool.checkpoint import open_checkpoint
from ckpttool.commands.show import build_report
from ckpttool.commands.verify import verify
from ckpttool.errors import CkptError
from ckpttool.model.records import GlobalRef, OpaqueObject, StorageRecord, TensorRecord
from ckpttool.pickle import interpreter, tensor_call
from ckpttool.pickle.interpreter import load_pickle
from ckpttool.render.show import render_json
from tests.support.adversarial import corpus
from tests.support.helpers import FIXTURES, fixture_files, fixture_id


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Counts the fast path's answers (True: read, False: left to the general loop)."""
    answers: list[bool] = []
    original = tensor_call.tensor_call

    def counted(*args: Any) -> Any:
        made = original(*args)
        answers.append(made is not None)
        return made

    monkeypatch.setattr(interpreter, "tensor_call", counted)
    return answers


def _outcome(read: Any, monkeypatch: pytest.MonkeyPatch, fast: bool) -> Any:
    monkeypatch.setattr(interpreter, "FAST_PATH", fast)
    try:
        return ("ok", read())
    except CkptError as error:
        return (type(error).__name__, str(error))


def _show(path: Path) -> str:
    with open_checkpoint(path) as ckpt:
        return json.dumps(render_json(build_report(ckpt)), sort_keys=True, default=str)


def _verify(path: Path) -> str:
    return json.dumps([vars(result) for result in verify([path])], default=str, sort_keys=True)


CHECKPOINTS = fixture_files() + sorted(
    p for p in (FIXTURES / "frameworks").rglob("*") if p.suffix in (".pth", ".pt", ".bin", ".ckpt")
)
DCP = sorted(p.parent for p in FIXTURES.rglob(".metadata"))


@pytest.mark.parametrize("path", CHECKPOINTS + DCP, ids=fixture_id)
def test_fixtures_read_the_same_with_and_without_it(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for read in (lambda: _show(path), lambda: _verify(path)):
        assert _outcome(read, monkeypatch, True) == _outcome(read, monkeypatch, False)


def test_the_fixtures_exercise_it(calls: list[bool]) -> None:
    """The comparison above is not vacuous: the fast path reads most fixture tensors."""
    for path in CHECKPOINTS:
        try:
            _show(path)
        except CkptError:
            pass
    assert calls.count(True) > 1000
    assert calls.count(True) > 4 * calls.count(False)


def test_hostile_corpus_fails_the_same_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "PWNED"
    for name, data in corpus(marker).items():
        path = tmp_path / name
        path.write_bytes(data)
        fast = _outcome(lambda: _show(path), monkeypatch, True)  # noqa: B023 - called at once
        slow = _outcome(lambda: _show(path), monkeypatch, False)  # noqa: B023
        assert fast == slow, name
    assert not marker.exists()


# -- single-byte mutations of a pickle written by torch.save ---------------------------------


def _state_dict() -> dict[str, Any]:
    base = torch.arange(24, dtype=torch.float32)
    state: dict[str, Any] = {
        "scalar": torch.tensor(3.0),
        "vector": torch.zeros(300),  # numel 300: BININT2
        "matrix": torch.ones(2, 3, dtype=torch.bfloat16),
        "cube": torch.zeros(2, 2, 2, dtype=torch.int64),
        "four": torch.zeros(1, 2, 1, 2),  # MARK ... TUPLE: the general loop's
        "view": base[4:].view(4, 5),  # offset 4, shares base's storage
        "base": base,
        "big": torch.zeros(70_000, dtype=torch.uint8),  # numel past 65,535: BININT
        "param": torch.nn.Parameter(torch.ones(3)),
    }
    for i in range(40):  # memo indices past 255: LONG_BINPUT
        state[f"layer.{i}"] = torch.full((2, 2), float(i))
    return state


def _data_pkl() -> bytes:
    buffer = io.BytesIO()
    torch.save(_state_dict(), buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        return archive.read(name)


STORAGE_DTYPES = {"FloatStorage": "float32", "BFloat16Storage": "bfloat16", "LongStorage": "int64"}


def _walk(data: bytes, fast: bool) -> Any:
    """The walk of ``data`` as plain data (shared objects numbered), or the error it raises;
    with the storages ``persistent_load`` was asked for, in order."""
    storages: dict[str, StorageRecord] = {}

    def persistent_load(pid: Any) -> StorageRecord:  # torch_zip's rules, without an archive
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CkptError(f"unexpected persistent id {pid!r:.80}")
        _, storage_type, key, location, numel = pid
        key = str(key)
        if key not in storages:
            if not isinstance(storage_type, GlobalRef) or not isinstance(numel, int):
                raise CkptError("bad storage")
            dtype = STORAGE_DTYPES.get(storage_type.name, "uint8")
            storages[key] = StorageRecord(key, dtype, numel, str(location), key, numel)
        return storages[key]

    try:
        result = load_pickle(data, persistent_load=persistent_load, fast_path=fast)
    except CkptError as error:
        return (type(error).__name__, str(error))
    return canonical(result.root, {}), result.end, result.globals_seen, list(storages)


def canonical(node: Any, ids: dict[int, int]) -> Any:
    """``node`` as comparable plain data; containers and records carry the order in which they
    were first met, so two trees compare equal only if they share objects the same way."""
    if isinstance(node, (dict, TensorRecord, StorageRecord, OpaqueObject)):
        number = ids.setdefault(id(node), len(ids))
    if isinstance(node, dict):
        return ("dict", number, [(canonical(k, ids), canonical(v, ids)) for k, v in node.items()])
    if isinstance(node, (list, tuple, set, frozenset)):
        return (type(node).__name__, [canonical(v, ids) for v in node])
    if isinstance(node, TensorRecord):
        fields = {k: getattr(node, k) for k in TensorRecord.__dataclass_fields__}
        fields["storage"] = canonical(node.storage, ids) if node.storage else None
        fields["parts"] = [canonical(part, ids) for part in node.parts]
        return ("tensor", number, sorted(fields.items(), key=lambda item: item[0]))
    if isinstance(node, StorageRecord):
        return ("storage", number, repr(node))
    if isinstance(node, OpaqueObject):
        parts = (node.args, node.state, node.dictitems, node.listitems)
        return ("opaque", number, node.cls, [canonical(part, ids) for part in parts])
    return (type(node).__name__, repr(node))


def test_the_pickle_is_read_the_same(calls: list[bool]) -> None:
    data = _data_pkl()
    assert _walk(data, True) == _walk(data, False)
    # 49 tensors. The first names _rebuild_tensor_v2 by GLOBAL, not GET (no call here); the
    # general loop reads the first of each storage class (BFloat16, Long, Byte: their GLOBAL),
    # "four" (a shape of four dimensions) and "base" (its storage key is a GET: "view" came first)
    assert calls.count(True) == 43
    assert calls.count(False) == 5


#: Replacement bytes: opcodes the pattern holds or could be confused with, and boundaries.
REPLACEMENTS = b"\x00\x01\x04\x7f\x80\xff()tQRhjqrKMJX\x8c\x85\x86\x87\x88\x89N}e"


def test_every_mutation_of_the_first_calls_reads_the_same() -> None:
    data = _data_pkl()
    end = data.index(b"layer.2")  # the first tensors: every kind of call above, and two layers
    differ = []
    for at in range(2, end):
        for byte in REPLACEMENTS:
            if data[at] == byte:
                continue
            mutated = data[:at] + bytes([byte]) + data[at + 1 :]
            if _walk(mutated, True) != _walk(mutated, False):
                differ.append((at, byte))
    assert not differ


def test_truncations_read_the_same() -> None:
    data = _data_pkl()
    for end in range(0, len(data), 7):
        assert _walk(data[:end], True) == _walk(data[:end], False)


def test_more_layouts_than_it_keeps_read_the_same(
    calls: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """24 opcode patterns (rank 0 to 3, 1-, 2- and 4-byte sizes, requires_grad or not),
    interleaved three times: the layout cache (MAX_LAYOUTS) evicts and parses layouts again."""
    state: dict[str, Any] = {}
    for repeat in range(3):
        for rank in range(4):
            for size in (3, 300, 70_000):  # BININT1, BININT2, BININT
                for grad in (False, True):
                    shape = (size,) + (1,) * (rank - 1) if rank else ()
                    tensor = torch.zeros(shape).requires_grad_(grad)
                    state[f"t{repeat}.{rank}.{size}.{grad}"] = tensor
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    parsed: list[object] = []
    compile_layout = tensor_call.compile_layout

    def counted(raw: bytes, pos: int) -> Any:
        made = compile_layout(raw, pos)
        parsed.append(made)
        return made

    monkeypatch.setattr(tensor_call, "compile_layout", counted)
    assert _walk(data, True) == _walk(data, False)
    assert tensor_call.MAX_LAYOUTS < 24
    assert len([p for p in parsed if p is not None]) > 24  # evicted ones parsed again
    assert calls.count(True) == 71  # all 72 tensors but the first (its rebuild is a GLOBAL)
