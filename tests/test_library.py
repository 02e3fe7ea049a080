"""ckpttool.open and ckpttool.load_state_dict against torch's own loaders, on every fixture.

A tensor from ``get_tensor`` is what ``torch.load(weights_only=True)`` gives for its key: the
same class (a saved ``nn.Parameter`` is one), dtype, shape, strides, storage offset,
``requires_grad``, and the same bytes (compared as bytes: no float comparison), and the
tensors that share a storage in torch's result share one here (and no others). Directories
are compared with their framework's loader: DCP with ``dcp_to_torch_save``, Hugging Face,
Trainer and accelerate directories and DeepSpeed's consolidated weights with what the
frameworks loaded when their fixtures were made (the committed manifests).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.distributed.tensor import DTensor  # noqa: E402

import ckpttool  # noqa: E402
from ckpttool.checkpoint import Checkpoint  # noqa: E402
from ckpttool.errors import CheckpointKeyError, CkptError, InputError, UnsafePickleError  # noqa: E402
from tests.support.helpers import FIXTURES, flatten_loaded  # noqa: E402
from tests.test_json_schemas_fixtures import checkpoint_files, name  # noqa: E402

#: Fixture files torch cannot load, and why.
NO_TORCH_REFERENCE = {
    "special/torchscript.pt": "a TorchScript archive: torch.load refuses it with weights_only",
    "dcp/checkpoint/.metadata": "DCP's index, a plain pickle: dcp/checkpoint is read whole below",
    "gguf": "torch.load reads no GGUF: tests/test_gguf.py checks them against the gguf package",
    "frameworks/lightning_sharded/checkpoints/epoch=2-step=4/.metadata": "DCP's index: "
    "tests/test_lightning_sharded.py checks the directory against Lightning's consolidation",
    "frameworks/torchtitan/checkpoint/step-3/.metadata": "DCP's index: tests/test_torchtitan.py "
    "checks the directory against DCP's own loader",
    "frameworks/rank_sets/fsdp1": "ShardedTensor files load only in a process group: "
    "tests/test_rank_sets.py checks them against FSDP1's own full state dict",
    "frameworks/megatron/tp2/iter_0000010/.metadata": "DCP's index of a Megatron torch_dist "
    "save: tests/test_megatron.py checks the directory against dcp_to_torch_save",
    "frameworks/megatron/pp2/iter_0000020/.metadata": "the same, pipeline parallel",
    "frameworks/megatron/glu_tp2/iter_0000030/.metadata": "the same, a SwiGLU layer",
    "ultralytics": "torch.load imports ultralytics' classes (not in the test extra): "
    "tests/test_ultralytics_fixture.py checks them against ultralytics' own load, frozen",
    "torchao": "torch.load gives torchao's tensor subclasses, ckpttool their inner tensors: "
    "tests/test_torchao.py checks them against torchao's own load, frozen and live",
}
#: Damaged on purpose (tests/fixtures/deepspeed/README.md) so that torch cannot read them:
#: ``ckpttool.open`` must refuse them too (test_files_torch_cannot_read_are_refused).
TORCH_CANNOT_READ = (
    "deepspeed/damaged/model_states_empty_z3/checkpoints/global_step4/"
    "zero_pp_rank_1_mp_rank_00_model_states.pt",
    "deepspeed/damaged/optim_empty/checkpoints/global_step4/"
    "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "deepspeed/damaged/optim_truncated/checkpoints/global_step4/"
    "zero_pp_rank_1_mp_rank_00_optim_states.pt",
)
#: Tensor kinds torch.save writes in the legacy format but torch.load cannot read back.
KINDS_TORCH_CANNOT_READ = {("dtypes_without_storage_class", True), ("storages", True)}
#: A legacy file of nested tensors: whether torch.load reads it depends on what the process
#: loaded before (it fails in a fresh one), and its tensors give no reference either way.
KINDS_NOT_COMPARED = {("nested", True)}


def _bytes(tensor: Any) -> bytes:
    return bytes(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())


def _skip(path: Path) -> str | None:
    where = name(path)
    for prefix, why in NO_TORCH_REFERENCE.items():
        if where == prefix or where.startswith(prefix + "/"):
            return why
    return None


def _torch_load(path: Path) -> Any:
    """What torch gives: its safe loader, safetensors' for a safetensors file; for a file whose
    pickle names classes the safe loader refuses (DeepSpeed's and the Trainer's own files, an
    argparse.Namespace, omegaconf...), the unrestricted loader: these fixtures were written
    here, by the generators and the frameworks (tests/fixtures/generate.py: every torch pickle
    fixture loads with ``weights_only=False``)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return torch.load(path, weights_only=True, map_location="cpu")
        except Exception:
            return torch.load(path, weights_only=False, map_location="cpu")


def _tensor_files() -> list[Path]:
    return [
        p for p in checkpoint_files()
        if not p.name.endswith(".index.json") and _skip(p) is None
        and name(p) not in TORCH_CANNOT_READ
    ]  # fmt: skip


@pytest.mark.parametrize("where", TORCH_CANNOT_READ)
def test_files_torch_cannot_read_are_refused(where: str) -> None:
    from ckpttool.errors import CkptError

    path = FIXTURES / where
    with pytest.raises(Exception):  # noqa: B017 - any error: torch's
        _torch_load(path)
    with pytest.raises(CkptError), ckpttool.open(path) as handle:
        for key in handle.keys():  # noqa: SIM118 - the handle has keys(), like safe_open
            handle.get_tensor(key)


def same_tensor(mine: Any, theirs: Any, key: str) -> None:
    """Equal as torch.load gives it: class, metadata, bytes; sparse, quantized and nested ones
    by their values (tests/test_torch_allowlist.py's comparison)."""
    assert type(mine) is type(theirs), key
    if theirs.is_nested:
        from tests.test_torch_allowlist import _same_tensor

        assert _same_tensor(mine, theirs), key
        return
    assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, key
    assert mine.requires_grad == theirs.requires_grad, key
    assert mine.device.type == theirs.device.type == "cpu" or theirs.is_meta, key
    if theirs.is_meta:
        assert mine.is_meta and mine.stride() == theirs.stride(), key
        return
    if theirs.layout != torch.strided or theirs.is_quantized or theirs.is_nested:
        from tests.test_torch_allowlist import _same_tensor

        assert _same_tensor(mine, theirs), key
        return
    assert mine.stride() == theirs.stride(), key
    assert mine.storage_offset() == theirs.storage_offset(), key
    assert _bytes(mine) == _bytes(theirs), key


def sharing(tensors: dict[str, Any]) -> set[frozenset[str]]:
    """Which keys view one storage (storages with bytes; zero-byte ones have no address)."""
    groups: dict[int, set[str]] = {}
    for key, tensor in tensors.items():
        if tensor.is_meta or tensor.layout != torch.strided or tensor.is_quantized:
            continue
        if tensor.is_nested:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes():
            groups.setdefault(storage.data_ptr(), set()).add(key)
    return {frozenset(keys) for keys in groups.values()}


@pytest.mark.parametrize("path", _tensor_files(), ids=name)
def test_every_fixture_file_reads_as_torch_load(path: Path) -> None:
    expected = _torch_load(path)
    theirs = {k: v for k, v in flatten_loaded(expected) if isinstance(v, torch.Tensor)}
    with ckpttool.open(path) as handle:
        assert set(theirs) <= set(handle.keys())
        for key in [k for k, v in theirs.items() if isinstance(v, DTensor)]:
            # one rank's piece of a DTensor is not the tensor: refused, naming the file
            with pytest.raises(InputError, match="a DTensor shard"):
                handle.get_tensor(key)
            del theirs[key]
        if path.name.startswith("zero_pp_rank_") and path.name.endswith("_model_states.pt"):
            # a ZeRO-3 rank's 0-element placeholders for partitioned parameters: refused
            placeholders = [
                k for k, v in theirs.items() if k.startswith("module.") and not v.numel()
            ]
            assert placeholders
            for key in placeholders:
                with pytest.raises(InputError, match="hold 0 elements standing for the real ones"):
                    handle.get_tensor(key)
                del theirs[key]
        mine = {key: handle.get_tensor(key) for key in theirs}
    for key, tensor in theirs.items():
        same_tensor(mine[key], tensor, key)
    assert sharing(mine) == sharing(theirs)


def test_the_sweep_covers_every_kind_of_file() -> None:
    names = {name(p) for p in _tensor_files()}
    for expected in (
        "minimind/pretrain_32_resume.pth", "ckpttool/pretrain_32_resume.pth",
        "legacy/state_dict.pth", "lightning/epoch=1-step=40.ckpt", "pairs/base.safetensors",
        "special/views.pth", "special/cuda_storages.pth", "dcp/checkpoint.pth",
        "deepspeed/stage3_bf16_2proc/checkpoints/global_step4/"
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "frameworks/trainer_1proc/output/checkpoint-8/optimizer.pt",
    ):  # fmt: skip
        assert expected in names


# -- the tensor kinds torch saves: every dtype, views, sparse, quantized, nested, meta ----------


def _kind_cases() -> list[tuple[str, bool]]:
    from tests.test_torch_allowlist import FIXTURES as KINDS

    return [
        (kind, legacy) for kind in sorted(KINDS) for legacy in (False, True)
        if (kind, legacy) not in KINDS_TORCH_CANNOT_READ | KINDS_NOT_COMPARED
    ]  # fmt: skip


@pytest.mark.parametrize(("kind", "legacy"), sorted(KINDS_TORCH_CANNOT_READ))
def test_the_kinds_left_out_are_those_torch_cannot_read_back(
    tmp_path: Path, kind: str, legacy: bool
) -> None:
    """The list above stays true: torch writes these and fails to read them."""
    from tests.test_torch_allowlist import FIXTURES as KINDS
    from tests.test_torch_allowlist import _save

    path = tmp_path / f"{kind}.pt"
    assert _save(KINDS[kind](), path, legacy)
    with warnings.catch_warnings(), pytest.raises((AttributeError, RuntimeError)):
        warnings.simplefilter("ignore")
        torch.load(path, weights_only=True)


@pytest.mark.parametrize(("kind", "legacy"), _kind_cases())
def test_every_tensor_kind_reads_as_torch_load(tmp_path: Path, kind: str, legacy: bool) -> None:
    from tests.test_torch_allowlist import FIXTURES as KINDS
    from tests.test_torch_allowlist import _save

    path = tmp_path / f"{kind}.pt"
    assert _save(KINDS[kind](), path, legacy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = torch.load(path, weights_only=True)
        theirs = {
            k: v
            for k, v in flatten_loaded(expected)
            if isinstance(v, torch.Tensor) and not (kind == "nested" and legacy)
        }
        with ckpttool.open(path) as handle:
            mine = {key: handle.get_tensor(key) for key in theirs}
    for key, tensor in theirs.items():
        same_tensor(mine[key], tensor, key)
    assert sharing(mine) == sharing(theirs)


def test_a_big_endian_file_reads_as_torch_load_swaps_it(tmp_path: Path) -> None:
    from tests.test_convert import big_endian_copy

    source = FIXTURES / "ckpttool/pretrain_32_resume.pth"
    path = tmp_path / "big_endian.pth"
    big_endian_copy(source, path)
    expected = torch.load(path, weights_only=True)
    theirs = {k: v for k, v in flatten_loaded(expected) if isinstance(v, torch.Tensor)}
    with ckpttool.open(path) as handle:
        assert handle.checkpoint.details["byteorder"] == "big"
        mine = {key: handle.get_tensor(key) for key in theirs}
    assert any(t.element_size() > 1 for t in theirs.values())
    for key, tensor in theirs.items():
        same_tensor(mine[key], tensor, key)
    assert sharing(mine) == sharing(theirs)


def test_numpy_arrays_and_storages_come_back_as_tensors(tmp_path: Path) -> None:
    import numpy as np

    path = FIXTURES / "special/numpy_rng.pth"
    expected = torch.load(path, weights_only=False)  # the generator's own fixture
    with ckpttool.open(path) as handle:
        history = handle.get_tensor("loss_history")
    assert np.array_equal(history.numpy(), expected["loss_history"])
    assert history.numpy().dtype == expected["loss_history"].dtype
    storage = tmp_path / "storage.pt"
    torch.save({"s": torch.arange(5, dtype=torch.int16).untyped_storage()}, storage)
    with ckpttool.open(storage) as handle:
        assert bytes(handle.get_tensor("s").numpy()) == bytes(
            torch.arange(5, dtype=torch.int16).numpy()
        )


def test_views_of_one_storage_share_it_as_torch_loads_them(tmp_path: Path) -> None:
    base = torch.arange(24.0)
    path = tmp_path / "views.pt"
    torch.save({"a": base[6:].view(3, 6), "b": base.view(4, 6).t(), "c": base.clone()}, path)
    with ckpttool.open(path) as handle:
        a, b, c = (handle.get_tensor(k) for k in "abc")
        again = handle.get_tensor("a")
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert again.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert c.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert (a.storage_offset(), b.storage_offset(), b.stride()) == (6, 0, (1, 6))
    a[0, 0] = 100.0  # one storage: the other view sees it, as after torch.load
    assert b[0, 1] == 100.0 and c[6] == 6.0


# -- memory maps, slices, URLs ---------------------------------------------------------------


def _mapped(path: Path) -> bool:
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(str(path)) for line in maps)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_local_tensors_are_a_private_map_of_the_file(tmp_path: Path, suffix: str) -> None:
    path = (tmp_path / "weights").with_suffix(suffix)
    state = {"w": torch.arange(4096.0).view(64, 64), "b": torch.ones(64)}
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, path)
    else:
        torch.save(state, path)
    before = path.read_bytes()
    with ckpttool.open(path) as handle:
        weight = handle.get_tensor("w")
        assert _mapped(path)
        bias = handle.get_tensor("b")
        spans = {
            r.key: handle.checkpoint.storage_span(r.storage)[0]  # type: ignore[arg-type]
            for r in handle.checkpoint.tensors()
        }
    # both storages are slices of one map of the file, at their offsets in it
    delta = bias.untyped_storage().data_ptr() - weight.untyped_storage().data_ptr()
    assert delta == spans["b"] - spans["w"]
    weight.add_(1.0)  # a private map: the file never changes
    assert path.read_bytes() == before
    assert torch.equal(weight, torch.arange(4096.0).view(64, 64) + 1)


class _Reads:
    """Every storage range a checkpoint reads (start, stop)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ranges: list[tuple[int, int]] = []
        original = Checkpoint.read_storage

        def spy(ckpt: Checkpoint, storage: Any, start: int, stop: int, key: str = "") -> Any:
            self.ranges.append((start, stop))
            return original(ckpt, storage, start, stop, key)

        monkeypatch.setattr(Checkpoint, "read_storage", spy)


@pytest.mark.parametrize("suffix", [".pth", ".safetensors", "-legacy.pth"])
def test_get_slice_reads_only_the_rows_of_the_slice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    path = tmp_path / f"big{suffix}"
    weight = torch.arange(1000 * 8, dtype=torch.float32).view(1000, 8)
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({"w": weight}, path)
    else:
        torch.save({"w": weight}, path, _use_new_zipfile_serialization=suffix == ".pth")
    reads = _Reads(monkeypatch)
    with ckpttool.open(path) as handle:
        part = handle.get_slice("w")
        assert part.get_shape() == [1000, 8] and part.get_dtype() == "float32"
        assert torch.equal(part[10:20], weight[10:20])
        assert reads.ranges == [(10 * 32, 20 * 32)]
        assert torch.equal(part[-1], weight[-1])
        assert torch.equal(part[5:7, 2:4], weight[5:7, 2:4])
        assert torch.equal(part[3, 1], weight[3, 1])
        assert torch.equal(part[990:5000], weight[990:])
        assert part[20:10].shape == (0, 8)
        assert reads.ranges[1:] == [(999 * 32, 1000 * 32), (5 * 32, 7 * 32), (3 * 32, 4 * 32),
                                    (990 * 32, 1000 * 32)]  # fmt: skip
        assert torch.equal(part[::100], weight[::100])  # a step: read whole, then indexed
        with pytest.raises(IndexError):
            part[1000]


def test_a_url_is_read_by_ranges(tmp_path: Path) -> None:
    from tests.support.range_server import RangeServer

    ones = torch.ones(8)
    state = {"a": torch.arange(100_000.0), "b": ones[:3], "c": ones[2:].view(2, 3), "epoch": 3}
    path = tmp_path / "remote.pth"
    torch.save(state, path)
    server = RangeServer().start()
    try:
        url = server.add("remote.pth", path.read_bytes())
        sent = server.bytes_sent
        with ckpttool.open(url) as handle:
            assert handle.metadata() == {"epoch": 3}
            b, c = handle.get_tensor("b"), handle.get_tensor("c")
            assert torch.equal(b, state["b"]) and torch.equal(c, state["c"])
        assert server.bytes_sent - sent < 100_000  # not the 400 kB tensor
        assert all(r is not None for _, r in server.requests)  # every request ranged
        # read into memory, still one storage for the two views of one
        assert b.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
        assert c.storage_offset() == 2
        assert torch.equal(ckpttool.load_state_dict(url, section=None)["a"], state["a"])
    finally:
        server.stop()


# -- metadata, errors, the handle --------------------------------------------------------------


def test_metadata_is_the_non_tensor_fields() -> None:
    path = FIXTURES / "minimind/pretrain_32_resume.pth"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = torch.load(path, weights_only=True)
    with ckpttool.open(path) as handle:
        meta = handle.metadata()
    assert {"epoch", "step"} <= set(meta)
    assert "model" not in meta  # only tensors under it
    for key, value in expected.items():
        if not isinstance(value, (dict, list, torch.Tensor)):
            assert meta[key] == value, key
    groups = meta["optimizer"]["param_groups"]
    assert groups[0]["lr"] == expected["optimizer"]["param_groups"][0]["lr"]
    assert "state" not in meta["optimizer"]  # all tensors
    with ckpttool.open(FIXTURES / "pairs/base.safetensors") as handle:
        assert handle.metadata() == handle.checkpoint.metadata != {}


def test_errors_are_the_command_lines(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ckpttool.cli import cli

    missing = tmp_path / "missing.pth"
    with pytest.raises(CkptError) as raised:
        ckpttool.open(missing)
    shown = CliRunner().invoke(cli, ["show", str(missing)])
    assert shown.exit_code == 2
    assert shown.stderr.strip() == f"Error: {raised.value}"
    with pytest.raises(CkptError) as raised:
        ckpttool.load_state_dict(missing)
    assert shown.stderr.strip() == f"Error: {raised.value}"
    with (
        ckpttool.open(FIXTURES / "pairs/base.pth") as handle,
        pytest.raises(CheckpointKeyError, match="no tensor 'nope'"),
    ):
        handle.get_tensor("nope")
    with pytest.raises(InputError, match="closed"):
        handle.get_tensor(handle.keys()[0])


def test_damaged_values_raise_naming_the_file(tmp_path: Path) -> None:
    from tests.support import adversarial

    path = tmp_path / "deflated.pth"  # opens (the pickle is fine); its values cannot be read
    path.write_bytes(adversarial.deflated_storage())
    message = "record 'archive/data/0' is compressed"
    with ckpttool.open(path) as handle:
        with pytest.raises(CkptError, match=message) as raised:
            handle.get_tensor("w")
        assert str(raised.value).startswith(f"{path}: ")
        with pytest.raises(CkptError, match=message) as raised:
            handle.get_slice("w")[:2]
        assert str(raised.value).startswith(f"{path}: ")
    with pytest.raises(CkptError, match=message) as raised:
        ckpttool.load_state_dict(path)
    assert str(raised.value).startswith(f"{path}: ")
    past = tmp_path / "past.pth"  # refused on open, as by every command
    past.write_bytes(adversarial.extent_past_storage())
    with pytest.raises(CkptError, match=f"^{past}: .*reaches byte 4,000 of its storage"):
        ckpttool.open(past)


def test_pickle_code_never_runs(tmp_path: Path) -> None:
    class Boom:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    path = tmp_path / "evil.pth"
    torch.save({"w": torch.ones(2), "x": Boom()}, path)
    with pytest.raises(UnsafePickleError):
        ckpttool.load_state_dict(path)
    with pytest.raises(UnsafePickleError):
        ckpttool.open(path)
    assert not (tmp_path / "ran").exists()


def test_device_and_dtype_cast_a_copy() -> None:
    path = FIXTURES / "pairs/base.pth"
    with ckpttool.open(path) as handle:
        key = handle.keys()[0]
        plain = handle.get_tensor(key)
        half = handle.get_tensor(key, dtype=torch.float16)
        same = handle.get_tensor(key, device="cpu", dtype=plain.dtype)
    assert half.dtype == torch.float16 and torch.equal(half, plain.to(torch.float16))
    assert same.untyped_storage().data_ptr() == plain.untyped_storage().data_ptr()


# -- load_state_dict -----------------------------------------------------------------------------


def test_load_state_dict_finds_the_model_of_each_layout() -> None:
    cases = {
        "minimind/pretrain_32_resume.pth": "model",
        "ckpttool/pretrain_32_resume.pth": "model",
        "lightning/epoch=1-step=40.ckpt": "state_dict",
        "minimind/pretrain_32.pth": None,  # the whole file is the state dict
        "pairs/base.safetensors": None,
    }
    for where, section in cases.items():
        path = FIXTURES / where
        expected = _torch_load(path)
        if section is not None:
            expected = expected[section]
        theirs = dict(flatten_loaded(expected))
        if path.suffix == ".safetensors":  # the tied names it declares, given back as convert does
            theirs |= {alias: theirs[kept] for alias, kept in _declared_aliases(path).items()}
        mine = ckpttool.load_state_dict(path)
        assert list(mine) == list(theirs), where
        for key, tensor in theirs.items():
            same_tensor(mine[key], tensor, f"{where}: {key}")


def _declared_aliases(path: Path) -> dict[str, str]:
    """``{alias: stored}`` of a safetensors file: its ``ckpttool.aliases`` (docs/convert.md),
    and ``safetensors.torch.save_model``'s entries (an absent name: the stored one it ties)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as opened:
        metadata = dict(opened.metadata() or {})
        names = set(opened.keys())
    declared: dict[str, str] = json.loads(metadata.pop("ckpttool.aliases", "{}"))
    for alias, kept in metadata.items():
        if alias not in names and kept in names:
            declared.setdefault(alias, kept)
    return declared


def test_load_state_dict_into_the_model(tmp_path: Path) -> None:
    from tests.fixtures.frameworks.models import TinyNet

    path = FIXTURES / "frameworks/tutorial/general_checkpoint.pt"
    model = TinyNet()
    model.load_state_dict(ckpttool.load_state_dict(path))  # strict: every key, no other
    expected = torch.load(path, weights_only=True)["model_state_dict"]
    for key, tensor in model.state_dict().items():
        assert _bytes(tensor) == _bytes(expected[key]), key


def test_load_state_dict_sections_prefixes_and_keys() -> None:
    ddp = FIXTURES / "wrapped/ddp_compiled.pth"
    raw = ckpttool.load_state_dict(ddp)
    assert all(key.startswith("module._orig_mod.") for key in raw)
    bare = ckpttool.load_state_dict(ddp, ignore_wrappers=True)
    assert list(bare) == [key.removeprefix("module._orig_mod.") for key in raw]
    assert list(ckpttool.load_state_dict(ddp, strip_prefix=["module.", "_orig_mod."])) == list(bare)
    assert list(ckpttool.load_state_dict(ddp, strip_prefix="module.")) == [
        key.removeprefix("module.") for key in raw
    ]
    some = list(bare)[:2]
    picked = ckpttool.load_state_dict(ddp, ignore_wrappers=True, keys=some)
    assert list(picked) == some
    with pytest.raises(CheckpointKeyError, match="no tensor 'nope'"):
        ckpttool.load_state_dict(ddp, keys=["nope"])
    resume = FIXTURES / "minimind/pretrain_32_resume.pth"
    optimizer = ckpttool.load_state_dict(resume, section="optimizer")
    assert optimizer and all(key.startswith("state.") for key in optimizer)
    everything = ckpttool.load_state_dict(resume, section=None)
    assert set(everything) == {"model." + k for k in ckpttool.load_state_dict(resume)} | {
        "optimizer." + k for k in optimizer
    }
    with pytest.raises(InputError, match="no section 'nope'"):
        ckpttool.load_state_dict(resume, section="nope")
    doubled = ckpttool.load_state_dict(resume, dtype=torch.float64)
    assert all(t.dtype == torch.float64 for t in doubled.values() if t.is_floating_point())


# -- directories: the frameworks' own loaders ---------------------------------------------------


def test_dcp_reads_as_dcp_to_torch_save(tmp_path: Path) -> None:
    from tests.support.dcp_cases import DCP, torch_reference

    expected = dict(flatten_loaded(torch_reference(tmp_path)))
    with ckpttool.open(DCP) as handle:
        assert handle.keys() == list(expected)
        for key, tensor in expected.items():
            same_tensor(handle.get_tensor(key), tensor, key)
        assert handle.metadata()["step"] == 1200
    model = ckpttool.load_state_dict(DCP)
    assert list(model) == [k.removeprefix("model.") for k in expected if k.startswith("model.")]


def _sha256(tensor: Any) -> str:
    return hashlib.sha256(_bytes(tensor)).hexdigest()


FRAMEWORKS = FIXTURES / "frameworks"
FRAMEWORK_MANIFEST: dict[str, Any] = json.loads((FRAMEWORKS / "manifest.json").read_text())
DIRECTORY_CASES = [  # tests/test_framework_reading.py's: (case, directory, Trainer checkpoint)
    ("hf_model", "hf_model", None),
    ("hf_sharded", "hf_sharded", None),
    ("hf_sharded", "hf_sharded/model.safetensors.index.json", None),
    ("hf_bin_sharded", "hf_bin_sharded", None),
    ("trainer_1proc", "trainer_1proc/output/checkpoint-4", "trainer_1proc/output/checkpoint-4"),
    ("trainer_2proc", "trainer_2proc/output/checkpoint-8", "trainer_2proc/output/checkpoint-8"),
    ("accelerate_1proc", "accelerate_1proc/state", None),
    ("accelerate_2proc", "accelerate_2proc/state", None),
]


@pytest.mark.parametrize(("case", "path", "checkpoint"), DIRECTORY_CASES)
def test_a_directory_loads_as_its_framework_loads_the_model(
    case: str, path: str, checkpoint: str | None
) -> None:
    """load_state_dict(DIR) is the state dict the framework's loader built (from_pretrained,
    load_state), as the manifest froze it, but the tied keys the files do not store."""
    framework = FRAMEWORK_MANIFEST["cases"][case]["framework"]
    if checkpoint is not None:
        framework = framework["output"]["checkpoints"][checkpoint]
    theirs = framework.get("model", framework)["tensors"]
    mine = ckpttool.load_state_dict(FRAMEWORKS / path)
    assert set(theirs) - set(mine) <= {"lm_head.weight"}  # tied: transformers re-ties it
    assert set(mine) <= set(theirs)
    for key, tensor in mine.items():
        entry = theirs[key]
        assert str(tensor.dtype).removeprefix("torch.") == entry["dtype"], key
        assert list(tensor.shape) == entry["shape"], key
        assert _sha256(tensor) == entry["sha256"], key


DEEPSPEED = FIXTURES / "deepspeed"
DEEPSPEED_MANIFEST: dict[str, Any] = json.loads((DEEPSPEED / "manifest.json").read_text())


@pytest.mark.parametrize("case", sorted(DEEPSPEED_MANIFEST["cases"]))
def test_deepspeed_weights_view_is_get_fp32_state_dict_from_zero_checkpoint(case: str) -> None:
    """view="weights": the fp32 weights DeepSpeed's consolidation gives for the latest tag
    (the manifest froze get_fp32_state_dict_from_zero_checkpoint's state dict)."""
    from ckpttool.frameworks.base import WEIGHTS_VIEW

    expected = DEEPSPEED_MANIFEST["cases"][case]["deepspeed"]["fp32_latest"]
    directory = DEEPSPEED / case / "checkpoints"
    if "error" in expected:  # ZeRO-0: DeepSpeed consolidates nothing; the module's weights
        with ckpttool.open(directory, view=WEIGHTS_VIEW) as handle:
            assert "view" not in handle.checkpoint.details  # opened as by default
        latest = (directory / "latest").read_text().strip()
        saved = torch.load(directory / latest / "mp_rank_00_model_states.pt", weights_only=False)
        theirs = dict(flatten_loaded(saved["module"]))
        mine = ckpttool.load_state_dict(directory)
        assert list(mine) == list(theirs)
        for key, tensor in theirs.items():
            same_tensor(mine[key], tensor, key)
        return
    mine = ckpttool.load_state_dict(directory, view=WEIGHTS_VIEW, section=None)
    with ckpttool.open(directory, view=WEIGHTS_VIEW) as handle:
        assert set(handle.keys()) == set(mine)
    assert set(mine) == set(expected)
    for key, tensor in mine.items():
        entry = expected[key]
        assert str(tensor.dtype).removeprefix("torch.") == entry["dtype"], key
        assert list(tensor.shape) == entry["shape"], key
        assert _sha256(tensor) == entry["sha256"], key


def test_public_names() -> None:
    for public in ("open", "load_state_dict", "CheckpointHandle", "TensorSlice"):
        assert public in ckpttool.__all__
        assert public in dir(ckpttool)
    assert ckpttool.open is ckpttool.library.open


def test_docs_python_md_covers_the_api() -> None:
    """docs/python.md documents every public member of the handle and every keyword of
    load_state_dict (and README and the docs index link it)."""
    import inspect

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "python.md").read_text()
    members = [
        n for n in vars(ckpttool.CheckpointHandle) if not n.startswith("_") and n != "name"
    ]  # fmt: skip
    assert [m for m in members if f"`{m}" not in page] == []
    for method in ("get_shape", "get_dtype"):
        assert f"`{method}()`" in page
    keywords = inspect.signature(ckpttool.load_state_dict).parameters
    assert [k for k in keywords if k not in page] == []
    assert "(docs/python.md)" in (root / "README.md").read_text()
    assert "(python.md)" in (root / "docs" / "README.md").read_text()
