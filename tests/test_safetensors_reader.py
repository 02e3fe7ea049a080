"""The safetensors reader checks an entry whose dtype and shape it has seen as fully as the
first one: an entry after a valid one of the same shape fails (or passes) as it would alone."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from ckpttool.checkpoint import open_checkpoint
from ckpttool.errors import CkptError

GOOD = {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}

# the second entry, each after GOOD (its offsets start where GOOD ends)
SECOND = {
    "same": {"dtype": "F32", "shape": [4, 4], "data_offsets": [64, 128]},
    "float_size": {"dtype": "F32", "shape": [4.0, 4], "data_offsets": [64, 128]},
    "bool_size": {"dtype": "F32", "shape": [True, 4], "data_offsets": [64, 80]},
    "float_offset": {"dtype": "F32", "shape": [4, 4], "data_offsets": [64.0, 128]},
    "bool_offset": {"dtype": "F32", "shape": [4, 4], "data_offsets": [True, 65]},
    "negative_offset": {"dtype": "F32", "shape": [4, 4], "data_offsets": [-64, 0]},
    "backwards": {"dtype": "F32", "shape": [4, 4], "data_offsets": [128, 64]},
    "huge_end": {"dtype": "F32", "shape": [4, 4], "data_offsets": [64, 2**64]},
    "three_offsets": {"dtype": "F32", "shape": [4, 4], "data_offsets": [64, 128, 192]},
    "string_offsets": {"dtype": "F32", "shape": [4, 4], "data_offsets": "ab"},
    "no_dtype": {"shape": [4, 4], "data_offsets": [64, 128]},
    "unknown_dtype": {"dtype": "F31", "shape": [4, 4], "data_offsets": [64, 128]},
    "other_dtype": {"dtype": "I32", "shape": [4, 4], "data_offsets": [64, 128]},
    "wrong_size": {"dtype": "F32", "shape": [4, 4], "data_offsets": [64, 100]},
    "not_a_dict": [64, 128],
}


def write(path: Path, entries: dict[str, Any], data_bytes: int) -> Path:
    text = json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data_bytes))
    return path


def outcome(path: Path) -> Any:
    try:
        with open_checkpoint(path, strict=False) as ckpt:
            return [(r.key, r.dtype, r.shape, r.stride, r.storage) for r in ckpt.tensors()], [
                problem for problem in ckpt.problems
            ]
    except CkptError as error:
        return type(error), str(error).split(": ", 1)[1]


@pytest.mark.parametrize("case", sorted(SECOND))
def test_a_known_shape_is_checked_as_the_first(case: str, tmp_path: Path) -> None:
    second = SECOND[case]
    after = outcome(write(tmp_path / "after.safetensors", {"a": GOOD, "b": second}, 128))
    # the same entry first: checked in full, nothing seen before it
    alone = outcome(write(tmp_path / "alone.safetensors", {"b": second, "a": GOOD}, 128))
    if isinstance(after, tuple) and isinstance(after[0], type):
        assert after == alone
    else:
        assert isinstance(alone[0], list)
        assert sorted(after[0]) == sorted(alone[0])
    if case == "same":
        records, problems = after
        assert problems == [] and records[0][2] is records[1][2]  # one shared shape tuple
