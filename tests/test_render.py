"""Every command's renderer in ckpttool.render has the same two functions: one contract."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil

import pytest

import ckpttool.render

HELPERS = {"text", "json_text", "show_deepspeed"}  # shared helpers, not a command's renderer


def test_every_renderer_has_render_text_and_render_json() -> None:
    names = sorted(m.name for m in pkgutil.iter_modules(ckpttool.render.__path__))
    assert {"show", "show_tree", "diff", "convert", "rescale", "verify", "scan"} <= set(names)
    for name in names:
        if name in HELPERS:
            continue
        module = importlib.import_module(f"ckpttool.render.{name}")
        for function in ("render_text", "render_json"):
            assert inspect.isfunction(getattr(module, function, None)), f"{name}.{function}"
        # the report comes first, positionally; anything else is a keyword option
        text_params = list(inspect.signature(module.render_text).parameters.values())
        assert all(p.default is not p.empty for p in text_params[1:]), name
        assert len(inspect.signature(module.render_json).parameters) == 1, name


JSON_VALUES = [
    {"a": [1, {"b": [1, 2]}], True: None, 1.5: "x", None: [], "e": {}, 7: "seven"},
    {"tensors": [{"key": 'é\n"', "shape": [4, 4], "nan": float("nan")}], "n": 2**70},
    [],
    {},
    3,
    "text",
    [[[1]], (2, 3)],
]


@pytest.mark.parametrize("value", JSON_VALUES)
def test_json_text_parses_to_what_json_dumps_gives(value: object) -> None:
    from ckpttool.render.json_text import dumps

    text = dumps(value)
    if "NaN" not in text:  # NaN != NaN: the second check covers it
        assert json.loads(text) == json.loads(json.dumps(value))
    assert dumps(value).replace(" ", "").replace("\n", "") == json.dumps(
        value, separators=(",", ":")
    )


def test_json_text_writes_each_record_of_a_list_on_one_line() -> None:
    from ckpttool.render.json_text import dumps

    report = {"file": "x.pth", "tensors": [{"key": f"w{i}", "shape": [2, 3]} for i in range(3)]}
    lines = dumps(report).splitlines()
    assert lines[1] == '  "file": "x.pth",'
    assert lines[3:6] == [
        f'    {{"key": "w{i}", "shape": [2, 3]}}' + ("," if i < 2 else "") for i in range(3)
    ]


@pytest.mark.parametrize("size", [1, 7, 1 << 16])
@pytest.mark.parametrize("value", JSON_VALUES)
def test_json_text_in_chunks_is_the_same_text(value: object, size: int) -> None:
    from ckpttool.render.json_text import chunks, dumps

    pieces = list(chunks(value, size=size))
    assert "".join(pieces) == dumps(value)
    assert all(pieces)
    assert all(len(piece) >= size for piece in pieces[:-1])  # batched, not one per item
