"""Record helpers that stand in for ``dataclasses.replace`` on hot paths agree with it."""

from __future__ import annotations

import dataclasses

import pytest

from ckpttool.records import StorageRecord, TensorRecord, with_fields, with_key

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
