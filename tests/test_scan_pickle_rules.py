"""The pickle-level rules of issue 25: irregular FRAMEs, files scan must not skip, findings that
survive walk errors, torch's functions / partial / getattr, distributed data records."""

from __future__ import annotations

import functools
import importlib
import io
import json
import pickle
import pickletools
import struct
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from ckpttool.errors import CkptError, UnsafePickleError
from ckpttool.model.records import OpaqueObject, TensorRecord
from ckpttool.pickle.callables import (
    FUNCTION_MODULES,
    GETATTR_NAMESPACES,
    PARTIAL_TARGET_MODULES,
    TORCH_FUNCTIONS,
)
from ckpttool.pickle.frames import AmbiguousPickleError
from ckpttool.pickle.interpreter import load_pickle
from ckpttool.pickle.names import linear_globals
from ckpttool.pickle.policy import DISTRIBUTED_RECORDS, Verdict, classify_global
from tests.support import adversarial

torch = pytest.importorskip("torch")


def _verdicts(data: bytes) -> dict[str, Verdict]:
    return {f"{m}.{n}": v for m, n, v in load_pickle(data, refuse_dangerous=False).globals_seen}


def _scan(*paths: Path) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(cli, ["scan", "--json", *map(str, paths)])
    return result.exit_code, json.loads(result.output)


# --- FRAMEs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [4, 5])
def test_frames_python_writes_are_regular(protocol: int) -> None:
    """Many frames (64 KB each), long strings and bytes outside frames: read as before."""
    value = {"a": ["x" * 100_000, b"y" * 70_000], "b": list(range(50_000)), "c": "z" * 300}
    data = pickle.dumps(value, protocol=protocol)
    result = load_pickle(data)
    assert len(result.frames) > 2 and result.root == value


@pytest.mark.parametrize(
    ("build", "what"),
    [
        (adversarial.frame_split_argument, r"opcode at byte 11 \(0x58\) runs past its end"),
        (adversarial.frame_split_line, "runs past its end"),
        (adversarial.frame_nested, "a FRAME begins inside it"),
        (adversarial.frame_stop_inside, "bytes follow the STOP"),
    ],
)
def test_irregular_frame_is_refused(tmp_path: Path, build: Any, what: str) -> None:
    data = build(tmp_path / "ran")
    with pytest.raises(AmbiguousPickleError, match=what):
        load_pickle(data, refuse_dangerous=False)
    assert isinstance(AmbiguousPickleError("x"), UnsafePickleError)  # refused, a scan finding


def test_frame_ending_inside_a_text_line_is_refused() -> None:
    body = b"I12"  # the INT's line goes on after the frame
    data = b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body + b"3\n."
    assert pickle.loads(data) == 123  # a linear reader reads 123
    with pytest.raises(AmbiguousPickleError, match="runs past its end"):
        load_pickle(data)


# --- files scan must not skip -------------------------------------------------------------


@pytest.mark.parametrize(
    "lead", [b"Vx\n0", b"S'x'\n0", b"N0", b"I1\n0", b"K\x010", b")0", b"G" + bytes(8) + b"0"]
)
def test_a_pickle_is_scanned_whatever_its_first_opcode(tmp_path: Path, lead: bytes) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(lead + adversarial.global_reduce_p0(tmp_path / "ran"))
    code, report = _scan(path)
    assert code == 1
    assert [g["name"] for g in report["files"][0]["globals"]] == ["os.system"]
    code, report = _scan(tmp_path)  # the same in a directory: not skipped
    assert code == 1 and report["skipped"] == []


def test_what_is_positively_something_else_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "model.pth").write_bytes(adversarial.torch_zip(pickle.dumps({"a": 1}, 2)))
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "README").write_text("This model was trained on\nsome data.\n")
    (tmp_path / "latest").write_text("global_step2")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(40))
    (tmp_path / "events.out").write_bytes(b"\x18\x00\x00\x00\x00\x00\x00\x00" + bytes(30))
    code, report = _scan(tmp_path)
    assert code == 0
    assert sorted(Path(p).name for p in report["skipped"]) == [
        "README", "config.json", "events.out", "image.png", "latest",
    ]  # fmt: skip


def test_an_unrecognised_file_that_may_be_a_pickle_is_reported(tmp_path: Path) -> None:
    """A file that starts like a pickle and fails where the C unpickler might not: could not
    scan (exit 2), never skipped."""
    path = tmp_path / "blob.bin"
    path.write_bytes(b"(" * 3000 + b"\x01\x02")
    code, report = _scan(tmp_path)
    assert code == 2 and report["skipped"] == []
    assert "MARKs deeper" in report["files"][0]["error"]


# --- findings survive walk errors ------------------------------------------------------------


@pytest.mark.parametrize("container", ["pkl", "legacy"])
@pytest.mark.parametrize(
    "build",
    [adversarial.stop_with_open_mark, adversarial.ext_after_payload,
     adversarial.garbage_after_payload],
)  # fmt: skip
def test_globals_seen_before_a_walk_error_are_reported(
    tmp_path: Path, container: str, build: Any
) -> None:
    data = build(tmp_path / "ran")
    path = tmp_path / f"f.{container}"
    path.write_bytes(data if container == "pkl" else adversarial.legacy_stream(data))
    code, report = _scan(path)
    entry = report["files"][0]
    assert code == 1  # dangerous wins over "could not scan"
    assert {
        "name": "posix.system",
        "verdict": "dangerous",
        "count": 1,
        "written_as": None,
    } in entry["globals"]


def test_names_past_the_walks_limit_are_reported(tmp_path: Path) -> None:
    data = adversarial.deep_marks_then_payload(tmp_path / "ran")
    assert linear_globals(data) == [("os", "system")]
    path = tmp_path / "f.pkl"
    path.write_bytes(data)
    code, report = _scan(path)
    assert code == 1 and report["files"][0]["globals"][0]["name"] == "os.system"


def test_linear_globals_follow_the_memo() -> None:
    data = adversarial.memo_strings_stack_global(Path("/nonexistent"))
    assert linear_globals(data) == [("os", "system")]


# --- torch functions, getattr, partial -----------------------------------------------------


def test_every_listed_torch_function_exists_in_torch() -> None:
    """Each name of the allow-list is a function (not a class) in at least one of the modules
    or namespaces it is accepted in, in the installed torch."""
    homes = [
        importlib.import_module(m) for m in FUNCTION_MODULES if m != "torch._C._VariableFunctions"
    ]
    homes += [torch._C._VariableFunctions, torch._C.TensorBase]
    for name in TORCH_FUNCTIONS:
        found = [getattr(home, name) for home in homes if hasattr(home, name)]
        assert found, name
        assert all(callable(f) and not isinstance(f, type) for f in found), name


def test_getattr_namespaces_exist_in_torch() -> None:
    for qualname in GETATTR_NAMESPACES:
        module, _, name = qualname.rpartition(".")
        assert hasattr(importlib.import_module(module), name), qualname
    for module in PARTIAL_TARGET_MODULES:
        importlib.import_module(module)


@pytest.mark.parametrize("protocol", [0, 2, 4])
@pytest.mark.parametrize(
    "value",
    [
        torch.relu,  # getattr(torch._C._VariableFunctionsClass, 'relu')
        torch.Tensor.add,  # getattr(torch._C.TensorBase, 'add')
        torch.nn.functional.gelu,  # torch._C._nn.gelu
        torch.nn.init.normal_,
        functools.partial(torch.nn.functional.gelu, approximate="tanh"),
        functools.partial(torch.optim.AdamW, lr=3e-4),
    ],
)
def test_torch_functions_partial_and_getattr_are_not_dangerous(value: Any, protocol: int) -> None:
    data = pickle.dumps({"fn": value}, protocol=protocol)
    verdicts = _verdicts(data)
    assert Verdict.DANGEROUS not in verdicts.values(), verdicts
    load_pickle(data)  # not refused


def test_getattr_is_resolved_to_the_function_it_names() -> None:
    verdicts = _verdicts(pickle.dumps(torch.relu, protocol=2))
    assert verdicts == {"builtins.getattr": "safe", "torch._C._VariableFunctionsClass": "safe",
                        "torch.relu": "safe"}  # fmt: skip
    assert load_pickle(pickle.dumps(torch.relu, protocol=2)).root.qualname == "torch.relu"


_GETATTR = b"\x80\x02cbuiltins\ngetattr\n"


class HistoryBuffer:
    """Stands for mmengine's ``HistoryBuffer``: its message hub keeps ``HistoryBuffer.min``,
    which pickle protocol 2 writes as ``builtins.getattr(HistoryBuffer, 'min')``."""

    def min(self) -> float:
        return 0.0


def test_getattr_of_an_unknown_class_is_that_class_attribute_unknown() -> None:
    data = pickle.dumps({"statistics": {"min": HistoryBuffer.min}}, protocol=2)
    assert b"c__builtin__\ngetattr\n" in data  # how the real message hub pickles it
    here = f"{__name__}.HistoryBuffer"
    assert _verdicts(data) == {
        "builtins.getattr": "safe", here: "unknown", f"{here}.min": "unknown"
    }  # fmt: skip
    method = load_pickle(data).root["statistics"]["min"]  # read, not refused: a stub
    assert method.qualname == f"{here}.min"
    chained = _GETATTR + b"q\x00h\x00cmypkg\nModel\nX\x01\x00\x00\x00a\x86RX\x01\x00\x00\x00b\x86R."
    assert _verdicts(chained) == {
        "builtins.getattr": "safe", "mypkg.Model": "unknown", "mypkg.Model.a": "unknown",
        "mypkg.Model.a.b": "unknown",
    }  # fmt: skip
    called = _GETATTR + b"cmypkg\nModel\nX\x03\x00\x00\x00run\x86R)R."
    assert isinstance(load_pickle(called).root, OpaqueObject)  # never called: a stub


@pytest.mark.parametrize(
    ("data", "dangerous"),
    [
        # a torch namespace, a name that is no tensor function
        (_GETATTR + b"ctorch._C\n_VariableFunctionsClass\nX\x09\x00\x00\x00from_file\x86R.",
         {"builtins.getattr", "torch._C._VariableFunctionsClass"}),
        # a name that is not a constant string
        (_GETATTR + b"ctorch._C\n_VariableFunctionsClass\nK\x01\x86R.",
         {"builtins.getattr", "torch._C._VariableFunctionsClass"}),
        # getattr of something else
        (_GETATTR + b"cpathlib\nPosixPath\nX\x05\x00\x00\x00touch\x86R.", {"builtins.getattr"}),
        # the namespace used otherwise than through getattr
        (b"\x80\x02ctorch._C\n_VariableFunctionsClass\n.", {"torch._C._VariableFunctionsClass"}),
        # partial of an unknown callable, of a dangerous one
        (b"\x80\x02cfunctools\npartial\ncmymodule\nfn\n\x85R.", {"functools.partial"}),
        (b"\x80\x02cfunctools\npartial\ncposix\nsystem\n\x85R.",
         {"functools.partial", "posix.system"}),
        # partial never called (a bare reference)
        (b"\x80\x02cfunctools\npartial\n.", {"functools.partial"}),
        # one good use and one bad use of the same partial
        (b"\x80\x02cfunctools\npartial\nq\x00ctorch.nn.functional\nrelu\n\x85R0"
         b"h\x00cmymodule\nfn\n\x85R.", {"functools.partial"}),
        # getattr of a dangerous global, or one that reaches a dangerous global
        (_GETATTR + b"cbuiltins\neval\nX\x04\x00\x00\x00read\x86R.",
         {"builtins.getattr", "builtins.eval"}),
        (_GETATTR + b"cos\npath\nX\x04\x00\x00\x00join\x86R.", {"builtins.getattr", "os.path"}),
        (_GETATTR + b"cmypkg\nos\nX\x06\x00\x00\x00system\x86R.", {"builtins.getattr"}),
        (_GETATTR + b"ctorch\nserialization\nX\x04\x00\x00\x00load\x86R.",
         {"builtins.getattr"}),
        (_GETATTR + b"cmypkg\nimportlib\nX\x0d\x00\x00\x00import_module\x86R.",
         {"builtins.getattr"}),
        # of an unknown class, names that are not public attributes
        *[(_GETATTR + b"cmypkg\nModel\nX" + struct.pack("<I", len(name)) + name + b"\x86R.",
           {"builtins.getattr"})
          for name in (b"__reduce__", b"__globals__", b"__builtins__", b"__class__", b"__private",
                       b"_Model__private", b"not an identifier", b"")],
        # a non-constant name (built by a call), getattr of an object built from the file
        # (the calls that build them are calls of unknown globals: dangerous by effect)
        (_GETATTR + b"cmypkg\nModel\ncmypkg\nname\n)R\x86R.", {"builtins.getattr", "mypkg.name"}),
        (_GETATTR + b"cmypkg\nModel\n)R" + b"X\x03\x00\x00\x00run\x86R.",
         {"builtins.getattr", "mypkg.Model"}),
        # nested constants that reach os: getattr(getattr(Model, 'os'), 'system') is
        # mypkg.Model.os.system (the inner getattr resolves; the outer one stays dangerous)
        (b"\x80\x02cbuiltins\ngetattr\nq\x00h\x00cmypkg\nModel\nX\x02\x00\x00\x00os"
         b"\x86RX\x06\x00\x00\x00system\x86R.", {"builtins.getattr"}),
        # nested: getattr(getattr(Model, '__class__'), 'mro'): the inner one stays dangerous
        (b"\x80\x02cbuiltins\ngetattr\nq\x00h\x00cmypkg\nModel\nX\x09\x00\x00\x00__class__"
         b"\x86RX\x03\x00\x00\x00mro\x86R.", {"builtins.getattr"}),
    ],
)  # fmt: skip
def test_partial_or_getattr_reaching_anything_else_stays_dangerous(
    data: bytes, dangerous: set[str]
) -> None:
    verdicts = _verdicts(data)
    assert {name for name, v in verdicts.items() if v is Verdict.DANGEROUS} == dangerous
    with pytest.raises(UnsafePickleError, match="refusing to read"):
        load_pickle(data)


# --- distributed data records --------------------------------------------------------------


def test_distributed_records_exist_in_torch() -> None:
    for qualname in DISTRIBUTED_RECORDS:
        module, _, name = qualname.rpartition(".")
        owner, _, nested = module.rpartition(".")  # a nested class: ShardedTensor.ProcessGroupState
        if nested[:1].isupper():
            found = getattr(getattr(importlib.import_module(owner), nested), name)
            module, name = owner, f"{nested}.{name}"
        else:
            found = getattr(importlib.import_module(module), name)
        assert isinstance(found, type), qualname
        assert classify_global(module, name) is Verdict.SAFE


def test_dtensor_and_save_plan_pickles_are_clean(tmp_path: Path) -> None:
    """What torch itself pickles for DTensors and a DCP save plan (a one-process gloo group, in
    a child process): every global is a known record."""
    script = f"""
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard, Replicate
from torch.distributed.checkpoint import planner as P, metadata as M
mesh = init_device_mesh("cpu", (1,))
tensors = {{"s": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)]),
            "r": distribute_tensor(torch.ones(2), mesh, [Replicate()])}}
torch.save(tensors, {str(tmp_path / "dtensor.pt")!r})
item = P.WriteItem(index=M.MetadataIndex("w"), type=P.WriteItemType.TENSOR,
    tensor_data=P.TensorWriteData(chunk=M.ChunkStorageMetadata(torch.Size([0]), torch.Size([4])),
    properties=M.TensorProperties(dtype=torch.float32), size=torch.Size([4])))
torch.save({{"plan": P.SavePlan([item])}}, {str(tmp_path / "plan.pt")!r})
dist.destroy_process_group()
"""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=300)
    code, report = _scan(tmp_path / "dtensor.pt", tmp_path / "plan.pt")
    assert code == 0, report
    names = {g["name"] for f in report["files"] for g in f["globals"]}
    assert {"torch.distributed.tensor.DTensor", "torch.distributed.device_mesh.DeviceMesh",
            "torch.distributed.checkpoint.planner.SavePlan"} <= names  # fmt: skip
    with open_checkpoint(tmp_path / "dtensor.pt") as ckpt:
        assert sorted(r.key for r in ckpt.tensors()) == ["r", "s"]


# --- NumPy arrays in pickle protocol 5 -----------------------------------------------------


def _numpy_arrays() -> dict[str, Any]:
    """Arrays of every form protocol 5 pickles through ``numpy._core.numeric._frombuffer``:
    C order, Fortran order, a permuted one (order "K" and an axis order), big-endian, empty,
    0-d, bool, read-only (its buffer in-band as bytes, not a bytearray)."""
    import numpy as np

    read_only = np.arange(4.0)
    read_only.flags.writeable = False
    return {
        "a": np.arange(6).reshape(2, 3),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "permuted": np.arange(24, dtype=np.int16).reshape(2, 3, 4).transpose(1, 0, 2),
        "big_endian": np.arange(3, dtype=">f4"),
        "empty": np.zeros((0, 3)),
        "scalar": np.array(2.5),
        "flags": np.array([True, False]),
        "read_only": read_only,
    }


@pytest.mark.parametrize("zipped", [True, False])
def test_numpy_arrays_of_protocol_5_are_data(tmp_path: Path, zipped: bool) -> None:
    """``torch.save(..., pickle_protocol=5)`` of NumPy arrays: scan classes
    ``_frombuffer`` as safe (no finding), show lists each array with its values."""
    import numpy as np
    import torch

    arrays = _numpy_arrays()
    path = tmp_path / "arrays.pt"
    torch.save(arrays, path, pickle_protocol=5, _use_new_zipfile_serialization=zipped)
    assert b"_frombuffer" in path.read_bytes()
    code, report = _scan(path)
    assert code == 0, report
    verdicts = {g["name"]: g["verdict"] for g in report["files"][0]["globals"]}
    assert verdicts["numpy._core.numeric._frombuffer"] == "safe", verdicts
    with open_checkpoint(path) as ckpt:
        records = {record.key: record for record in ckpt.tensors()}
        assert list(records) == list(arrays)
        for key, expected in arrays.items():
            record = records[key]
            assert record.kind == "ndarray"
            data, _ = ckpt.read_bytes(record)
            dtype = expected.dtype
            flat = np.frombuffer(bytes(data), dtype=dtype)
            strides = tuple(s * dtype.itemsize for s in record.stride)
            got = np.lib.stride_tricks.as_strided(flat, shape=record.shape, strides=strides)
            assert got.dtype == dtype and np.array_equal(got, expected), key
    shown = CliRunner().invoke(cli, ["show", str(path)])
    assert shown.exit_code == 0 and "opaque" not in shown.output + shown.stderr


def _frombuffer_pickle(*args: bytes) -> bytes:
    """A protocol-2 pickle of ``numpy._core.numeric._frombuffer(raw, numpy.dtype('i8'),
    *args)``, each argument given as opcodes."""
    dtype = b"cnumpy\ndtype\n" + pickle.dumps("i8", 2)[2:-1] + b"\x89\x88\x87R"
    raw = b"C\x10" + bytes(16)  # two int64
    call = b"cnumpy._core.numeric\n_frombuffer\n(" + raw + dtype + b"".join(args) + b"tR."
    return b"\x80\x02" + call


def test_frombuffer_arguments_are_checked() -> None:
    """The array's size must be the bytes the pickle carries (numpy's reshape fails too);
    arguments numpy would not take from its own pickles stay an opaque object."""
    ok = load_pickle(_frombuffer_pickle(b"K\x02\x85X\x01\x00\x00\x00C")).root
    assert isinstance(ok, TensorRecord) and ok.shape == (2,) and ok.kind == "ndarray"
    with pytest.raises(CkptError, match="carries 16 bytes"):
        load_pickle(_frombuffer_pickle(b"K\x03\x85X\x01\x00\x00\x00C"))
    for odd in (
        b"K\x02\x85X\x01\x00\x00\x00Z",  # an order numpy never writes
        b"K\x02\x85X\x01\x00\x00\x00K",  # order "K" without an axis order
        b"(" + b"K\x01" * 65 + b"tX\x01\x00\x00\x00C",  # 65 dimensions
        b"J\xff\xff\xff\xff\x85X\x01\x00\x00\x00C",  # a negative dimension
    ):
        assert isinstance(load_pickle(_frombuffer_pickle(odd)).root, OpaqueObject), odd


# --- frames: ckpttool accepts exactly what torch.load and a linear reader read alike ----------

_PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=20)
    | st.binary(max_size=20) | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


def _c_unpickler_on_a_file(data: bytes) -> Any:
    """How torch.load reads a zip's data.pkl: the C unpickler on a BytesIO (frames honoured)."""
    return pickle.Unpickler(io.BytesIO(data)).load()


def _outcome(read: Any, data: bytes) -> Any:
    try:
        return ("value", read(data))
    except Exception:
        return ("error", None)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(
    value=_PLAIN,
    protocol=st.integers(0, 4),
    where=st.integers(0, 10**6),
    length=st.integers(0, 10**6),
    regular=st.booleans(),
)
def test_a_frame_is_accepted_only_where_the_readers_agree(
    value: Any, protocol: int, where: int, length: int, regular: bool
) -> None:
    """One FRAME inserted at an opcode boundary of a plain-data pickle (no globals: loading it
    runs nothing), ending at another boundary or anywhere. Where ckpttool accepts it, the C
    unpickler on a file (torch.load's reading), ``pickle.loads`` (linear) and ckpttool read the
    same value; where the two C readings differ, ckpttool refuses it as ambiguous."""
    original = pickle.dumps(value, protocol=protocol)
    bounds = [pos for _, _, pos in pickletools.genops(original)] + [len(original)]
    at = bounds[where % (len(bounds) - 1)]
    ends = [b for b in bounds if b >= at] if regular else list(range(at, len(original) + 1))
    end = ends[length % len(ends)]
    data = original[:at] + b"\x95" + struct.pack("<Q", end - at) + original[at:]
    by_file, linear = _outcome(_c_unpickler_on_a_file, data), _outcome(pickle.loads, data)
    try:
        ours = ("value", load_pickle(data).root)
    except AmbiguousPickleError:
        ours = ("ambiguous", None)
    except CkptError:
        ours = ("error", None)
    if ours[0] == "value":
        assert by_file == linear == ours
    if by_file != linear:
        assert ours[0] == "ambiguous"
    if regular and protocol < 4:  # a whole-opcode frame where the pickle has none: accepted
        assert ours[0] != "ambiguous"
