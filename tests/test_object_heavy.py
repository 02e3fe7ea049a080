"""The tree walks that ``show``, ``convert`` and ``load_state_dict`` do after reading a pickle,
made cheap for a pickle of many small objects (bench/object_table.py), give what the plain
walks they replace give: each checked against that walk, as first written, on every fixture
and on trees built to hit their edge cases (names with dots, empty names, a section's name
that begins another key, a rescale history, tensors beside a lookup table); the walk's count
of the objects in its tree, which lets show and convert skip the searches for objects; and
the pickles the C unpickler reads that the walker refuses (why the walk stays Python)."""

from __future__ import annotations

import _pickle
import io
import pickle
from pathlib import Path
from typing import Any

import pytest

from ckpttool.checkpoint import open_checkpoint
from ckpttool.commands.convert.plan import MAX_FIELDS_PER_ENTRY, _is_small_scalar, collect_fields
from ckpttool.commands.show import build_report, text_field_parent
from ckpttool.errors import CkptError
from ckpttool.model.records import (
    OpaqueObject,
    StorageRecord,
    TensorRecord,
    TensorSubclassObject,
    children,
    holds_instance,
    is_container,
    join_key,
    nodes,
    object_classes,
    tensor_keys,
    tensor_subclasses,
    walk,
)
from ckpttool.model.roles import _holds_module, is_pickled_module, module_view, scalar_fields
from ckpttool.pickle.interpreter import MAX_LONG_BYTES, MAX_MARKS, load_pickle
from ckpttool.render.show import render_text
from tests.support.helpers import FIXTURES, fixture_files

#: every fixture, and those fixture_files leaves to their own tests (torch.load needs their
#: libraries there; ckpttool reads them like any other)
PATHS = [
    *fixture_files(),
    *sorted((FIXTURES / "torchao").glob("*.pt")),
    *sorted((FIXTURES / "ultralytics").glob("*.pt")),
    FIXTURES / "mmengine" / "iter_2.pth",
]


def _tensor(key: str = "") -> TensorRecord:
    storage = StorageRecord(key or "0", "float32", 4, "cpu", "data/0", 16)
    return TensorRecord(key, "float32", (4,), (1,), 0, storage)


def _module(**parameters: Any) -> OpaqueObject:
    return OpaqueObject("m.Net", (), {"_parameters": parameters, "_modules": {}})


def _subclass() -> TensorSubclassObject:
    return TensorSubclassObject(
        "torchao.X", {"qdata": _tensor(), "scale": _tensor()}, "float32", (4,)
    )


def _odd() -> dict[Any, Any]:
    """A tree for every branch: a lookup table, dotted and empty names, objects, subclasses."""
    lookup = {f"tok{i}": (i, 0.5, "w") if i % 2 else {"id": i, "pos": ("NN", i)} for i in range(80)}
    return {
        "model": {"w": _tensor(), "b": _tensor()},
        "model.x": 1,
        "mod": {"a": 1, "b": None},
        "": {"q": 2, "": {"r": 3}},
        "a.b": {"c": 1},
        "a": [1] * 70,
        "lookup": lookup,
        "big": {f"k{i}": i for i in range(MAX_FIELDS_PER_ENTRY + 1)},
        "exactly": {f"k{i}": i for i in range(MAX_FIELDS_PER_ENTRY)},
        "long": "x" * 2000,
        "nested_long": {"s": "x" * 2000, "n": 1},
        "mixed": {"t": _tensor(), "n": list(range(100))},
        "bytes": {"b": b"raw"},
        "objects": [OpaqueObject("m.C", (1,), {"x": 2}), {"deep": [[{"e": 1.5}]]}],
        "quantized": {"0": {"weight": _subclass()}},
        "rescaled_from": {"0": {"lr": 0.1, "step": 3}, "1": {"lr": 0.2}},
        "rescaled_from.2": {"lr": 0.3},
        "rescaled_from.1.lr": 0.25,  # the same key as one in rescaled_from: the later wins
        "rescaled": {"from": {"lr": 9}},
        "modules": {"ema": _module(w=_tensor())},
        "empty": {},
        "cfg": {"opt": {"lr": 0.1, "betas": [0.9] * 70}, "x": [1] * 70},  # section cfg.opt
        7: "seven",
        "step": 10,
    }


def _roots() -> list[tuple[str, Any]]:
    trees: list[tuple[str, Any]] = [("odd", _odd()), ("list", [_odd(), 1]), ("leaf", "leaf")]
    trees.append(("object", _module(w=_tensor())))
    trees.append(("empty", {}))
    for path in PATHS:
        name = str(path.relative_to(FIXTURES))
        with open_checkpoint(path) as ckpt:
            trees.append((name, ckpt.root))
            if ckpt.objects is not None:
                trees.append((f"{name} (objects)", ckpt.objects))
    return trees


ROOTS = _roots()


def _holds_module_reference(node: Any, depth: int) -> bool:
    """``roles._holds_module`` as first written."""
    if is_pickled_module(node):
        return True
    if depth >= 4:
        return False
    if node.__class__ is dict:
        return any(_holds_module_reference(value, depth + 1) for value in node.values())
    if node.__class__ in (list, tuple):
        return any(_holds_module_reference(value, depth + 1) for value in node)
    return False


def _tensor_subclasses_reference(
    node: Any, prefix: str = "", *, outermost: bool = False
) -> dict[str, TensorSubclassObject]:
    """``records.tensor_subclasses`` as first written (a keyed walk of every container)."""
    found: dict[str, TensorSubclassObject] = {}
    stack: list[tuple[str, Any]] = [(prefix, node)]
    while stack:
        key, current = stack.pop()
        if isinstance(current, TensorSubclassObject):
            found[key] = current
            if outermost:
                continue
        if is_container(current):
            stack.extend(
                (join_key(key, name), child)
                for name, child in reversed(list(children(current)))
                if is_container(child)
            )
    return found


def _collect_fields_reference(
    root: Any, section: str | None, selected_keys: set[str]
) -> tuple[dict[str, str], list[str]]:
    """``convert.plan.collect_fields`` as first written (a key for every leaf)."""
    import json

    def entry_name(key: str) -> str:
        if section and key.startswith(section + "."):
            return f"{section}.{key[len(section) + 1 :].split('.')[0]}"
        return key.split(".")[0]

    groups: dict[str, list[tuple[str, Any]]] = {}
    for key, leaf in walk(root):
        if isinstance(leaf, TensorRecord) and key in selected_keys:
            continue
        groups.setdefault(entry_name(key), []).append((key, leaf))
    fields: dict[str, str] = {}
    left_out: list[str] = []
    for entry, leaves in groups.items():
        if len(leaves) <= MAX_FIELDS_PER_ENTRY and all(_is_small_scalar(v) for _, v in leaves):
            fields.update({"ckpttool.field." + key: json.dumps(value) for key, value in leaves})
            continue
        count = sum(isinstance(v, TensorRecord) for _, v in leaves)
        parts = [f"{count} tensor{'s' * (count != 1)}"] if count else []
        others = len(leaves) - count
        if others:
            parts.append(f"{others} other value{'s' * (others != 1)}")
        left_out.append(f"{entry or '(root)'} ({', '.join(parts)})")
    return fields, left_out


@pytest.mark.parametrize(("name", "root"), ROOTS, ids=[name for name, _ in ROOTS])
def test_module_search_finds_what_the_plain_search_finds(name: str, root: Any) -> None:
    assert _holds_module(root, depth=0) is _holds_module_reference(root, 0)
    assert (module_view(root) is None) is not _holds_module_reference(root, 0)


def test_the_odd_tree_holds_a_module_and_a_subclass() -> None:
    """(So the two comparisons above and below are not only of empty answers.)"""
    assert _holds_module(_odd(), depth=0)
    assert list(tensor_subclasses(_odd())) == ["quantized.0.weight"]
    assert not holds_instance({"lookup": {"a": (1, "b")}, "m": [_tensor()]}, TensorSubclassObject)
    assert holds_instance([{"a": (1, [_subclass()])}], TensorSubclassObject)
    assert holds_instance(_subclass(), OpaqueObject)


@pytest.mark.parametrize(("name", "root"), ROOTS, ids=[name for name, _ in ROOTS])
def test_tensor_subclasses_as_the_keyed_walk_finds_them(name: str, root: Any) -> None:
    for outermost in (False, True):
        found = tensor_subclasses(root, "p", outermost=outermost)
        expected = _tensor_subclasses_reference(root, "p", outermost=outermost)
        assert list(found.items()) == list(expected.items())


def _sections(root: Any) -> list[str | None]:
    if not isinstance(root, dict):
        return [None, "model"]
    names = [name for name in root if isinstance(name, str)]
    dotted = [f"{name}.x" for name in names[:3]] + [name[:2] for name in names[:3]]
    dotted += [f"{n}.{k}" for n in names if isinstance(root[n], dict) for k in list(root[n])[:2]]
    return [None, "", *names, *dotted, "a.b.c", "rescaled_from.0"]


@pytest.mark.parametrize(("name", "root"), ROOTS, ids=[name for name, _ in ROOTS])
def test_convert_fields_as_a_key_for_every_leaf_gives_them(name: str, root: Any) -> None:
    keys = tensor_keys(root)
    for section in _sections(root):
        inside = {key for key in keys if section and key.startswith(f"{section}.")}
        for selected in (set(keys), inside, set()):
            assert collect_fields(root, section, selected) == _collect_fields_reference(
                root, section, selected
            ), section


@pytest.mark.parametrize(("name", "root"), ROOTS, ids=[name for name, _ in ROOTS])
def test_show_text_fields_are_the_full_fields_it_prints(name: str, root: Any) -> None:
    """Those the text prints (``render.show.render_text``: no dot, or the rescale history) are
    all there, with the same values (the later of two under one key wins) in the same order."""

    def printed(fields: dict[str, Any]) -> list[tuple[str, Any]]:
        return [(k, v) for k, v in fields.items() if "." not in k or k.startswith("rescaled_from.")]

    assert printed(scalar_fields(root, below=text_field_parent)) == printed(scalar_fields(root))


def test_the_odd_tree_has_fields_under_an_empty_name_and_a_history() -> None:
    fields = scalar_fields(_odd(), below=text_field_parent)
    assert fields["q"] == 2 and fields["r"] == 3  # under "" and "" again: no dot, printed
    assert fields["rescaled_from.1.lr"] == 0.2 and fields["rescaled_from.2.lr"] == 0.3
    assert "rescaled.from.lr" not in fields and "lookup.tok1.0" not in fields


@pytest.mark.parametrize("path", PATHS, ids=[str(p.relative_to(FIXTURES)) for p in PATHS])
def test_show_text_is_the_same_without_the_nested_fields(path: Path) -> None:
    with open_checkpoint(path) as ckpt:
        full = build_report(ckpt)
        text = build_report(ckpt, all_fields=False)
    assert render_text(text) == render_text(full)
    assert set(text.fields) <= set(full.fields)


#: Pickles the C unpickler (``_pickle.Unpickler``, find_class refused) reads without an error
#: and ckpttool's walker refuses, each for a limit or a check it keeps: why a C fast path
#: would need an opcode-by-opcode pre-check in Python first (docs/safety.md, "Why the walker
#: is Python, not the C unpickler").
C_READS_WALKER_REFUSES = {
    "MARKs still open at STOP": b"((N.",
    "items left on the stack at STOP": b"NN.",
    "BUILD of an object the pickle did not create": b")Nb.",
    "a NUL inside a text INT": b"I12\x00junk\n.",
    "MARKs nested past MAX_MARKS": b"(" * (MAX_MARKS + 1) + b"1" * (MAX_MARKS + 1) + b"N.",
    "a LONG4 past MAX_LONG_BYTES": b"\x8b"
    + (MAX_LONG_BYTES + 1).to_bytes(4, "little")
    + b"\x01" * (MAX_LONG_BYTES + 1)
    + b"0N.",
    "a FRAME whose end is not between two opcodes": (
        b"\x80\x04\x95\x03\x00\x00\x00\x00\x00\x00\x00K\x01K\x02."
    ),
}


@pytest.mark.parametrize("data", C_READS_WALKER_REFUSES.values(), ids=list(C_READS_WALKER_REFUSES))
def test_the_c_unpickler_reads_what_the_walker_refuses(data: bytes) -> None:
    class Refusing(_pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            raise AssertionError("no global in these pickles")

    Refusing(io.BytesIO(data)).load()  # no error
    with pytest.raises(CkptError):
        load_pickle(data)


class Point:  # pickled by reference: the walker reads it as an opaque object, never imports it
    def __init__(self, x: Any) -> None:
        self.x = x


def _distinct_objects(root: Any) -> int:
    return len({id(node) for node in nodes(root) if isinstance(node, OpaqueObject)})


def _pickles() -> list[tuple[str, bytes]]:
    shared = Point(1)
    looped = Point(None)
    looped.x = [looped]
    return [
        ("no object", pickle.dumps({"a": [1, (2, "b")], "c": {"d": 1.5}}, protocol=2)),
        ("one shared twice", pickle.dumps({"a": shared, "b": [shared, Point(2)]}, protocol=2)),
        ("a cycle", pickle.dumps({"loop": looped}, protocol=4)),
        ("nested", pickle.dumps(Point(Point(Point({"k": Point(0)}))), protocol=2)),
    ]


@pytest.mark.parametrize(("name", "data"), _pickles(), ids=[name for name, _ in _pickles()])
def test_the_walk_counts_the_objects_of_its_tree(name: str, data: bytes) -> None:
    result = load_pickle(data, refuse_dangerous=False)
    assert result.objects == _distinct_objects(result.root)
    assert (result.objects == 0) is (name == "no object")


@pytest.mark.parametrize("path", PATHS, ids=[str(p.relative_to(FIXTURES)) for p in PATHS])
def test_every_fixture_walk_counts_its_objects(path: Path) -> None:
    """(``_read_pickled_module`` skips the module search where the count is 0.)"""
    with open_checkpoint(path) as ckpt:
        result = ckpt.pickle
        if result is None:  # not a pickle (safetensors): nothing is known of its objects
            assert not ckpt.without_objects
            return
        assert result.objects == _distinct_objects(result.root)
        if ckpt.root is not result.root:  # a view: a pickled module read as its state dict
            assert result.objects and ckpt.objects is result.root


@pytest.mark.parametrize("path", PATHS, ids=[str(p.relative_to(FIXTURES)) for p in PATHS])
def test_a_tree_without_objects_has_nothing_the_shortcuts_skip(path: Path) -> None:
    """What ``Checkpoint.without_objects`` lets show and convert skip is empty indeed."""
    with open_checkpoint(path) as ckpt:
        if not ckpt.without_objects:
            assert ckpt.pickle is None or ckpt.pickle.objects or ckpt.root is not ckpt.pickle.root
            return
        assert not holds_instance(ckpt.root, OpaqueObject)
        assert tensor_subclasses(ckpt.root) == {} and object_classes(ckpt.root) == set()
        assert module_view(ckpt.root) is None


def test_some_fixtures_hold_objects_and_some_do_not() -> None:
    """(So the test above checks both sides.)"""
    seen = set()
    for path in PATHS:
        with open_checkpoint(path) as ckpt:
            seen.add(ckpt.without_objects)
    assert seen == {True, False}
