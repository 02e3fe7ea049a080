"""The pickle splice under rescale-step: emitted opcodes, in-place value edits, refusals."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpttool.errors import LayoutError
from ckpttool.pickle.edit import emit, root_edits, splice
from ckpttool.pickle.interpreter import load_pickle

PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**300), 2**300) | st.text() | st.floats(
        allow_nan=False
    ),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(PLAIN)
def test_emit_round_trips_through_pickle(value: Any) -> None:
    assert pickle.loads(b"\x80\x02" + emit(value) + b".") == value


def test_emit_refuses_non_plain_values() -> None:
    with pytest.raises(TypeError):
        emit((1, 2))
    with pytest.raises(TypeError):
        emit(object())


def spliced(data: bytes, changes: dict[str, Any]) -> Any:
    result = load_pickle(data, 0, track_spans=True)
    edits = root_edits(result, lambda start, end: data[start:end], changes)
    pieces = splice(len(data), edits)
    return pickle.loads(b"".join(p if isinstance(p, bytes) else data[p[0] : p[1]] for p in pieces))


def test_splice_replaces_values_in_place_and_appends_new_keys() -> None:
    original = {"a": [1, "x"], "step": 5, "b": {"c": "d"}, "world_size": 300}
    data = pickle.dumps(original, protocol=2)
    new = spliced(data, {"step": 70000, "world_size": 2, "rescaled_from": [{"step": 5}]})
    assert new == {
        "a": [1, "x"], "step": 70000, "b": {"c": "d"}, "world_size": 2,
        "rescaled_from": [{"step": 5}],
    }  # fmt: skip
    assert list(new) == ["a", "step", "b", "world_size", "rescaled_from"]


def test_splice_refuses_a_value_shared_through_the_memo() -> None:
    shared = [{"step": 1, "world_size": 2}]
    data = pickle.dumps({"step": 4, "rescaled_from": shared, "copy": shared}, protocol=2)
    with pytest.raises(LayoutError, match="'rescaled_from' is shared"):
        spliced(data, {"rescaled_from": []})
    # the memo entries of a value nobody else reads may go
    data = pickle.dumps({"step": 4, "rescaled_from": [{"step": 1}], "x": "y"}, protocol=2)
    assert spliced(data, {"rescaled_from": []}) == {"step": 4, "rescaled_from": [], "x": "y"}


def test_splice_refuses_framed_pickles() -> None:
    data = pickle.dumps({"step": 4, "world_size": 2, "model": {}}, protocol=4)
    with pytest.raises(LayoutError, match="FRAME"):
        spliced(data, {"step": 8})
