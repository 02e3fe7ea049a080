"""The walker's fast path for DCP ``.metadata`` entries (``ckpttool.formats.dcp.pickle_call``) against the
general loop: the same parsed metadata (or the same error), the same expanded size and reused
weight as ``finalize`` counts them, the same globals.

Inputs: the committed DCP fixture (written by ``torch.distributed.checkpoint.save`` on two
ranks), ``Metadata`` objects built here from torch's own DCP classes in layouts the fixture lacks
(0 and 5 dimensions, 1,500 chunks, offsets past 2**31, long names, shared objects, transforms,
several pickle protocols), hand-made hostile turns on a record (shared, rebuilt, passed to a
call), and every single-byte mutation of a small metadata pickle's entries.
"""

from __future__ import annotations

import pickle
import pickletools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpttool.errors import CkptError
from ckpttool.formats.dcp import pickle_layout as dcp_layout
from ckpttool.formats.dcp.metadata import parse_metadata
from ckpttool.formats.dcp.pickle_call import DCP_CALL
from ckpttool.pickle import interpreter
from ckpttool.pickle.interpreter import SafeUnpickler
from tests.support.dcp_cases import DCP


def _walk(data: bytes, fast: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What a walk of ``data`` gives: the parsed metadata or the error, finalize's counts, the
    globals, and whether records were made and kept."""
    counts: list[tuple[int, int]] = []
    original = interpreter._finalize

    def counted(*args: Any) -> Any:
        tree, total, reused = original(*args)
        counts.append((total, reused))
        return tree, total, reused

    monkeypatch.setattr(interpreter, "_finalize", counted)
    unpickler = SafeUnpickler(data, fast_path=fast, compact=DCP_CALL)
    try:
        result = unpickler.load()
        try:
            outcome: Any = ("parsed", parse_metadata(result.root))
        except CkptError as error:
            outcome = ("refused", type(error).__name__, str(error))
    except CkptError as error:
        outcome = ("walk failed", type(error).__name__, str(error))
    return {
        "outcome": outcome,
        "counts": counts[-1:],  # the finalize that gave the result (after any redo)
        "globals": unpickler.result.globals_seen,
        # records made and kept; -1: made, then the pickle walked again without them
        "records": unpickler.compacts if unpickler.compact or not fast else -1,
    }


def _same(data: bytes, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The fast walk, after checking it equals the general one."""
    fast, slow = _walk(data, True, monkeypatch), _walk(data, False, monkeypatch)
    assert slow["records"] == 0
    assert {k: v for k, v in fast.items() if k != "records"} == {
        k: v for k, v in slow.items() if k != "records"
    }
    return fast


# -- metadata objects made with torch's classes -----------------------------------------------


def _properties(dtype: torch.dtype = torch.float32, requires_grad: bool = False) -> Any:
    return TensorProperties(dtype=dtype, requires_grad=requires_grad)


def _metadata(tensors: dict[str, tuple[Any, list[tuple[Any, Any]]]], **extra: Any) -> Metadata:
    """A Metadata: each tensor's (size, [(chunk offsets, chunk sizes)]) stored one after another
    in ``__0_0.distcp``; ``extra``: more state_dict_metadata (values) or storage_data."""
    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    offset = 0
    for fqn, (size, chunks) in tensors.items():
        made = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]
        state[fqn] = TensorStorageMetadata(_properties(), torch.Size(size), made)
        for index, chunk in enumerate(made):
            length = 1000 + 4 * int(torch.Size(chunk.sizes).numel())
            storage[MetadataIndex(fqn, chunk.offsets, index)] = _StorageInfo(
                "__0_0.distcp", offset, length
            )
            offset += length
    state.update(extra.get("values", {}))
    storage.update(extra.get("storage", {}))
    planner = {fqn: ("model", fqn) for fqn in state}
    return Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage)


def _many(count: int, size: tuple[int, ...] = (4, 4)) -> dict[str, Any]:
    return {f"layers.{i}.weight": (size, [((0,) * len(size), size)]) for i in range(count)}


def _layouts() -> dict[str, Metadata]:
    big = _metadata(_many(3))
    first = next(iter(big.storage_data))
    big.storage_data[first] = _StorageInfo("__1_0.distcp", 5 * 2**31 + 7, 2**33)  # LONG1
    shared_chunk = _metadata(_many(4))
    chunks = [m.chunks for m in shared_chunk.state_dict_metadata.values()]  # type: ignore[union-attr]
    chunks[3][0] = chunks[1][0]  # one ChunkStorageMetadata object in two tensors
    shared_tensor = _metadata(_many(4))
    entries = shared_tensor.state_dict_metadata
    entries["layers.3.weight"] = entries["layers.1.weight"]
    shared_size = _metadata(_many(4))
    for key, info in list(shared_size.storage_data.items()):  # the chunk's own Size object
        tensor = shared_size.state_dict_metadata[key.fqn]
        assert isinstance(tensor, TensorStorageMetadata)
        del shared_size.storage_data[key]
        shared_size.storage_data[MetadataIndex(key.fqn, tensor.chunks[0].offsets, 0)] = info
    transformed = _metadata(_many(3))
    for info in transformed.storage_data.values():
        info.transform_descriptors = ["zstd"]
    long_name = "model." + "very_long_module_name." * 4 + "weight"  # >= 64 characters
    values = {"step": BytesStorageMetadata()}
    value_storage = {MetadataIndex("step"): _StorageInfo("__0_0.distcp", 0, 900)}
    split = [((0, 0), (3, 8)), ((3, 0), (5, 8))]
    return {
        "plain": _metadata(_many(5)),
        "many entries (LONG_BINGET)": _metadata(_many(300)),
        "shapes of 0, 1, 3 and 5 dims": _metadata(
            {
                "scalar": ((), [((), ())]),
                "vector": ((300,), [((0,), (300,))]),
                "cube": ((2, 3, 4), [((0, 0, 0), (2, 3, 4))]),
                "five": ((1, 2, 1, 2, 70000), [((0,) * 5, (1, 2, 1, 2, 70000))]),
                "again": ((2, 3, 4), [((0, 0, 0), (2, 3, 4))]),
            }
        ),
        "split chunks": _metadata({"a": ((8, 8), split), "b": ((8, 8), split)}),
        "1,500 chunks (two APPENDS batches)": _metadata(
            {"a": ((1500,), []), "b": ((1500,), [((i,), (1,)) for i in range(1500)])}
        ),
        "offsets past 2**31": big,
        "long names": _metadata(
            {long_name: ((2,), [((0,), (2,))]), long_name + "2": ((2,), [((0,), (2,))])}
        ),
        "values": _metadata(_many(3), values=values, storage=value_storage),
        "requires_grad and bf16": _requires_grad(),
        "a chunk object shared by two tensors": shared_chunk,
        "a tensor entry shared by two names": shared_tensor,
        "MetadataIndex with the chunk's own Size": shared_size,
        "transform descriptors": transformed,
    }


def _requires_grad() -> Metadata:
    metadata = _metadata(_many(4))
    for tensor in list(metadata.state_dict_metadata.values())[1:3]:
        assert isinstance(tensor, TensorStorageMetadata)
        tensor.properties = _properties(torch.bfloat16, requires_grad=True)
    return metadata


LAYOUTS = _layouts()


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_metadata_layouts_read_the_same(
    name: str, protocol: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = pickle.dumps(LAYOUTS[name], protocol=protocol)
    fast = _same(data, monkeypatch)
    assert fast["outcome"][0] in ("parsed", "refused")
    if protocol == 2:  # BINPUT, not MEMOIZE: the general loop's
        assert fast["records"] == 0
    elif "shared by two" in name:  # a GET of what a record replaced: walked again
        assert fast["records"] == -1
    else:  # every entry but the first of each class (named by STACK_GLOBAL)
        assert fast["records"] > 0


def test_the_fast_path_reads_nearly_every_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    data = pickle.dumps(LAYOUTS["many entries (LONG_BINGET)"])
    # 300 tensors with a chunk each: 300 TensorStorageMetadata, 300 MetadataIndex, 300
    # _StorageInfo, of which the first of each class is read by the general loop
    assert _same(data, monkeypatch)["records"] == 3 * 299


def test_records_of_one_kind_are_read_with_one_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    kinds = [((4, 4), [((0, 0), (4, 4))]), ((8,), [((0,), (8,))]), ((70000,), [((0,), (70000,))]),
             ((8, 8), [((0, 0), (3, 8)), ((3, 0), (5, 8))])]  # fmt: skip
    tensors = {f"t{i}": kinds[i % 4] for i in range(400)}
    data = pickle.dumps(_metadata(tensors))
    # 400 tensor entries, 500 chunks of a MetadataIndex and a _StorageInfo; each first by the
    # loop, and one a FRAME opcode (every 64 KiB) cuts
    frames = sum(op.name == "FRAME" for op, _, _ in pickletools.genops(data))
    assert 400 + 2 * 500 - 3 - frames <= _same(data, monkeypatch)["records"] <= 400 + 2 * 500 - 3
    unpickler = SafeUnpickler(data, compact=DCP_CALL)
    unpickler.load()
    made = {name: (kind.made, kind.hits) for name, kind in unpickler.call_state.items()}
    # a layout per kind of tensor entry and of storage record (offsets of 1-, 2-, 4-byte ints)
    assert made["TensorStorageMetadata"] == (4, 400 - 1 - 4)
    assert made["_StorageInfo"][0] <= 6 and made["_StorageInfo"][1] > 480
    # this MetadataIndex fetches its chunk's own Size (its memo index differs each time): no
    # layout fits twice, so after 2 x 16 of them none is made or tried
    assert made["MetadataIndex"][0] == 2 * dcp_layout.MAX_LAYOUTS
    assert made["MetadataIndex"][1] < 2 * dcp_layout.MAX_LAYOUTS


def test_the_dcp_fixture_reads_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    fast = _same((DCP / ".metadata").read_bytes(), monkeypatch)
    assert fast["outcome"][0] == "parsed" and fast["records"] > 20


# -- hostile turns on a record: the walk is done again, with the general loop's result ---------


def _entry_end(data: bytes, after: int) -> int:
    """The offset just past the BUILD that ends the second TensorStorageMetadata entry."""
    first = data.index(b"layers.1.weight", after)
    # its chunk's SETITEMS BUILD, the chunk list's APPEND, its own SETITEMS BUILD
    return data.index(b"ubaub", first) + 5


def _turns() -> dict[str, Callable[[bytes], bytes]]:
    def dup(data: bytes) -> bytes:  # the record also becomes a key: reached twice
        end = _entry_end(data, 0)
        return data[:end] + b"2\x8c\x01z" + data[end:]

    def rebuild(data: bytes) -> bytes:  # BUILD on the record with an empty state
        end = _entry_end(data, 0)
        return data[:end] + b"}b" + data[end:]

    def called(
        data: bytes,
    ) -> bytes:  # set((record,)): GLOBAL builtins.set <record> TUPLE1 x2 REDUCE
        end = _entry_end(data, 0)
        start = data.index(b"\x94", data.rindex(b"layers.1.weight", 0, end)) + 1
        return data[:start] + b"cbuiltins\nset\n" + data[start:end] + b"\x85\x85R" + data[end:]

    return {"DUP of a record": dup, "BUILD on a record": rebuild, "a record in a call": called}


def _unframed(data: bytes) -> bytes:
    """``data`` without its FRAME opcodes: a splice would leave their lengths wrong (a frame
    that does not end on an opcode is refused as ambiguous, ckpttool/pickle/frames.py)."""
    kept, last = [], 0
    for opcode, _, pos in pickletools.genops(data):
        if opcode.name == "FRAME":
            kept.append(data[last:pos])
            last = pos + 9
    return b"".join(kept) + data[last:]


@pytest.mark.parametrize("turn", list(_turns()))
def test_a_record_touched_by_the_pickle_is_read_again(
    turn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _turns()[turn](_unframed(pickle.dumps(LAYOUTS["plain"])))
    fast = _same(data, monkeypatch)
    assert fast["records"] == -1  # the record was met: the whole pickle walked again


# -- single-byte mutations ---------------------------------------------------------------------

REPLACEMENTS = b"\x00\x01\x02\x7f\x80\xff()tuabesNKMJ\x8ahj\x94\x8c\x85\x86R\x81}]2\x88\x89"


def test_every_mutation_of_the_entries_reads_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    split = [((0, 0), (3, 8)), ((3, 0), (5, 8))]
    tensors = {"a": ((8, 8), split), "b": ((8, 8), split), "c": ((8, 8), split), "d": ((8,), [])}
    data = pickle.dumps(_metadata(tensors))
    # from the second tensor entry (read and made a layout of; the third is read with it) to
    # the last storage record
    start = data.index(b"\x8c\x01b") - 1
    end = data.index(b"storage_meta")
    assert end - start > 700
    for at in range(start, end):
        for byte in REPLACEMENTS:
            if data[at] != byte:
                mutated = data[:at] + bytes([byte]) + data[at + 1 :]
                fast, slow = _walk(mutated, True, monkeypatch), _walk(mutated, False, monkeypatch)
                del fast["records"], slow["records"]
                assert fast == slow, (at, bytes([byte]))
    for end in range(start, len(data), 7):  # truncated
        fast, slow = _walk(data[:end], True, monkeypatch), _walk(data[:end], False, monkeypatch)
        del fast["records"], slow["records"]
        assert fast == slow, end


def test_a_redo_keeps_the_walks_time_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk done again runs within the first walk's deadline, not a fresh one."""
    plain = pickle.dumps(LAYOUTS["many entries (LONG_BINGET)"])
    data = _turns()["DUP of a record"](plain)
    calls = [0]

    def clock() -> float:  # one second per reading: the walk reads it at every opcode
        calls[0] += 1
        return float(calls[0])

    monkeypatch.setattr(interpreter.time, "monotonic", clock)
    monkeypatch.setattr(interpreter, "CHECK_EVERY", 1)
    monkeypatch.setattr(interpreter, "MAX_SECONDS", 1e9)
    readings = {}
    for fast in (True, False):
        calls[0] = 0
        SafeUnpickler(plain, fast_path=fast, compact=DCP_CALL).load()
        readings[fast] = calls[0]
    # enough for either walk alone, not for both
    monkeypatch.setattr(interpreter, "MAX_SECONDS", float(max(readings.values()) + 10))
    with pytest.raises(CkptError, match="to walk"):
        SafeUnpickler(data, compact=DCP_CALL).load()
    monkeypatch.setattr(interpreter, "MAX_SECONDS", float(sum(readings.values()) + 10))
    assert SafeUnpickler(data, compact=DCP_CALL).load().root is not None


def test_a_size_equal_to_a_checked_one_is_still_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """(4.0, 4) equals the (4, 4) checked before it; it is refused all the same."""
    metadata = _metadata(_many(3))
    tensor = metadata.state_dict_metadata["layers.2.weight"]
    assert isinstance(tensor, TensorStorageMetadata)
    tensor.chunks[0] = ChunkStorageMetadata(torch.Size([0, 0]), (4.0, 4))  # type: ignore[arg-type]
    outcome = _same(pickle.dumps(metadata), monkeypatch)["outcome"]
    assert outcome[0] == "refused" and "chunk sizes is (4.0, 4)" in outcome[2]


def test_only_a_dcp_metadata_walk_makes_records() -> None:
    """Any other pickle naming these classes (a hostile data.pkl) gets the general loop's
    objects: other readers do not know the records."""
    data = pickle.dumps(LAYOUTS["plain"])
    asked = SafeUnpickler(data, compact=DCP_CALL)
    asked.load()
    unpickler = SafeUnpickler(data)
    state = unpickler.load().root.state
    assert asked.compacts > 0 and unpickler.compacts == 0
    kinds = {type(v).__name__ for v in state["state_dict_metadata"].values()}
    assert kinds == {"OpaqueObject"}
