"""``ckpttool.commands.convert.run``: exact round trips, tied weights, options, sharding, atomicity, verification.

torch and safetensors are the oracles: every output is read back with ``torch.load`` or
``safetensors.torch.load_file`` and compared bit for bit with what torch reads from the source.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch as st
import torch
from safetensors import safe_open

from ckpttool import __version__
from ckpttool.checkpoint import open_checkpoint
from ckpttool.commands.convert.output import parse_size
from ckpttool.commands.convert.run import (
    OverflowRefusedError,
    VerificationError,
    convert,
)
from ckpttool.commands.selection import select
from ckpttool.errors import EXIT_FOUND, InputError, NotACheckpointError, OutputExistsError
from ckpttool.formats.torch_zip.writer import _encode
from tests.support.helpers import FIXTURES, fixture_files, fixture_id, flatten_loaded
from tests.support.minimind import MiniMindForCausalLM

ALIASES = "ckpttool.aliases"
TIED = {"model.embed_tokens.weight": "lm_head.weight"}
MINIMIND = FIXTURES / "minimind/pretrain_32.pth"  # fp16, embed and lm_head separate storages
CKPTTOOL = FIXTURES / "ckpttool/pretrain_32.pth"  # fp16 weights file, no shared storage
TIED_RESUME = FIXTURES / "ckpttool/pretrain_32_resume.pth"  # fp32 model: embed, lm_head tied
RESUME = FIXTURES / "minimind/pretrain_32_resume.pth"
VIEWS = FIXTURES / "special/views.pth"


# --- oracles -----------------------------------------------------------------------------------


def torch_view(value: Any) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    return value.contiguous()


def assert_bits_equal(actual: Any, expected: Any, name: str = "") -> None:
    actual, expected = torch_view(actual), torch_view(expected)
    assert actual.dtype == expected.dtype, name
    assert actual.shape == expected.shape, name
    assert torch.equal(
        actual.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)
    ), name


def metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as handle:
        return handle.metadata() or {}


def expected_tensors(source: Path, **options: Any) -> dict[str, Any]:
    """What torch reads from ``source``, under the names convert gives (aliases included)."""
    with open_checkpoint(source) as ckpt:
        names = {name: record.key for name, record in select(ckpt, **options).tensors.items()}
        file_metadata = ckpt.metadata
    if source.suffix == ".safetensors":
        loaded = st.load_file(source)
        out = {name: loaded[key] for name, key in names.items()}
        declared = dict(json.loads(file_metadata.get(ALIASES, "{}")))
        declared.update({k: v for k, v in file_metadata.items() if k not in loaded and v in loaded})
        out.update(
            {alias: loaded[stored] for alias, stored in declared.items() if stored in loaded}
        )
        return out
    flat = dict(flatten_loaded(torch.load(source, map_location="cpu", weights_only=False)))
    return {name: flat[key] for name, key in names.items()}


# a ZeRO-3 rank's model states holds 0-element placeholders: refused by convert
# (tests/test_deepspeed_placeholders.py)
WEIGHTS = [
    p for p in fixture_files()
    if not (p.name.startswith("zero_pp_rank_") and p.name.endswith("_model_states.pt"))
]  # fmt: skip


@pytest.mark.parametrize("source", WEIGHTS, ids=fixture_id)
def test_round_trip_to_safetensors_and_back_to_pth_is_exact(source: Path, tmp_path: Path) -> None:
    middle, back = tmp_path / "middle.safetensors", tmp_path / "back.pth"
    convert(source, middle)
    convert(middle, back)
    expected = expected_tensors(source)
    stored = st.load_file(middle)
    aliases = json.loads(metadata(middle).get(ALIASES, "{}"))
    assert set(stored).isdisjoint(aliases)
    assert set(stored) | set(aliases) == set(expected)
    for name, tensor in stored.items():
        assert_bits_equal(tensor, expected[name], name)
    for mmap in (False, True):
        final = torch.load(back, map_location="cpu", weights_only=True, mmap=mmap)
        assert set(final) == set(expected)
        for name, tensor in final.items():
            assert_bits_equal(tensor, expected[name], name)
        for alias, kept in aliases.items():
            assert (
                final[alias].untyped_storage().data_ptr()
                == final[kept].untyped_storage().data_ptr()
            )


@pytest.mark.parametrize("source", [MINIMIND, CKPTTOOL, FIXTURES / "legacy/state_dict.pth"],
                         ids=fixture_id)  # fmt: skip
def test_direct_pth_output_is_a_plain_state_dict_torch_loads(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    report = convert(source, out)
    assert report.format == "pth"
    expected = expected_tensors(source)
    loaded = torch.load(out, weights_only=True, mmap=True)
    assert list(loaded) == list(expected)  # source order
    for name, tensor in loaded.items():
        assert_bits_equal(tensor, expected[name], name)


# --- tied weights ------------------------------------------------------------------------------


def tiny_model(seed: int) -> MiniMindForCausalLM:
    torch.manual_seed(seed)
    return MiniMindForCausalLM()


def test_tied_model_is_stored_once_and_loads_back_tied(tmp_path: Path) -> None:
    model = tiny_model(0)
    source, out = tmp_path / "model.pth", tmp_path / "model.safetensors"
    torch.save(model.state_dict(), source)
    report = convert(source, out)

    removed = st._remove_duplicate_names(model.state_dict())  # what save_model would drop
    assert report.aliases == {alias: kept for kept, names in removed.items() for alias in names}
    assert report.aliases == TIED
    assert json.loads(metadata(out)[ALIASES]) == TIED
    assert "model.embed_tokens.weight" not in st.load_file(out)

    fresh = tiny_model(1)
    st.load_model(fresh, out)  # strict: raises on missing or unexpected keys
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)

    state_dict = st.load_file(out)  # load_state_dict-style, resolving the recorded aliases
    for alias, kept in json.loads(metadata(out)[ALIASES]).items():
        state_dict[alias] = state_dict[kept]
    third = tiny_model(2)
    third.load_state_dict(state_dict)
    assert third.lm_head.weight is third.model.embed_tokens.weight
    for name, value in model.state_dict().items():
        assert torch.equal(third.state_dict()[name], value), name

    back = convert(out, tmp_path / "back.pth")
    loaded = torch.load(back.outputs[0], weights_only=True)
    assert loaded["lm_head.weight"].untyped_storage().data_ptr() == (
        loaded["model.embed_tokens.weight"].untyped_storage().data_ptr()
    )
    fourth = tiny_model(3)
    fourth.load_state_dict(loaded)
    assert torch.equal(fourth.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_keep_shared_writes_separate_copies(tmp_path: Path) -> None:
    assert convert(TIED_RESUME, tmp_path / "tied.safetensors").aliases == TIED
    report = convert(TIED_RESUME, tmp_path / "out.safetensors", keep_shared=True)
    assert report.aliases == {}
    assert ALIASES not in metadata(report.outputs[0])
    loaded = st.load_file(report.outputs[0])
    assert torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])


def test_equal_bytes_in_separate_storages_are_not_aliases(tmp_path: Path) -> None:
    report = convert(MINIMIND, tmp_path / "out.safetensors")  # MiniMind halves each key apart
    assert report.aliases == {}
    assert report.tensors == len(expected_tensors(MINIMIND))


def test_views_are_written_with_their_own_values_never_the_storage(tmp_path: Path) -> None:
    report = convert(VIEWS, tmp_path / "views.safetensors")
    expected = expected_tensors(VIEWS)
    assert report.aliases == {}
    loaded = st.load_file(report.outputs[0])
    assert set(loaded) == set(expected)
    for name, tensor in loaded.items():
        assert_bits_equal(tensor, expected[name], name)
    view_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    assert report.tensor_bytes == view_bytes
    header = int.from_bytes(report.outputs[0].read_bytes()[:8], "little")
    assert report.outputs[0].stat().st_size == 8 + header + view_bytes


# --- dtype -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "torch_dtype"),
                         [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)])  # fmt: skip
def test_dtype_casts_floating_tensors_like_torch(
    dtype: str, torch_dtype: torch.dtype, tmp_path: Path
) -> None:
    source = FIXTURES / "special/nested_generic.pth"  # bf16, int64, bool, 0-dim and empty tensors
    report = convert(source, tmp_path / "out.safetensors", dtype=dtype)
    loaded = st.load_file(report.outputs[0])
    for name, original in expected_tensors(source).items():
        want = original.to(torch_dtype) if original.is_floating_point() else original
        assert_bits_equal(loaded[name], want, name)


def test_keep_leaves_fp16_weights_fp16(tmp_path: Path) -> None:
    report = convert(MINIMIND, tmp_path / "out.safetensors")
    assert report.cast == {}
    assert {t.dtype for t in st.load_file(report.outputs[0]).values()} == {torch.float16}


def test_fp32_resume_model_to_fp16(tmp_path: Path) -> None:
    source = TIED_RESUME
    report = convert(source, tmp_path / "out.safetensors", dtype="fp16")
    assert report.cast == {"float32->float16": report.tensors}
    loaded = st.load_file(report.outputs[0])
    for name, original in expected_tensors(source).items():
        if name in loaded:
            assert_bits_equal(loaded[name], original.half(), name)


def overflow_source(tmp_path: Path) -> Path:
    path = tmp_path / "big.pth"
    big = torch.tensor([1.0, 7e4, -2e5, 1e-9], dtype=torch.float32)
    torch.save({"fine": torch.ones(3), "big": big}, path)
    return path


def test_overflow_refuses_and_writes_nothing(tmp_path: Path) -> None:
    source = overflow_source(tmp_path)
    with pytest.raises(OverflowRefusedError) as caught:
        convert(source, tmp_path / "out.safetensors", dtype="fp16")
    message = str(caught.value)
    assert message.startswith("big: 2 value(s) would overflow to inf in float16 (max |x| = 200000)")
    assert "--allow-overflow" in message
    assert caught.value.exit_code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pth"]


def test_allow_overflow_writes_inf_and_reports_underflow(tmp_path: Path) -> None:
    source = overflow_source(tmp_path)
    report = convert(source, tmp_path / "out.safetensors", dtype="fp16", allow_overflow=True)
    assert report.overflow == {"big": 2}
    assert report.underflow == {"big": 1}
    assert "values that became 0 in float16 (underflow): big (1)" in report.notes
    assert st.load_file(report.outputs[0])["big"].tolist() == [
        1.0,
        float("inf"),
        float("-inf"),
        0.0,
    ]


# --- sections, names, fields -------------------------------------------------------------------


def test_resume_converts_its_model_and_keeps_fields_as_metadata(tmp_path: Path) -> None:
    report = convert(RESUME, tmp_path / "out.safetensors")
    assert (report.layout, report.section) == ("minimind_resume", "model")
    assert set(st.load_file(report.outputs[0])) == set(expected_tensors(MINIMIND))
    meta = metadata(report.outputs[0])
    assert meta["format"] == "pt"
    assert meta["ckpttool.source"] == "pretrain_32_resume.pth"
    assert meta["ckpttool.version"] == __version__
    fields = {k: json.loads(v) for k, v in meta.items() if k.startswith("ckpttool.field.")}
    assert fields == {
        "ckpttool.field.epoch": 1,
        "ckpttool.field.step": 1200,
        "ckpttool.field.world_size": 8,
        "ckpttool.field.wandb_id": "run-abc123",
        "ckpttool.field.scaler.scale": 65536.0,
        "ckpttool.field.scaler.growth_factor": 2.0,
        "ckpttool.field.scaler.backoff_factor": 0.5,
        "ckpttool.field.scaler.growth_interval": 2000,
        "ckpttool.field.scaler._growth_tracker": 3,
    }
    assert report.fields == {k: meta[k] for k in fields}
    assert report.notes == ["not converted (not weights): optimizer (60 tensors, 32 other values)"]


def test_section_picks_another_subtree(tmp_path: Path) -> None:
    report = convert(RESUME, tmp_path / "opt.safetensors", section="optimizer")
    loaded = st.load_file(report.outputs[0])
    assert "state.0.exp_avg" in loaded and "state.0.step" in loaded
    assert_bits_equal(
        loaded["state.0.exp_avg"], expected_tensors(RESUME, section="optimizer")["state.0.exp_avg"]
    )


def test_lightning_checkpoint_converts_its_state_dict(tmp_path: Path) -> None:
    source = FIXTURES / "lightning/epoch=1-step=40.ckpt"
    report = convert(source, tmp_path / "out.safetensors")
    assert (report.layout, report.section) == ("lightning", "state_dict")
    assert set(st.load_file(report.outputs[0])) | set(report.aliases) == set(
        expected_tensors(source)
    )
    assert json.loads(metadata(report.outputs[0])["ckpttool.field.global_step"]) == 40


@pytest.mark.parametrize(("options", "prefix"), [
    ({"strip": ("module.",)}, "module."),
    ({"ignore_wrappers": True}, "module._orig_mod."),
    ({"strip": ("module.", "_orig_mod.")}, "module._orig_mod."),
])  # fmt: skip
def test_prefixes_are_removed(options: dict[str, Any], prefix: str, tmp_path: Path) -> None:
    source = FIXTURES / ("wrapped/ddp.pth" if prefix == "module." else "wrapped/ddp_compiled.pth")
    report = convert(source, tmp_path / "out.safetensors", **options)
    names = set(st.load_file(report.outputs[0])) | set(report.aliases)
    with open_checkpoint(source) as ckpt:
        originals = {record.key for record in ckpt.tensors()}
    assert names == {key.removeprefix(prefix) for key in originals}
    assert all(key.startswith(prefix) for key in originals)


def test_filter_converts_a_subset(tmp_path: Path) -> None:
    report = convert(MINIMIND, tmp_path / "out.safetensors", pattern="*layers.1.*norm.weight")
    assert sorted(st.load_file(report.outputs[0])) == [
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
    ]
    with pytest.raises(InputError, match="--filter 'nothing' matches no tensor"):
        convert(MINIMIND, tmp_path / "none.safetensors", pattern="nothing")


def test_fields_that_are_not_scalars_are_listed_not_dropped(tmp_path: Path) -> None:
    report = convert(FIXTURES / "special/nested_generic.pth", tmp_path / "out.safetensors")
    left_out = [n for n in report.notes if n.startswith("not converted")]
    assert left_out == ["not converted (not weights): numbers (6 other values), blob (1 other value), tags (1 other value)"]  # fmt: skip
    assert json.loads(metadata(report.outputs[0])["ckpttool.field.name"]) == "nested"
    assert report.fields["ckpttool.field.flags.0"] == "true"


def test_pth_output_notes_the_fields_it_cannot_hold(tmp_path: Path) -> None:
    report = convert(RESUME, tmp_path / "out.pth")
    assert report.fields == {}
    assert "a .pth state dict holds tensors only; not written: epoch, step, world_size, wandb_id, scaler (5 values)" in report.notes  # fmt: skip


def test_safetensors_metadata_is_carried_and_aliases_rerecorded(tmp_path: Path) -> None:
    source = FIXTURES / "safetensors/model.safetensors"  # save_model: one entry per alias
    report = convert(source, tmp_path / "again.safetensors", dtype="bf16")
    meta = metadata(report.outputs[0])
    assert meta["source"] == "ckpttool test fixtures"  # the source's own entry, kept
    assert json.loads(meta[ALIASES]) == TIED
    assert "model.embed_tokens.weight" not in meta  # re-recorded under ckpttool.aliases


# --- where the output goes ---------------------------------------------------------------------


def test_default_destination_and_format_from_suffix(tmp_path: Path) -> None:
    source = tmp_path / "weights.pth"
    shutil.copyfile(MINIMIND, source)
    assert convert(source).outputs == [tmp_path / "weights.safetensors"]
    back = convert(tmp_path / "weights.safetensors", to="pth", force=True)
    assert back.outputs == [tmp_path / "weights.pth"]
    assert set(torch.load(source, weights_only=True)) == set(expected_tensors(MINIMIND))


def test_destination_rules(tmp_path: Path) -> None:
    source = tmp_path / "weights.safetensors"
    shutil.copyfile(FIXTURES / "safetensors/model.safetensors", source)
    # The default name is never the source: safetensors to safetensors (a cast, a filter)
    # and .pth to .pth (a prefix removed) get ".converted" before the suffix.
    assert convert(source).outputs == [tmp_path / "weights.converted.safetensors"]
    assert convert(source, tmp_path, force=True).outputs == [
        tmp_path / "weights.converted.safetensors"
    ]
    with pytest.raises(InputError, match="would overwrite the source"):
        convert(source, tmp_path / "." / "weights.safetensors")
    with pytest.raises(InputError, match="cannot tell the output format"):
        convert(source, tmp_path / "out.weights")
    with pytest.raises(InputError, match="rename DST"):
        convert(source, tmp_path / "out.safetensors", to="pth")
    assert convert(source, tmp_path / "out.weights", to="pth").format == "pth"
    for suffix in (".pth", ".pt", ".bin"):
        assert convert(source, tmp_path / f"out{suffix}").format == "pth"
    (tmp_path / "dir").mkdir()
    assert convert(source, tmp_path / "dir").outputs == [tmp_path / "dir/weights.safetensors"]
    with pytest.raises(InputError, match="no such directory"):
        convert(source, tmp_path / "missing/out.safetensors")


def test_existing_output_is_refused_without_force(tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"precious")
    with pytest.raises(
        OutputExistsError, match=r"out.safetensors exists; pass --force to overwrite it"
    ):
        convert(MINIMIND, out)
    assert out.read_bytes() == b"precious"
    convert(MINIMIND, out, force=True)
    assert len(st.load_file(out)) == len(expected_tensors(MINIMIND))


def test_source_is_never_modified(tmp_path: Path) -> None:
    source = tmp_path / "src.pth"
    shutil.copyfile(RESUME, source)
    before = (source.read_bytes(), source.stat().st_mtime_ns)
    convert(source, dtype="bf16")
    convert(source, tmp_path / "out.pth")
    assert (source.read_bytes(), source.stat().st_mtime_ns) == before


def test_bad_input_raises_the_readers_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file"):
        convert(tmp_path / "missing.pth")
    with pytest.raises(NotACheckpointError, match="TorchScript"):
        convert(FIXTURES / "special/torchscript.pt", tmp_path / "x.safetensors")
    empty = tmp_path / "numbers.pth"
    torch.save({"epoch": 1, "step": 2}, empty)
    with pytest.raises(InputError, match="no tensors to convert"):
        convert(empty)


# --- sharding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["10", "1KB", "2.5kB", "3MiB", "2GB", 4096])
def test_parse_size(size: str | int) -> None:
    assert parse_size(size) == {"10": 10, "1KB": 1000, "2.5kB": 2500, "3MiB": 3 << 20,
                                "2GB": 2 * 10**9, 4096: 4096}[size]  # fmt: skip


@pytest.mark.parametrize("size", ["", "GB", "-1", "0", "1XB", "1.5.5"])
def test_parse_size_refuses_nonsense(size: str) -> None:
    with pytest.raises(InputError):
        parse_size(size)


def test_sharded_output_follows_the_hugging_face_layout(tmp_path: Path) -> None:
    source = TIED_RESUME
    report = convert(source, tmp_path / "shards", max_shard_size="40KB")
    *shards, index_path = report.outputs
    assert index_path == tmp_path / "shards/model.safetensors.index.json"
    count = len(shards)
    assert count > 2
    assert [s.name for s in shards] == [
        f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)
    ]
    index = json.loads(index_path.read_text())
    assert set(index) == {"metadata", "weight_map"}
    expected = expected_tensors(source)
    combined: dict[str, torch.Tensor] = {}
    for shard in shards:
        loaded = st.load_file(shard)
        assert (
            sum(t.numel() * t.element_size() for t in loaded.values()) <= 40_000 or len(loaded) == 1
        )
        assert all(index["weight_map"][name] == shard.name for name in loaded)
        combined.update(loaded)
        shard_aliases = json.loads(metadata(shard).get(ALIASES, "{}"))
        assert all(stored in loaded for stored in shard_aliases.values())
    assert set(index["weight_map"]) == set(combined) == set(expected) - set(report.aliases)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in combined.values()
    )
    assert index["metadata"]["total_size"] == report.tensor_bytes
    for name, tensor in combined.items():
        assert_bits_equal(tensor, expected[name], name)


def test_shard_names_follow_dst(tmp_path: Path) -> None:
    report = convert(MINIMIND, tmp_path / "mm.safetensors", max_shard_size=30_000)
    assert [p.name for p in report.outputs] == [
        "mm-00001-of-00002.safetensors", "mm-00002-of-00002.safetensors", "mm.safetensors.index.json",
    ]  # fmt: skip
    again = convert(
        MINIMIND, tmp_path / "mm.safetensors.index.json", max_shard_size="1GB", force=True
    )
    assert [p.name for p in again.outputs] == [
        "mm-00001-of-00001.safetensors",
        "mm.safetensors.index.json",
    ]
    with pytest.raises(InputError, match="cannot be used with --to pth"):
        convert(MINIMIND, tmp_path / "x", to="pth", max_shard_size="1GB")


# --- atomicity and verification ----------------------------------------------------------------


def temps_left(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.name.endswith(".ckpttool-tmp"))


class FailingReads:
    """Wraps ``tensor_bytes``: raises on call ``fail_at``, or corrupts the bytes it returns."""

    def __init__(self, real: Any, fail_at: int, corrupt: bool = False) -> None:
        self.real, self.fail_at, self.corrupt, self.calls = real, fail_at, corrupt, 0

    def __call__(self, ckpt: Any, planned: Any) -> Any:
        self.calls += 1
        data, counts = self.real(ckpt, planned)
        if self.calls == self.fail_at:
            if not self.corrupt:
                raise OSError(28, "No space left on device (injected)")
            data = bytearray(data)
            data[0] ^= 0x01
        return data, counts


@pytest.mark.parametrize("to", ["safetensors", "pth", "sharded"])
def test_failure_mid_write_leaves_nothing_behind(
    to: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckpttool.commands.convert.run as module

    monkeypatch.setattr(module, "tensor_bytes", FailingReads(module.tensor_bytes, fail_at=12))
    target = tmp_path / ("out.pth" if to == "pth" else "out.safetensors")
    options: dict[str, Any] = {"max_shard_size": "20KB"} if to == "sharded" else {}
    with pytest.raises(InputError, match=r"nothing was written: .* No space left on device"):
        convert(MINIMIND, target, **options)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_failure_with_force_leaves_the_existing_output_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckpttool.commands.convert.run as module

    target = tmp_path / "out.safetensors"
    convert(CKPTTOOL, target)
    before = target.read_bytes()
    monkeypatch.setattr(module, "tensor_bytes", FailingReads(module.tensor_bytes, fail_at=5))
    with pytest.raises(InputError, match=r"nothing was written: .* No space left on device"):
        convert(MINIMIND, target, force=True)
    assert target.read_bytes() == before
    assert temps_left(tmp_path) == []


@pytest.mark.parametrize("to", ["safetensors", "pth", "sharded"])
def test_verification_catches_a_flipped_bit_and_removes_the_output(
    to: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckpttool.commands.convert.run as module

    target = tmp_path / ("out.pth" if to == "pth" else "out.safetensors")
    target.write_bytes(b"old")
    options: dict[str, Any] = {"max_shard_size": "20KB"} if to == "sharded" else {}
    reads = FailingReads(module.tensor_bytes, fail_at=3, corrupt=True)
    monkeypatch.setattr(module, "tensor_bytes", reads)
    with pytest.raises(VerificationError, match="does not read back bit-for-bit equal") as caught:
        convert(MINIMIND, target, force=True, **options)
    assert caught.value.exit_code == EXIT_FOUND
    assert "it was removed" in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "out.pth" if to == "pth" else "out.safetensors"
    ]
    assert target.read_bytes() == b"old"


def _large_records(tmp_path: Path) -> Path:
    """A torch.save file whose tensors are each a whole record larger than a read block."""
    source = tmp_path / "large.pth"
    generator = torch.Generator().manual_seed(3)
    torch.save({f"w{i}": torch.randn(400_000, generator=generator) for i in range(3)}, source)
    return source


def test_a_whole_zip_record_is_checked_by_its_crc_not_by_reading_the_source_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each tensor copied whole from a torch zip record is read back once and checked against
    the CRC-32 torch.save wrote for it: the source is not compared range against range."""
    import ckpttool.commands.convert.run as module

    def unexpected(*args: Any) -> bool:
        raise AssertionError("the source was read again")

    source = _large_records(tmp_path)
    monkeypatch.setattr(module, "equal_ranges", unexpected)
    report = convert(source, tmp_path / "out.safetensors")
    assert report.verified and report.tensors == 3
    written = st.load_file(str(tmp_path / "out.safetensors"))
    assert all(torch.equal(written[k], v) for k, v in torch.load(source).items())


def test_no_verify_skips_the_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckpttool.commands.convert.run as module

    reads = FailingReads(module.tensor_bytes, fail_at=3, corrupt=True)
    monkeypatch.setattr(module, "tensor_bytes", reads)
    report = convert(MINIMIND, tmp_path / "out.safetensors", verify=False)
    assert report.verified is False
    assert reads.calls == report.tensors  # each tensor read once: nothing compared


def test_progress_counts_writing_and_verifying(tmp_path: Path) -> None:
    totals: list[int] = []
    steps: list[int] = []
    report = convert(
        RESUME, tmp_path / "out.safetensors", progress=steps.append, on_total=totals.append
    )
    assert totals == [2 * report.tensor_bytes] == [sum(steps)]


# --- no torch, and the pickle writer -----------------------------------------------------------


def test_conversion_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from ckpttool.commands.convert.run import convert;"
        f"convert({str(RESUME)!r}, {str(tmp_path / 'a.safetensors')!r}, dtype='bf16');"
        f"convert({str(tmp_path / 'a.safetensors')!r}, {str(tmp_path / 'b.pth')!r});"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_dtypes_without_a_typed_storage_round_trip_through_pth(tmp_path: Path) -> None:
    source = tmp_path / "exotic.pth"
    tensors = {
        "u16": torch.arange(6, dtype=torch.int32).to(torch.uint16).reshape(2, 3),
        "f8": torch.tensor([0.5, -1.0, 448.0]).to(torch.float8_e4m3fn),
        "c64": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
        "bool": torch.tensor([True, False]),
    }
    torch.save(tensors, source)
    report = convert(source, tmp_path / "out.pth", dtype="fp16")
    assert report.notes == ["float8_e4m3fn tensors are kept as they are (not cast)"]
    for mmap in (False, True):
        loaded = torch.load(report.outputs[0], weights_only=True, mmap=mmap)
        for name, tensor in tensors.items():
            assert_bits_equal(loaded[name], tensor, name)


@pytest.mark.parametrize("value", [0, 1, 255, 256, 65535, 65536, -1, 2**31 - 1, -(2**31),
                                   2**31, 2**40, -(2**63), 2**64, (), (1,), (1, 2, 3, 4), "ü",
                                   True, False])  # fmt: skip
def test_pickle_encoder_matches_pickle(value: Any) -> None:
    encoded = bytearray(b"\x80\x02")
    _encode(value, encoded)
    assert pickle.loads(bytes(encoded) + b".") == value


def test_pth_output_says_little_endian(tmp_path: Path) -> None:
    # Every output is little-endian: safetensors is by definition, and .pth says so.
    report = convert(CKPTTOOL, tmp_path / "out.pth")
    with open_checkpoint(report.outputs[0]) as ckpt:
        assert ckpt.details["byteorder"] == "little"
    assert os.path.getsize(report.outputs[0]) == report.file_bytes


def big_endian_copy(source: Path, target: Path) -> None:
    """``source`` rewritten as a big-endian machine's torch.save would write it."""
    import zipfile

    from ckpttool.formats.torch_zip.zip_writer import TorchZipWriter

    with open_checkpoint(source) as ckpt:
        itemsize = {s.record: r.itemsize for r in ckpt.tensors() if (s := r.storage)}
    archive = zipfile.ZipFile(source)
    with open(target, "wb") as handle, TorchZipWriter(handle) as writer:
        for info in archive.infolist():
            data = archive.read(info.filename)
            if info.filename.endswith("/byteorder"):
                data = b"big"
            elif info.filename in itemsize and itemsize[info.filename] > 1:
                width = f">u{itemsize[info.filename]}"
                data = np.frombuffer(data, width.replace(">", "<")).astype(width).tobytes()
            writer.write(info.filename, data)


@pytest.mark.parametrize("dtype", ["keep", "fp32"])
def test_big_endian_source_is_written_little_endian(dtype: str, tmp_path: Path) -> None:
    source = tmp_path / "big_endian.pth"
    big_endian_copy(CKPTTOOL, source)
    expected = expected_tensors(CKPTTOOL)
    for name, tensor in torch.load(source, weights_only=True).items():  # the copy is faithful
        assert_bits_equal(tensor, expected[name], name)
    report = convert(source, tmp_path / "out.safetensors", dtype=dtype)
    for name, tensor in st.load_file(report.outputs[0]).items():
        want = expected[name].float() if dtype == "fp32" else expected[name]
        assert_bits_equal(tensor, want, name)
