"""Record helpers that stand in for ``dataclasses.replace`` on hot paths agree with it."""

from __future__ import annotations

import dataclasses

import pytest

from ckpttool.checkpoint import open_checkpoint
from ckpttool.model.records import (
    OpaqueObject,
    StorageRecord,
    TensorRecord,
    count_once,
    nodes,
    object_classes,
    shared_storages,
    tensors,
    with_fields,
    with_key,
)
from tests.support.helpers import fixture_files

STORAGE = StorageRecord("0", "float32", 64, "cpu", "archive/data/0", 256)
RECORD = TensorRecord("w", "float32", (4, 4), (4, 1), 8, STORAGE, requires_grad=True)

CHANGES = [
    {"shape": (16,), "stride": (1,), "storage_offset": 12},
    {"key": "layers.0.weight"},
    {"dtype": "bfloat16", "kind": "parameter", "inline_data": b"\x00\x01"},
    {},
]


@pytest.mark.parametrize("changes", CHANGES)
def test_with_fields_is_dataclasses_replace(changes: dict[str, object]) -> None:
    copy = with_fields(RECORD, **changes)
    expected = dataclasses.replace(RECORD, **changes)
    assert copy == expected
    assert dataclasses.astuple(copy) == dataclasses.astuple(expected)  # compare=False fields too
    assert copy is not RECORD
    assert RECORD.shape == (4, 4) and RECORD.key == "w"  # the original is untouched


def test_with_key_is_dataclasses_replace() -> None:
    assert with_key(RECORD, "x.y") == dataclasses.replace(RECORD, key="x.y")


def test_with_fields_refuses_a_name_that_is_not_a_field() -> None:
    with pytest.raises(TypeError, match="shapes"):
        with_fields(RECORD, shapes=(1,))


def test_records_have_slots_and_copy_pickle_and_replace_as_before() -> None:
    """Slotted (no per-record ``__dict__``: 100,000 tensors are 100,000 records, twice)."""
    import copy
    import pickle

    inline = dataclasses.replace(RECORD, inline_data=b"\x01\x02")
    for value in (STORAGE, RECORD, inline):
        assert not hasattr(value, "__dict__")
        assert copy.copy(value) == value and copy.deepcopy(value) == value
        assert pickle.loads(pickle.dumps(value)) == value
    assert pickle.loads(pickle.dumps(inline)).inline_data == b"\x01\x02"
    with pytest.raises(dataclasses.FrozenInstanceError):  # storages are dict keys: frozen
        STORAGE.key = "other"  # type: ignore[misc]
    # tensor records are not frozen (a frozen dataclass's __init__ was a tenth of a tensor
    # call's walk), but slotted: no attribute outside the fields
    with pytest.raises(AttributeError):
        RECORD.not_a_field = 1  # type: ignore[attr-defined]


def test_with_key_copies_every_field_including_uncompared_ones() -> None:
    record = dataclasses.replace(RECORD, inline_data=b"\x00", layout="sparse_coo", quant=None)
    copy = with_key(record, "a.b")
    assert dataclasses.astuple(copy) == dataclasses.astuple(dataclasses.replace(record, key="a.b"))
    assert record.key == "w"


def test_equal_storages_hash_equal_and_group_together() -> None:
    twin = StorageRecord(*dataclasses.astuple(STORAGE))
    assert twin == STORAGE and twin is not STORAGE and hash(twin) == hash(STORAGE)
    other = dataclasses.replace(STORAGE, record="archive/data/1")  # same key, another record
    assert other != STORAGE
    a = with_key(RECORD, "a")
    b = TensorRecord("b", "float32", (4, 4), (4, 1), 8, twin)
    c = TensorRecord("c", "float32", (4, 4), (4, 1), 8, other)
    assert shared_storages([a, c, b]) == [["a", "b"]]


def test_shared_storages_in_order_of_each_storages_first_viewer() -> None:
    first, second = (dataclasses.replace(STORAGE, key=k) for k in ("s1", "s2"))
    views = [TensorRecord(k, "float32", (4,), (1,), 0, s) for k, s in
             (("a1", first), ("b1", second), ("b2", second), ("a2", first), ("b3", second))]  # fmt: skip
    assert shared_storages(views) == [["a1", "a2"], ["b1", "b2", "b3"]]
    # the same record listed twice views its storage twice, as before
    assert shared_storages([views[0], views[0]]) == [["a1", "a1"]]


def test_count_once_counts_a_storage_once_and_never_past_it() -> None:
    small = dataclasses.replace(STORAGE, key="small", numel=4)  # 16 bytes
    views = [
        TensorRecord("w", "float32", (4, 4), (4, 1), 0, STORAGE),  # 64 elements stored
        TensorRecord("tied", "float32", (4, 4), (4, 1), 0, STORAGE),  # the same region
        TensorRecord("t", "float32", (4, 4), (1, 4), 0, STORAGE),  # its transpose
        TensorRecord("big", "float32", (8,), (1,), 0, small),  # claims more than stored
        TensorRecord("meta", "float32", (3,), (1,), 0, None),
    ]
    assert count_once(views) == (16 + 4 + 3, {"float32": 64 + 16})
    assert count_once([views[0], views[0]]) == (16, {"float32": 64})


def test_tensors_and_tensor_keys_are_what_walk_gives_on_every_fixture() -> None:
    """The one-loop :func:`tensors` against the generic walk it replaces."""
    from ckpttool.checkpoint import open_checkpoint
    from ckpttool.errors import CkptError
    from ckpttool.model.records import OpaqueObject, tensor_keys, tensors, walk
    from tests.support.helpers import fixture_files

    def reference(node: object, prefix: str = "") -> list[TensorRecord]:
        return [with_key(leaf, key) for key, leaf in walk(node, prefix)
                if isinstance(leaf, TensorRecord)]  # fmt: skip

    opaque = OpaqueObject("m.C", (1,), {"w": RECORD, 3: [RECORD, {"x": RECORD}]})
    trees = [{"a": [RECORD, (RECORD,)], 7: {True: RECORD}, "o": opaque, "n": None}, RECORD, 5]
    for path in fixture_files():
        try:
            with open_checkpoint(path) as ckpt:
                trees.append(ckpt.root)
        except CkptError:  # the damaged fixtures are other tests'
            continue
    assert len(trees) > 50
    for tree in trees:
        for prefix in ("", "top"):
            expected = reference(tree, prefix)
            got = tensors(tree, prefix)
            assert [dataclasses.astuple(r) for r in got] == [
                dataclasses.astuple(r) for r in expected
            ]
            assert tensor_keys(tree, prefix) == [r.key for r in expected]


def test_nodes_is_a_depth_first_walk_with_containers_first() -> None:
    from ckpttool.model.records import OpaqueObject, nodes

    def reference(node: object) -> list[object]:  # the stack walk nodes() replaced
        out, stack = [], [node]
        while stack:
            current = stack.pop()
            out.append(current)
            if isinstance(current, dict):
                stack.extend(reversed(current.values()))
            elif isinstance(current, (list, tuple)):
                stack.extend(reversed(current))
            elif isinstance(current, OpaqueObject):
                stack.extend(reversed(current.fields().values()))
        return out

    opaque = OpaqueObject("m.C", (1,), {"w": RECORD, 3: [RECORD, {"x": 2.5}]})
    tree = {"a": [RECORD, (RECORD, "s")], 7: {True: RECORD, "e": {}}, "o": opaque, "n": None}
    for node in (tree, [tree, [[]], ()], RECORD, 5, opaque):
        assert [id(n) for n in nodes(node)] == [id(n) for n in reference(node)]


def test_with_key_sets_every_field_of_a_record() -> None:
    """with_key passes every field positionally: a field added to TensorRecord must be added there."""
    from ckpttool.model import records

    assert records._FIELD_NAMES == (
        "key", "dtype", "shape", "stride", "storage_offset", "storage", "requires_grad", "kind",
        "inline_data", "layout", "parts", "quant", "is_coalesced", "dtensor",
    )  # fmt: skip
    values = {f.name: object() for f in dataclasses.fields(TensorRecord)}
    record = TensorRecord(**values)  # type: ignore[arg-type]
    copy = with_key(record, "k")
    assert all(getattr(copy, name) is value for name, value in values.items() if name != "key")
    assert copy.key == "k"


def test_tensors_in_place_keys_each_record_once_and_copies_the_rest() -> None:
    """What the reader does with a freshly parsed tree: a keyless record takes its key where it
    is; a second name of the same record (a tied weight), an empty name, or a record keyed
    otherwise gets a copy, so no record in the list changes key afterwards."""
    tied = dataclasses.replace(RECORD, key="")
    alone = dataclasses.replace(RECORD, key="")
    named = dataclasses.replace(RECORD, key="named")  # as safetensors makes them
    root = {"a": {"w": tied}, "b": tied, "c": alone, "": dataclasses.replace(RECORD, key="")}
    root["named"] = named
    root["elsewhere"] = dataclasses.replace(RECORD, key="kept")
    listed = tensors(root, in_place=True)
    assert [r.key for r in listed] == ["a.w", "b", "c", "", "named", "elsewhere"]
    assert listed[0] is tied and listed[2] is alone and listed[4] is named  # keyed in place
    assert listed[1] is not tied and listed[1] == dataclasses.replace(tied, key="b")
    assert listed[5] is not root["elsewhere"] and root["elsewhere"].key == "kept"
    again = tensors(root)
    assert again == listed  # the same answer as copying every record
    # listed again: a record already keyed so is the tree's own, one keyed otherwise a copy
    assert again[0] is tied and again[2] is alone and again[4] is named
    assert again[1] is not tied and again[5] is not root["elsewhere"]
    assert root["elsewhere"].key == "kept" and tied.key == "a.w"


def test_object_classes_are_those_nodes_yields() -> None:
    """``object_classes``, the walk of ``show``'s warning, finds what ``nodes`` finds."""
    inner = OpaqueObject("m.Inner", (1,), {"t": RECORD})
    inner.dictitems = {"k": OpaqueObject("m.Item")}
    inner.listitems = [OpaqueObject("m.Listed")]
    outer = OpaqueObject("m.Outer", (), ({"x": inner}, {"slot": OpaqueObject("m.Slot")}))
    trees = [{"a": [outer, (OpaqueObject("m.InTuple"),)], "b": 1}, outer, RECORD, "leaf"]
    for path in fixture_files():
        with open_checkpoint(path) as ckpt:
            trees.append(ckpt.root)
    for tree in trees:
        expected = {node.cls for node in nodes(tree) if isinstance(node, OpaqueObject)}
        assert object_classes(tree) == expected
    assert object_classes(trees[0]) == {
        "m.Outer", "m.Inner", "m.Item", "m.Listed", "m.Slot", "m.InTuple"
    }  # fmt: skip
