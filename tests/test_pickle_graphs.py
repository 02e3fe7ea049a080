"""What real pickles hold that a naive walker refuses: Python 2 names and back-references.

``torch.save`` writes protocol 2, in which Python 3 names builtin types as Python 2 did
(``int`` as ``__builtin__ long``); ``pickle`` maps them back below protocol 3 only, and so does
the walker (``policy.python3_name``). Objects that refer back to what holds them (omegaconf's
``_parent``, any tree with parent links) are legitimate: the tree gets a
:class:`~ckpttool.model.records.BackReference` leaf there, and every limit still holds.
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest

from ckpttool.errors import ResourceLimitError, UnsafePickleError
from ckpttool.model.records import BackReference, GlobalRef, OpaqueObject, walk
from ckpttool.pickle.interpreter import MAX_DEPTH, load_pickle
from ckpttool.pickle.policy import Verdict, python3_name
from ckpttool.render.text import plain

BUILTIN_TYPES = [int, str, range, float, bool, bytes, bytearray, dict, list, tuple, set,
                 frozenset, complex, slice, ValueError]  # fmt: skip


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_builtin_types_read_as_python_loads_them(protocol: int) -> None:
    data = pickle.dumps(BUILTIN_TYPES, protocol=protocol)
    result = load_pickle(data)
    assert result.root == [GlobalRef("builtins", t.__name__) for t in BUILTIN_TYPES]
    assert {verdict for _, _, verdict in result.globals_seen} == {Verdict.SAFE}
    if protocol < 3:  # written with Python 2's names: the original is kept for scan
        assert result.renamed[("builtins", "int")] == ("__builtin__", "long")
        assert result.renamed[("builtins", "str")] == ("__builtin__", "unicode")
        assert result.renamed[("builtins", "range")] == ("__builtin__", "xrange")
        assert result.renamed[("builtins", "ValueError")] == ("exceptions", "ValueError")
    else:
        assert result.renamed == {}


def test_python2_names_are_mapped_only_below_protocol_3() -> None:
    """As ``pickle.Unpickler.find_class``: the protocol is the last PROTO's (none: 0)."""
    assert load_pickle(b"c__builtin__\nlong\n.").root == GlobalRef("builtins", "int")
    assert load_pickle(b"\x80\x02c__builtin__\nlong\n.").root == GlobalRef("builtins", "int")
    assert python3_name("__builtin__", "long", 3) == ("builtins", "long")
    # Python 3 would not find it; not a name to call harmless either
    with pytest.raises(UnsafePickleError, match=r"builtins\.long"):
        load_pickle(b"\x80\x04c__builtin__\nlong\n.")
    assert python3_name("UserDict", "UserDict", 2) == ("collections", "UserDict")  # the pair
    assert python3_name("Queue", "Queue", 2) == ("queue", "Queue")  # the module
    assert python3_name("Queue", "Queue", 4) == ("Queue", "Queue")


def test_a_mapped_name_is_classed_by_what_it_maps_to() -> None:
    """A Python 2 name cannot launder a dangerous callable: ``__builtin__.reduce`` is
    ``functools.reduce``, ``commands`` is ``subprocess``."""
    with pytest.raises(UnsafePickleError, match=r"functools\.reduce"):
        load_pickle(b"\x80\x02c__builtin__\nreduce\n.")
    with pytest.raises(UnsafePickleError, match=r"subprocess\.getoutput"):
        load_pickle(b"\x80\x02ccommands\ngetoutput\n.")
    result = load_pickle(b"\x80\x02c__builtin__\neval\n.", refuse_dangerous=False)
    assert result.globals_seen == [("builtins", "eval", Verdict.DANGEROUS)]


def test_an_exception_is_kept_as_an_opaque_object() -> None:
    root = load_pickle(pickle.dumps({"error": ValueError("bad")}, protocol=2)).root
    assert isinstance(root["error"], OpaqueObject)
    assert root["error"].cls == "builtins.ValueError"
    assert root["error"].args == ("bad",)


class Node:
    def __init__(self, name: str, parent: Node | None = None) -> None:
        self.name = name
        self._parent = parent
        self.children: list[Node] = []
        if parent is not None:
            parent.children.append(self)


def _tree() -> Node:
    root = Node("root")
    Node("b", Node("a", root))
    return root


@pytest.mark.parametrize("protocol", [2, 4])  # 0 and 1 name builtins.object: refused
def test_parent_links_become_back_references(protocol: int) -> None:
    root = load_pickle(pickle.dumps({"tree": _tree()}, protocol=protocol)).root
    tree = root["tree"]
    child = tree.state["children"][0]
    grandchild = child.state["children"][0]
    assert tree.state["_parent"] is None
    marker = BackReference(f"{__name__}.Node")
    assert child.state["_parent"] == marker
    assert grandchild.state["_parent"] == marker
    assert str(marker) == f"<back-reference to {__name__}.Node>"
    assert json.dumps(plain(root))  # every renderer's leaf: a string
    assert dict(walk(root))["tree.children.0.children.0._parent"] == marker


def test_containers_that_hold_themselves() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    mapping: dict[str, Any] = {"name": "m"}
    mapping["self"] = mapping
    shared: list[Any] = ["s"]
    shared.append(shared)
    root = load_pickle(pickle.dumps([loop, mapping, shared, shared], protocol=2)).root
    assert root[0] == [1, BackReference("list")]
    assert root[1] == {"name": "m", "self": BackReference("dict")}
    assert root[2] == root[3] == ["s", BackReference("list")]  # reached twice: the same tree


def test_a_back_reference_costs_one_node_and_bombs_are_still_refused() -> None:
    """A list holding itself and 1,000 ints, referred to 100,000 times: each reference to it
    expands it again (the back-reference inside stays one node), so the reuse limit refuses it
    as the same bomb without the cycle would be."""
    body = b"\x80\x02]q\x00(h\x00" + b"K\x01" * 1000 + b"e0"  # L = [L, 1, 1, ...]
    body += b"]q\x01(" + b"h\x00" * 100_000 + b"e."
    with pytest.raises(ResourceLimitError, match="reference bomb"):
        load_pickle(body)
    small = load_pickle(b"\x80\x02]q\x00(h\x00K\x01e0]q\x01(h\x00h\x00e.").root
    assert small == [[BackReference("list"), 1]] * 2


def test_depth_is_still_bounded_under_a_cycle() -> None:
    deep = b"\x80\x02]q\x00" + b"]" * (MAX_DEPTH + 5) + b"h\x00a" + b"a" * (MAX_DEPTH + 5) + b"."
    with pytest.raises(ResourceLimitError, match="more than 200 deep"):
        load_pickle(deep)
