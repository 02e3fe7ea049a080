"""The library under ``show``: the counting rule, model parts, the module tree, value decoding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from ckpttool.io.values import _minifloat_table, as_float, numpy_code, stats_unavailable
from ckpttool.model.records import (
    OpaqueObject,
    StorageRecord,
    TensorRecord,
    children,
    count_once,
    join_key,
    shared_storages,
)
from ckpttool.model.roles import detect_layout, model_part, optimizer_part, scalar_fields
from ckpttool.render.show_tree import MAX_MODULE_DEPTH, is_flat_state_dict, module_tree
from tests.support.helpers import fixture_files


def record(
    key: str,
    shape: tuple[int, ...],
    *,
    storage: StorageRecord | None = None,
    offset: int = 0,
    stride: tuple[int, ...] | None = None,
    dtype: str = "float32",
) -> TensorRecord:
    if stride is None:
        stride = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
    if storage is None:
        storage = StorageRecord(
            key, dtype, int(np.prod(shape)), "cpu", key, 4 * int(np.prod(shape))
        )
    return TensorRecord(key, dtype, shape, stride, offset, storage)


def test_count_once_counts_each_stored_element_once() -> None:
    base = StorageRecord("0", "float32", 24, "cpu", "data/0", 96)
    weight = record("w", (4, 6), storage=base)
    tied = record("head", (4, 6), storage=base)
    transposed = record("wt", (6, 4), storage=base, stride=(1, 6))
    top, bottom = (record(k, (2, 6), storage=base, offset=o) for k, o in (("top", 0), ("bot", 12)))
    other = record("bias", (6,))
    assert count_once([weight, tied, transposed, other]) == (30, {"float32": 120})
    assert count_once([top, bottom]) == (24, {"float32": 96})  # disjoint slices: both
    assert count_once([weight, top]) == (24, {"float32": 96})  # a slice inside: the storage
    assert count_once([top]) == (12, {"float32": 48})  # a view alone: its own elements
    assert shared_storages([weight, other, tied, top]) == [["w", "head", "top"]]


def test_tensors_without_storage_count_their_elements_but_only_inline_bytes() -> None:
    meta = TensorRecord("m", "float16", (3,), (1,), 0, None)
    assert count_once([meta, meta]) == (6, {})  # a meta tensor stores no bytes
    inline = TensorRecord("n", "float16", (3,), (1,), 0, None, inline_data=bytes(6))
    assert count_once([inline]) == (3, {"float16": 6})
    assert shared_storages([meta, meta]) == []


@pytest.mark.parametrize(
    ("root", "model", "optimizer"),
    [
        ({"model_state_dict": {"w": 0}, "optimizer_state_dict": {}}, None, None),  # no tensors
        (
            {"model_state_dict": "T", "optimizer_state_dict": "O"},
            "model_state_dict",
            "optimizer_state_dict",
        ),
        ({"model_state": "T", "optimizer_state": "O"}, "model_state", "optimizer_state"),
        ({"state_dict": "T", "epoch": 3}, "state_dict", None),
        ({"module": "T", "optimizer": None}, "module", None),  # DeepSpeed model states
        ({"model": "T", "state_dict": "T"}, None, None),  # two candidates: do not guess
        ({"state": {}, "param_groups": []}, None, ""),  # a bare optimizer file
        ({"python": (1, 2), "cpu": "T"}, None, None),  # an RNG file
    ],
)
def test_model_and_optimizer_parts(root: dict, model: str | None, optimizer: str | None) -> None:
    weights = {"fc.weight": record("t", (2,))}
    opt = {"state": {0: {"exp_avg": record("m", (2,))}}, "param_groups": []}
    root = {k: weights if v == "T" else opt if v == "O" else v for k, v in root.items()}
    layout = detect_layout(root, "torch-zip")
    assert model_part(root, layout) == model
    assert optimizer_part(root, layout) == optimizer


def test_model_part_of_known_layouts() -> None:
    weights = {"a.weight": record("a", (2,))}
    assert model_part(weights, detect_layout(weights, "torch-zip")) == ""
    resume = {"model": weights, "optimizer": {}, "epoch": 1, "step": 2}
    assert model_part(resume, detect_layout(resume, "torch-zip")) == "model"
    lightning = {"state_dict": weights, "pytorch-lightning_version": "2.0", "epoch": 1}
    assert model_part(lightning, detect_layout(lightning, "torch-zip")) == "state_dict"


def test_a_resume_dict_is_labelled_ckpttool_only_on_ckpttool_evidence() -> None:
    """A ``scheduler`` (or any ``rng``) beside model/optimizer/epoch/step is anybody's resume
    file; only save_checkpoint's own RNG state (with MiniMind's keys) says ckpttool wrote it."""
    weights = {"a.weight": record("a", (2,))}
    base = {"model": weights, "optimizer": {}, "epoch": 1, "step": 2}
    assert detect_layout(base, "torch-zip") == "minimind_resume"
    assert (
        detect_layout({**base, "scheduler": {"last_epoch": 3}}, "torch-zip") == "resume_checkpoint"
    )
    assert detect_layout({**base, "rng": {"cpu": "x"}}, "torch-zip") == "resume_checkpoint"
    saved = {
        **base, "world_size": 1, "wandb_id": None,
        "rng": {"python": (3, (), None), "torch": record("r", (8,)),
                "numpy": {"bit_generator": "MT19937", "key": record("k", (624,)), "pos": 0}},
    }  # fmt: skip
    assert detect_layout(saved, "torch-zip") == "ckpttool_resume"
    assert model_part({**base, "scheduler": {}}, "resume_checkpoint") == "model"


def test_module_tree_groups_keys_and_collapses_identical_blocks() -> None:
    state = {"embed.weight": record("e", (10, 4))}
    for index in range(4):
        state[f"layers.{index}.fc.weight"] = record(f"f{index}", (4, 4))
        # block 2's bias has another dtype: not identical, so it splits the run
        state[f"layers.{index}.fc.bias"] = record(
            f"b{index}", (4,), dtype="float16" if index == 2 else "float32"
        )
    state["head.weight"] = state["embed.weight"]  # tied: counted once at the top
    nodes = module_tree(state)
    assert [n.name for n in nodes] == ["embed.weight", "layers", "head.weight"]
    layers = nodes[1]
    assert (layers.num_tensors, layers.parameters) == (8, 80)
    assert [(n.name, n.repeats) for n in layers.children] == [
        ("0..1", 2),
        ("2.fc", 1),  # one child: shown on one line
        ("3.fc", 1),
    ]
    block = layers.children[0]
    assert (block.parameters, block.nbytes) == (20, 80)  # one block's
    assert [n.name for n in block.children] == ["fc"]
    assert [n.name for n in block.children[0].children] == ["weight", "bias"]


def test_module_tree_counts_tied_weights_once_per_module() -> None:
    shared = record("shared", (4, 4))
    nodes = module_tree({"a.x": shared, "a.y": shared, "b": record("b", (2,))})
    assert (nodes[0].name, nodes[0].num_tensors, nodes[0].parameters) == ("a", 2, 16)


def test_flat_state_dict_needs_dotted_keys_and_a_sane_depth() -> None:
    tensor = record("t", (1,))
    assert is_flat_state_dict({"a.b": tensor, "c": tensor})
    assert not is_flat_state_dict({"a": tensor, "b": tensor})  # nothing to group
    assert not is_flat_state_dict({"a.b": tensor, "c": 3})
    assert not is_flat_state_dict({"a" + ".a" * MAX_MODULE_DEPTH: tensor})


FLOAT8 = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]


@pytest.mark.parametrize("dtype", FLOAT8)
def test_float8_decoding_equals_torch_for_every_code(dtype: str) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    expected = codes.view(getattr(torch, dtype)).float().numpy()
    got = as_float(record("x", (256,), dtype=dtype), codes.numpy())
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)  # NaN where torch has NaN, -0.0 kept
    assert (np.signbit(got) == np.signbit(expected))[~np.isnan(expected)].all()


def test_float4_decodes_both_values_of_each_byte() -> None:
    table = _minifloat_table("float4_e2m1fn_x2")
    assert table.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    packed = np.array([0x21, 0xF7], dtype=np.uint8)  # (0.5, 1.0), (6.0, -6.0)
    got = as_float(record("x", (2,), dtype="float4_e2m1fn_x2"), packed)
    assert sorted(got.tolist()) == [-6.0, 0.5, 1.0, 6.0]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_complex32_decodes_to_complex64() -> None:
    value = torch.tensor([3 + 4j, -1j], dtype=torch.complex32)
    raw = value.view(torch.int32).numpy().view("<u4")
    got = as_float(record("z", (2,), dtype="complex32"), raw)
    assert got.tolist() == [3 + 4j, -1j]


@pytest.mark.parametrize(
    ("dtype", "reason"),
    [("qint8", "scale and zero point"), ("bits16", "raw bits"), ("float7", "unknown dtype")],
)
def test_dtypes_without_statistics_say_why(dtype: str, reason: str) -> None:
    message = stats_unavailable(record("q", (2,), dtype=dtype))
    assert message is not None and reason in message


def test_every_torch_dtype_gets_statistics_or_a_reason() -> None:
    from ckpttool.model.records import ITEMSIZE

    for name in ITEMSIZE:
        probe = record("x", (1,), dtype=name)
        if stats_unavailable(probe) is None:  # then it decodes
            zeros = np.zeros(1, dtype=numpy_code(probe))
            assert np.asarray(as_float(probe, zeros)).size >= 1, name


def test_optimizer_state_maps_to_names_through_the_trainers_decay_groups(tmp_path: Path) -> None:
    """The Hugging Face Trainer numbers its state decay-params first, then biases and norms;
    with a model stored in its own order (a .bin file, a resume dict) the names follow."""
    import torch

    from ckpttool.checkpoint import open_checkpoint
    from ckpttool.model.roles import map_param_names

    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(4, 3))
    model.add_module("norm", torch.nn.LayerNorm(3))
    model.add_module("fc2", torch.nn.Linear(3, 2))
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias") and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "norm" in n]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "t.pt"
    )
    with open_checkpoint(tmp_path / "t.pt") as ckpt:
        names, rule = map_param_names(ckpt.root["optimizer"], ckpt.root["model"])
    assert rule == "decay groups"
    assert [names[i] for i in sorted(names)] == [
        "fc1.weight", "fc2.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.bias",
    ]  # fmt: skip
    one_group = torch.optim.AdamW(model.parameters())
    one_group.step()
    with open_checkpoint(tmp_path / "t.pt") as ckpt:
        _, rule = map_param_names(one_group.state_dict(), ckpt.root["model"])  # type: ignore[arg-type]
    assert rule == "order"  # one group in model order (no state yet: nothing contradicts it)


def _fixture_reports() -> list[object]:
    from ckpttool.commands.show import show
    from ckpttool.errors import CkptError
    from tests.support.helpers import fixture_files

    reports = []
    for path in fixture_files():
        for options in ({}, {"stats": True}, {"pattern": "*weight*"}):
            try:
                reports.append(show(path, **options))  # type: ignore[arg-type]
            except CkptError:  # the damaged fixtures are other tests'
                break
    assert len(reports) > 100
    return reports


def test_show_text_and_json_on_every_fixture_are_tabulates_and_render_jsons() -> None:
    """The table without tabulate and the --json written as made are the text they replace:
    tabulate's table, and ``json_text.chunks(render_json(report))``."""
    import tabulate

    from ckpttool.render import show as show_render
    from ckpttool.render.json_text import chunks

    def with_tabulate(rows: list[list[object]], headers: list[str]) -> str:
        return str(tabulate.tabulate(rows, headers=headers, disable_numparse=True))

    tables = 0
    for report in _fixture_reports():
        assert "".join(show_render.json_chunks(report)) == "".join(  # type: ignore[arg-type]
            chunks(show_render.render_json(report))  # type: ignore[arg-type]
        )
        text = show_render.render_text(report)  # type: ignore[arg-type]
        original = show_render.table
        show_render.table = with_tabulate  # type: ignore[assignment]
        try:
            assert text == show_render.render_text(report)  # type: ignore[arg-type]
        finally:
            show_render.table = original
        tables += report.tensors != []  # type: ignore[attr-defined]
    assert tables > 100


def test_tensor_notes_say_what_each_tensor_is() -> None:
    from ckpttool.commands.show import tensor_notes
    from ckpttool.model.records import ChunkedStorageRecord, ChunkRecord

    storage = StorageRecord("0", "float32", 64, "cpu", "archive/data/0", 256)
    gpu = StorageRecord("1", "float32", 16, "cuda:0", "archive/data/1", 64)
    chunked = ChunkedStorageRecord("c", "float32", 4, "cpu", "dcp", 16,
                                   chunks=(ChunkRecord("__0_0.distcp", 0, 9, (0,), (4,)),))  # fmt: skip
    records = [
        TensorRecord("w", "float32", (4, 4), (4, 1), 0, storage),
        TensorRecord("tied", "float32", (4, 4), (4, 1), 0, storage),
        TensorRecord("t", "float32", (4, 4), (1, 4), 0, storage),
        TensorRecord("row", "float32", (1, 4), (99, 1), 16, storage),  # size-1 dim: contiguous
        TensorRecord("g", "float32", (4, 4), (4, 1), 0, gpu),
        TensorRecord("meta", "float32", (2,), (1,), 0, None),
        TensorRecord("arr", "float32", (2,), (1,), 0, None, kind="ndarray", inline_data=b"x" * 8),
        TensorRecord("s", "float32", (4,), (1,), 0, chunked),
        TensorRecord("plain", "float32", (), (), 0, StorageRecord("2", "float32", 1, "", "r", 4)),
    ]
    notes = tensor_notes(records)
    more = "shares storage with"
    assert notes == {
        "w": [f"{more} tied (+2)"],
        "tied": [f"{more} w (+2)"],
        "t": [f"{more} w (+2)", "non-contiguous"],
        "row": [f"{more} w (+2)", "offset 16"],
        "g": ["saved on cuda:0"],
        "meta": ["saved on meta"],
        "arr": ["saved on meta", "numpy"],
        "s": ["1 chunk: __0_0.distcp"],
    }
    # two records under one key (a hostile file can repeat a key) share its notes
    twice = [records[4], records[4]]
    assert tensor_notes(twice) == {"g": ["tied with g", "tied with g"] + ["saved on cuda:0"] * 2}


def test_tensor_lines_are_what_json_writes_for_tensor_json() -> None:
    """The --json line of a tensor made without its dict is the encoder's text of the dict,
    whatever odd values a hostile file puts in a record (bools, str subclasses, non-ASCII)."""
    import dataclasses
    import enum
    import json

    from ckpttool.commands.show import TensorInfo
    from ckpttool.model.records import ChunkedStorageRecord, ChunkRecord
    from ckpttool.render.show import TensorLines, tensor_json

    class Name(str):
        pass

    class Size(enum.IntEnum):
        FOUR = 4

    storage = StorageRecord("0", "float32", 64, "cpu", "archive/data/0", 256)
    chunked = ChunkedStorageRecord("c", "float32", 4, "cpu", "dcp", 16,
                                   chunks=(ChunkRecord("f", 0, 9, (0,), (4,)),))  # fmt: skip
    records = [
        TensorRecord("w", "float32", (4, 4), (4, 1), 0, storage),
        TensorRecord("w", "float32", (1, 4), (4, 1), 0, storage),  # [1, 4] then...
        TensorRecord("b", "float32", (True, 4), (4, True), 0, storage),  # ...[true, 4]
        TensorRecord("b", "float32", (4,), (1,), True, storage),  # a bool offset
        TensorRecord(Name("sub"), Name("float32"), (Size.FOUR,), (1,), 0, storage),
        TensorRecord("é\n\"ü", "bfloat16", (), (), 3, None, kind="parameter"),
        TensorRecord("q", "quint4x2", (5,), (1,), 0, dataclasses.replace(storage, key=7)),
        TensorRecord("s", "float32", (4,), (1,), 0, chunked),
        TensorRecord("g", "float32", (2,), (1,), 0, StorageRecord("1", "float32", 2, "cuda:1", "r", 8)),
        TensorRecord("l", "float32", (2,), (1,), 0, StorageRecord("2", "float32", 2, 3, "r", 8)),  # type: ignore[arg-type]
        TensorRecord("d", 4, (2,), (1,), 0, storage),  # type: ignore[arg-type]
    ]  # fmt: skip
    lines = TensorLines()
    encoder = json.JSONEncoder(separators=(", ", ": "))
    for notes in ([], ["tied with x", "offset 3"]):
        for record in records + records:  # the second time from the caches
            info = TensorInfo(record, list(notes))
            assert lines(info) == encoder.encode(tensor_json(info))
    stats = TensorInfo(records[0], [], stats_unavailable="quantized")
    assert lines(stats) == encoder.encode(tensor_json(stats))


def _scalar_fields_reference(root: object, max_siblings: int = 64) -> dict[str, object]:
    """``scalar_fields`` as first written (before bench/object_table.py made it faster)."""

    def is_tree(node: object) -> bool:
        return isinstance(node, (dict, list, tuple, OpaqueObject))

    out: dict[str, object] = {}
    stack: list[tuple[str, object]] = [("", root)]
    while stack:
        key, node = stack.pop()
        items = list(children(node))
        if len(items) > max_siblings and all(not is_tree(v) for _, v in items):
            continue
        for name, child in reversed(items):
            child_key = join_key(key, name)
            if is_tree(child):
                if name != "params":
                    stack.append((child_key, child))
            elif isinstance(child, (int, float, str, bool)) or child is None:
                out[child_key] = child

    def order(key: str) -> tuple[int, str]:
        if isinstance(root, dict) and key in root:
            return (list(root).index(key), "")
        return (1 << 30, key)

    return dict(sorted(out.items(), key=lambda kv: order(kv[0])))


def test_scalar_fields_as_first_written() -> None:
    """Same fields, same order, same values (the later of two values under one key wins)."""
    opaque = OpaqueObject("m.C", (1, "a"), {"x": 2, "params": [1], "z": None})
    odd = {"b": {1: "int key", "1": "str key"}, "a.b": 3, "a": {"b": 4}, "c": [True] * 70,
           "d": [[1]] + [2] * 70, "e": (1.5, "s"), "f": opaque, 7: "seven", "g": TensorRecord(
               "", "float32", (1,), (1,), 0, None)}  # fmt: skip
    for root in (odd, [odd, 1], "leaf", {}):
        assert list(scalar_fields(root).items()) == list(_scalar_fields_reference(root).items())
    for path in fixture_files():
        with open_checkpoint(path) as ckpt:
            assert list(scalar_fields(ckpt.root).items()) == list(
                _scalar_fields_reference(ckpt.root).items()
            ), path


def test_stats_std_is_the_population_std_and_the_header_says_so(tmp_path: Path) -> None:
    """Issue 49 item 13: ``--stats``'s std divides by N (ddof=0), which nothing said; torch's
    default ``tensor.std()`` divides by N - 1. Both differ on [1, 2, 4]: the header names it."""
    values = torch.tensor([1.0, 2.0, 4.0])
    torch.save({"w": values}, tmp_path / "w.pth")
    result = CliRunner().invoke(cli, ["show", str(tmp_path / "w.pth"), "--stats"])
    assert result.exit_code == 0
    header = next(line for line in result.output.splitlines() if line.startswith("key "))
    assert header.split()[5:9] == ["min", "max", "mean", "std(ddof=0)"]
    row = next(line for line in result.output.splitlines() if line.startswith("w "))
    population = values.std(unbiased=False).item()
    assert population != values.std().item()
    assert row.split()[9] == f"{population:.4g}"  # after "12 B", min, max, mean
