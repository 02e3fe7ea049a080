"""Every command's renderer in ckpttool.render has the same two functions: one contract."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil

import pytest

import ckpttool.render

HELPERS = {
    "text",
    "json_text",
    "show_deepspeed",
    "plot",
}  # shared helpers, not a command's renderer


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


TABLE_HEADERS = ["key", "dtype", "shape", "numel", "size", "notes"]
TABLE_CASES = [
    [["a.b", "float32", [4, 4], 16, "64 B", None], ["c" * 9, "int64", [1], 10**6, "1 MB", "n"]],
    [[" lead", "trail ", None, True, False, "True"]],  # stripped; bools and "True" as text
    [["True", "False", "True", None, None, None]],  # a column tabulate types bool
    [[None] * 6],
    [["x", 1.5, -3, 2**70, (1, 2), {"a": 1}]],
    [["tab\there", 1, 2, 3, 4, 5]],  # not printable: tabulate's own rules
    [["line\nbreak", 1, 2, 3, 4, 5]],  # multiline cells
    [["\x1b[31mred\x1b[0m", 1, 2, 3, 4, 5]],  # escape codes are not counted in widths
    [["wide 漢字", "é", 2, 3, 4, 5]],  # non-ASCII
    [["\x01", 1, 2, 3, 4, 5]],  # tabulate's separating line
    [[b"bytes", 1, 2, 3, 4, 5]],  # decoded by tabulate
    [["short row", 1]],
    [],
]


@pytest.mark.parametrize("rows", TABLE_CASES)
def test_table_is_tabulates_text(rows: list[list[object]]) -> None:
    from tabulate import tabulate

    from ckpttool.render.text import table

    for headers in (TABLE_HEADERS, ["a", "b", "c", "d", "e", "a much longer header"]):
        assert table(rows, headers) == tabulate(rows, headers=headers, disable_numparse=True)


def test_table_of_many_random_rows_is_tabulates_text() -> None:
    import random
    import string

    from tabulate import tabulate

    from ckpttool.render.text import table

    rng = random.Random(13)
    alphabet = string.ascii_letters + string.digits + string.punctuation + "   "

    def cell() -> object:
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        return rng.choice([None, text, rng.randint(-5, 10**9), [rng.randint(0, 9)] * 2])

    rows = [[cell() for _ in TABLE_HEADERS] for _ in range(5000)]
    rows += [[f"layers.{i}.w", "float32", [4, 4], 16, "64 B", None] for i in range(20_000)]
    assert table(rows, TABLE_HEADERS) == tabulate(
        rows, headers=TABLE_HEADERS, disable_numparse=True
    )


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_json_text_rows_are_written_as_the_list_they_stand_for(depth: int) -> None:
    from ckpttool.render.json_text import Rows, chunks, dumps

    items = list(range(600))  # more than one batch of lines

    def make(i: int) -> object:
        return {"key": f"w{i}", "shape": [i, 2], "notes": ["é"] if i % 7 == 0 else []}

    for count in (0, 1, 600):
        listed = {"file": "x", "tensors": [make(i) for i in items[:count]], "n": count}
        lazy = {"file": "x", "tensors": Rows(items[:count], make), "n": count}
        assert dumps(lazy, depth=depth) == dumps(listed, depth=depth)
        assert "".join(chunks(lazy, depth=depth, size=100)) == dumps(listed, depth=depth)
        assert dumps(Rows(items[:count], make), depth=depth) == dumps(
            [make(i) for i in items[:count]], depth=depth
        )


@pytest.mark.parametrize(
    ("count", "words"), [(0, "files"), (1, "file"), (2, "files"), (1000, "files")]
)
def test_plural_is_singular_for_one_only(count: int, words: str) -> None:
    from ckpttool.render.text import plural

    assert plural(count, "file") == words
    assert plural(count, "process", "processes") == ("process" if count == 1 else "processes")
