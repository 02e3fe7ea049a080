"""`ckpttool convert` through the CLI: output contract, JSON, options, errors, exit codes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch
from click.testing import CliRunner, Result
from safetensors import safe_open

from ckpttool import __version__
from ckpttool.cli import cli
from tests.fixtures.generate import FIXTURE_FILES
from tests.support.helpers import FIXTURES

RESUME = FIXTURES / "minimind/pretrain_32_resume.pth"
WEIGHTS = FIXTURES / "minimind/pretrain_32.pth"
TIED_RESUME = FIXTURES / "ckpttool/pretrain_32_resume.pth"
SHOW_FIXTURES = [FIXTURES / name for name in FIXTURE_FILES if name != "special/torchscript.pt"]
# Files without a model section whose non-tensor entries diff compares in full: safetensors
# has no place for some of them (bytes, complex numbers, RNG state), so diff reports fields.
FIELDS_DIFFER = {
    "special/builtin_types.pth",
    "special/omegaconf_config.pth",
    "special/parent_links.pth",
    "special/cuda_storages.pth",
    "special/namespace_config.pth",
    "special/nested_generic.pth",
    "special/numpy_rng.pth",
}


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def stored_names(path: Path) -> list[str]:
    with safe_open(str(path), "pt") as handle:
        return sorted(handle.keys())


def file_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as handle:
        return handle.metadata() or {}


def test_help_has_examples() -> None:
    result = run("convert", "--help")
    assert result.exit_code == 0
    assert "Examples:" in result.output
    assert "--max-shard-size SIZE" in result.output


@pytest.mark.parametrize("name", [str(p.relative_to(FIXTURES)) for p in SHOW_FIXTURES])
def test_every_show_fixture_converts_and_diffs_equal(name: str, tmp_path: Path) -> None:
    source = FIXTURES / name
    for suffix in (".safetensors", ".pth"):
        out = tmp_path / f"out{suffix}"
        result = run("convert", source, out)
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(f"wrote {out} (")
        diff = run("diff", source, out, "--json")
        report = json.loads(diff.stdout)
        summary = report["summary"]
        tensors = max(report["a"]["num_tensors"], report["b"]["num_tensors"])  # aliases resolved
        assert summary["identical"] == tensors > 0, diff.stdout
        assert summary["differ"] == summary["only_a"] == summary["only_b"] == 0
        if name not in FIELDS_DIFFER:
            assert report["fields"] == [], diff.stdout
        assert diff.exit_code == (1 if report["fields"] else 0), diff.stdout


def test_output_is_exact_for_a_minimind_resume(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    result = run("convert", RESUME, out, "--dtype", "fp32")
    assert result.exit_code == 0
    size = out.stat().st_size
    assert result.stdout.splitlines() == [
        f"wrote {out} (safetensors, 21 tensors, {size / 1024:.1f} KB)",
        f"  from      {RESUME} (MiniMind-style resume checkpoint, section 'model')",
        "  cast      float16 -> float32 (21)",
        "  fields    epoch, step, world_size, wandb_id (+5 more); kept in __metadata__",
        "  verified  every tensor read back bit for bit, sizes as expected",
    ]
    assert result.stderr == "note: not converted (not weights): optimizer (60 tensors, 32 other values)\n"  # fmt: skip


def test_tied_weights_line(tmp_path: Path) -> None:
    result = run("convert", TIED_RESUME, tmp_path / "m.safetensors")
    assert "  aliases   model.embed_tokens.weight -> lm_head.weight; stored once" in result.stdout


def test_json_is_clean_and_notes_go_to_stderr(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    result = run("convert", RESUME, out, "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data == {
        "source": str(RESUME),
        "outputs": [str(out)],
        "format": "safetensors",
        "layout": "minimind_resume",
        "section": "model",
        "tensors": 21,
        "aliases": {},
        "tensor_bytes": data["tensor_bytes"],
        "file_bytes": out.stat().st_size,
        "dtype": "keep",
        "cast": {},
        "underflow": {},
        "overflow": {},
        "fields": data["fields"],
        "notes": ["not converted (not weights): optimizer (60 tensors, 32 other values)"],
        "warnings": [],
        "verified": True,
        "directory": None,  # a file, not a Hugging Face model directory
        "copied": [],
    }
    assert data["tensor_bytes"] == sum(t.numel() * t.element_size() for t in st.load_file(out).values())  # fmt: skip
    assert json.loads(data["fields"]["ckpttool.field.step"]) == 1200
    assert result.stderr.startswith("note: not converted")


def test_default_dst_and_to_pth(tmp_path: Path) -> None:
    source = tmp_path / "w.pth"
    source.write_bytes(WEIGHTS.read_bytes())
    assert run("convert", source).exit_code == 0
    assert (tmp_path / "w.safetensors").is_file()
    result = run("convert", tmp_path / "w.safetensors", tmp_path / "back", "--to", "pth")
    assert result.exit_code == 0, result.output
    loaded = torch.load(tmp_path / "back", weights_only=True)
    assert set(loaded) == set(torch.load(WEIGHTS, weights_only=True))


def test_default_dst_is_never_the_source(tmp_path: Path) -> None:
    source = tmp_path / "c_ddp.pth"
    source.write_bytes((FIXTURES / "wrapped/ddp.pth").read_bytes())
    before = source.read_bytes()
    result = run("convert", source, "--strip-prefix", "module.", "--to", "pth")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"wrote {tmp_path / 'c_ddp.converted.pth'} (pth, ")
    assert source.read_bytes() == before
    loaded = torch.load(tmp_path / "c_ddp.converted.pth", weights_only=True)
    assert not any(key.startswith("module.") for key in loaded)
    assert run("convert", source, "--to", "pth").exit_code == 2  # exists: --force to replace


def test_strip_prefix_help_describes_convert() -> None:
    help_text = " ".join(run("convert", "--help").stdout.split())
    assert (
        "--strip-prefix PREFIX Remove PREFIX from the start of every tensor name that has it "
        "(repeatable)." in help_text
    )
    assert "diff" not in help_text


def test_options_reach_the_library(tmp_path: Path) -> None:
    out = tmp_path / "o.safetensors"
    ddp = FIXTURES / "wrapped/ddp_compiled.pth"
    assert run("convert", ddp, out, "--ignore-wrappers").exit_code == 0
    assert not any(n.startswith(("module.", "_orig_mod.")) for n in stored_names(out))
    assert run("convert", ddp, out, "--force", "--strip-prefix", "module.").exit_code == 0
    assert all(n.startswith("_orig_mod.") for n in stored_names(out))
    assert run("convert", WEIGHTS, out, "--force", "--filter", "model.norm.*").exit_code == 0
    assert stored_names(out) == ["model.norm.weight"]
    assert run("convert", WEIGHTS, out, "--force", "--dtype", "bf16").exit_code == 0
    assert {t.dtype for t in st.load_file(out).values()} == {torch.bfloat16}
    assert run("convert", TIED_RESUME, out, "--force", "--keep-shared").exit_code == 0
    assert "model.embed_tokens.weight" in stored_names(out)
    assert "ckpttool.aliases" not in file_metadata(out)
    assert run("convert", RESUME, out, "--force", "--section", "optimizer").exit_code == 0
    assert "state.0.exp_avg" in stored_names(out)
    result = run("convert", WEIGHTS, out, "--force", "--no-verify")
    assert result.stdout.splitlines()[-1] == "  verified  no (--no-verify)"
    assert file_metadata(out)["ckpttool.version"] == __version__


def test_sharding(tmp_path: Path) -> None:
    result = run("convert", WEIGHTS, tmp_path / "shards", "--max-shard-size", "20KB", "--json")
    assert result.exit_code == 0, result.output
    outputs = [Path(p) for p in json.loads(result.stdout)["outputs"]]
    assert outputs[-1] == tmp_path / "shards/model.safetensors.index.json"
    index = json.loads(outputs[-1].read_text())
    assert sorted(index["weight_map"]) == sorted(torch.load(WEIGHTS, weights_only=True))
    assert {p.name for p in outputs[:-1]} == set(index["weight_map"].values())


def test_existing_output_is_refused_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"keep me")
    result = run("convert", WEIGHTS, out)
    assert result.exit_code == 2
    assert result.stderr == f"Error: {out} exists; pass --force to overwrite it\n"
    assert out.read_bytes() == b"keep me"


def test_overflow_refusal_exits_2(tmp_path: Path) -> None:
    source = tmp_path / "big.pth"
    torch.save({"w": torch.tensor([1.0, 1e5])}, source)
    result = run("convert", source, "--dtype", "fp16")
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: w: 1 value(s) would overflow to inf in float16")
    assert not (tmp_path / "big.safetensors").exists()
    assert run("convert", source, "--dtype", "fp16", "--allow-overflow").exit_code == 0
    assert st.load_file(tmp_path / "big.safetensors")["w"][1].item() == float("inf")


def test_verification_failure_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckpttool.commands.convert.run as module

    real = module.tensor_bytes
    calls = []

    def corrupting(ckpt: Any, planned: Any) -> Any:
        calls.append(planned.name)
        data, counts = real(ckpt, planned)
        if len(calls) == 1:
            data = bytes(data)[:-1] + bytes([data[-1] ^ 0x80])
        return data, counts

    monkeypatch.setattr(module, "tensor_bytes", corrupting)
    out = tmp_path / "o.safetensors"
    result = run("convert", WEIGHTS, out)
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: the output did not read back identical to the source")
    assert len(result.stderr.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("args", "message"), [
    (["missing.pth"], "Error: missing.pth: no such file\n"),
    ([FIXTURES / "special/torchscript.pt", "x.safetensors"],
     f"Error: {FIXTURES / 'special/torchscript.pt'}: this is a TorchScript archive"),
    ([WEIGHTS, WEIGHTS], "would overwrite the source; name another DST\n"),
    ([WEIGHTS, "x.safetensors", "--max-shard-size", "lots"], "Error: cannot read 'lots' as a size"),
    ([WEIGHTS, "x.weights"], "cannot tell the output format from its suffix"),
    ([WEIGHTS, "x.safetensors", "--section", "nope"], "no section 'nope' in this checkpoint\n"),
])  # fmt: skip
def test_bad_input_is_one_line_exit_2(
    args: list[Any], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = run("convert", *args)
    assert result.exit_code == 2, result.output
    assert len(result.stderr.splitlines()) == 1
    assert message in result.stderr
    assert "Traceback" not in result.output
    assert not list(tmp_path.iterdir())


def test_a_failing_write_is_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckpttool.commands.convert.run as module

    def full_disk(ckpt: Any, planned: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, "tensor_bytes", full_disk)
    result = run("convert", WEIGHTS, tmp_path / "o.safetensors")
    assert result.exit_code == 2
    assert result.stderr == (
        "Error: conversion failed, nothing was written: [Errno 28] No space left on device\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_names_written_with_a_wrapper_prefix_get_a_warning(tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    result = run("convert", FIXTURES / "wrapped/compiled.pth", out, "--json")
    assert result.exit_code == 0
    warning = (
        "12 of the 12 tensor names start with the DDP/torch.compile wrapper prefix "
        "'_orig_mod.' and are written with it; add --ignore-wrappers to remove it"
    )
    assert json.loads(result.stdout)["warnings"] == [warning]
    assert f"warning: {warning}\n" in result.stderr
    result = run("convert", FIXTURES / "wrapped/compiled.pth", out, "--force", "--ignore-wrappers")
    assert "warning" not in result.stderr


def test_a_filter_matching_nothing_is_an_error_naming_the_file(tmp_path: Path) -> None:
    result = run("convert", WEIGHTS, tmp_path / "out.safetensors", "--filter", "nothing*")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {WEIGHTS}: --filter 'nothing*' matches no tensor")
