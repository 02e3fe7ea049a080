"""``convert`` of Hugging Face model directories and Trainer checkpoints into a model directory.

The output must be what ``save_pretrained`` writes (file names, index format, config copied byte
for byte), read back by ckpttool as one checkpoint (``show``, ``diff``, ``verify``), and loaded
by transformers' own ``from_pretrained`` equal to the source, with tied weights tied.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner

from ckpttool.cli import cli
from ckpttool.commands.convert import model_dir as convert_model_dir
from ckpttool.commands.convert.run import convert
from ckpttool.errors import InputError, OutputExistsError

FRAMEWORKS = Path(__file__).resolve().parent / "fixtures" / "frameworks"
TRAINER_CHECKPOINT = "trainer_1proc/output/checkpoint-8"
SOURCES = ["hf_bin_sharded", "hf_sharded", "hf_model", TRAINER_CHECKPOINT]
SHARDS = [None, "10000"]  # one model.safetensors; 3 shards + index (20.8 kB of weights)
SCHEMA = "docs/schemas/convert.schema.json"
SHARD_NAME = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


def _convert(tmp_path: Path, source: str, shard_size: str | None) -> tuple[Path, Any]:
    out = tmp_path / "out"
    report = convert(FRAMEWORKS / source, out, max_shard_size=shard_size)
    return out, report


def _cli(*args: str | Path) -> Any:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result


@pytest.mark.parametrize("shard_size", SHARDS, ids=["single", "sharded"])
@pytest.mark.parametrize("source", SOURCES)
def test_writes_a_model_directory_as_save_pretrained(
    tmp_path: Path, source: str, shard_size: str | None
) -> None:
    out, report = _convert(tmp_path, source, shard_size)
    assert report.directory == out and report.verified
    assert report.copied == ["config.json", "generation_config.json"]
    for name in report.copied:
        assert (out / name).read_bytes() == (FRAMEWORKS / source / name).read_bytes()
    names = sorted(p.name for p in out.iterdir())
    if shard_size is None:
        assert names == ["config.json", "generation_config.json", "model.safetensors"]
        assert report.outputs == [out / "model.safetensors"]
        return
    shards = [n for n in names if SHARD_NAME.match(n)]
    assert len(shards) == 3 and names == sorted(
        ["config.json", "generation_config.json", "model.safetensors.index.json", *shards]
    )
    assert report.outputs[-1] == out / "model.safetensors.index.json"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    reference = json.loads((FRAMEWORKS / "hf_sharded" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == reference["metadata"]  # total_parameters, total_size
    assert sorted(index["weight_map"]) == sorted(reference["weight_map"])
    assert set(index["weight_map"].values()) == set(shards)
    text = (out / "model.safetensors.index.json").read_text()
    assert text == json.dumps(index, indent=2, sort_keys=True) + "\n"  # transformers' layout


def test_tied_embedding_is_stored_under_the_name_transformers_keeps(tmp_path: Path) -> None:
    out, report = _convert(tmp_path, "hf_bin_sharded", None)
    assert report.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    from ckpttool.checkpoint import open_checkpoint

    with open_checkpoint(out / "model.safetensors") as ckpt:
        keys = {record.key for record in ckpt.tensors()}
        assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
        assert ckpt.metadata["format"] == "pt"
        assert json.loads(ckpt.metadata["ckpttool.aliases"]) == report.aliases
        assert not any(key.startswith("ckpttool.field.") for key in ckpt.metadata)


@pytest.mark.parametrize("shard_size", SHARDS, ids=["single", "sharded"])
@pytest.mark.parametrize("source", SOURCES)
def test_ckpttool_reads_the_output_back_identical(
    tmp_path: Path, source: str, shard_size: str | None
) -> None:
    out, _ = _convert(tmp_path, source, shard_size)
    section = ["--section", "model"] if source == TRAINER_CHECKPOINT else []
    result = _cli("diff", FRAMEWORKS / source, out, *section, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)["summary"]
    assert summary["differ"] == summary["only_a"] == summary["only_b"] == 0
    assert summary["identical"] >= 20
    shown = _cli("show", out, "--json")
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["layout"] == "hf_model"
    verified = _cli("verify", out)
    assert verified.exit_code == 0, verified.output
    if shard_size is not None:  # the index file as a path, too
        verified = _cli("verify", out / "model.safetensors.index.json")
        assert verified.exit_code == 0, verified.output


@pytest.mark.parametrize("dst", ["out/", "out"])
def test_directory_rule_for_a_framework_source(tmp_path: Path, dst: str) -> None:
    result = _cli("convert", FRAMEWORKS / "hf_model", f"{tmp_path}/{dst}", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    schema = json.loads((Path(__file__).resolve().parents[1] / SCHEMA).read_text())
    jsonschema.validate(report, schema)
    assert report["directory"] == str(tmp_path / "out")
    assert report["copied"] == ["config.json", "generation_config.json"]
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_text_output_names_the_directory_and_the_copied_files(tmp_path: Path) -> None:
    source = FRAMEWORKS / "hf_bin_sharded" / "pytorch_model.bin.index.json"  # the index as SRC
    result = _cli("convert", source, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        f"wrote model directory {tmp_path / 'out'} (safetensors, 20 tensors, 22.4 KB)",
        f"  from      {source} (Hugging Face model directory, section 'model')",
        "  files     model.safetensors; copied: config.json, generation_config.json",
        "  aliases   lm_head.weight -> model.embed_tokens.weight; stored once",
        "  verified  every tensor read back bit for bit, sizes as expected",
    ]


def test_a_trainer_checkpoint_says_what_a_model_directory_leaves_out(tmp_path: Path) -> None:
    result = _cli("convert", FRAMEWORKS / TRAINER_CHECKPOINT, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "not written: scheduler, trainer_state" in result.stderr
    assert "optimizer (60 tensors" in result.stderr
    assert not (tmp_path / "out" / "optimizer.pt").exists()


def test_a_file_dst_still_gets_a_file(tmp_path: Path) -> None:
    report = convert(FRAMEWORKS / "hf_model", tmp_path / "weights.safetensors")
    assert report.directory is None and report.copied == []
    assert report.outputs == [tmp_path / "weights.safetensors"]


def test_existing_directory_needs_force_and_only_a_model_directory_is_replaced(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    convert(FRAMEWORKS / "hf_model", out)
    with pytest.raises(OutputExistsError, match="--force"):
        convert(FRAMEWORKS / "hf_sharded", out)
    convert(FRAMEWORKS / "hf_sharded", out, force=True, max_shard_size="10000")
    assert not (out / "model.safetensors").exists()  # the old directory is gone, not merged
    assert (out / "model.safetensors.index.json").is_file()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match=r"notes\.txt"):
        convert(FRAMEWORKS / "hf_model", out, force=True)
    assert (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp directory left


def test_a_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(src_dir: Path, staging: Path) -> list[str]:
        raise OSError("disk full")

    monkeypatch.setattr(convert_model_dir, "copy_files", fail)
    with pytest.raises(OSError, match="disk full"):
        convert(FRAMEWORKS / "hf_model", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_pth_is_refused_for_a_model_directory(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="safetensors"):
        convert(FRAMEWORKS / "hf_model", tmp_path / "out", to="pth")


# --- transformers' own loader --------------------------------------------------------------


def _load(directory: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model


@pytest.mark.parametrize("shard_size", SHARDS, ids=["single", "sharded"])
@pytest.mark.parametrize("source", ["hf_bin_sharded", "hf_sharded", TRAINER_CHECKPOINT])
def test_from_pretrained_loads_the_output_equal_and_tied(
    tmp_path: Path, source: str, shard_size: str | None
) -> None:
    torch = pytest.importorskip("torch")
    out, _ = _convert(tmp_path, source, shard_size)
    original = _load(FRAMEWORKS / source).state_dict()
    model = _load(out)
    converted = model.state_dict()
    assert sorted(converted) == sorted(original)
    for key, value in original.items():
        assert converted[key].dtype == value.dtype and torch.equal(converted[key], value), key
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_dtype_is_written_into_the_config_so_from_pretrained_loads_it(
    tmp_path: Path, dtype: str
) -> None:
    """Issue 49 item 8: ``convert MODEL_DIR OUT/ --dtype bf16`` kept ``config.json``'s
    ``dtype: float32``, so ``from_pretrained`` loaded the weights back as float32. The config
    now says the dtype, as ``edit --dtype`` of the directory writes it (the one helper), and
    every other entry is the source's."""
    torch = pytest.importorskip("torch")
    target = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    out = tmp_path / "out"
    convert(FRAMEWORKS / "hf_model", out, dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    source = json.loads((FRAMEWORKS / "hf_model" / "config.json").read_text())
    assert source["dtype"] == "float32" and config["dtype"] == str(target).removeprefix("torch.")
    assert {k: v for k, v in config.items() if k != "dtype"} == {
        k: v for k, v in source.items() if k != "dtype"
    }
    model = _load(out)
    assert {p.dtype for p in model.parameters()} == {target}
    original = _load(FRAMEWORKS / "hf_model").state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, original[key].to(target)), key
    edited = tmp_path / "edited"
    from ckpttool.commands.edit_directory import edit

    edit(FRAMEWORKS / "hf_model", edited, dtype=dtype)
    assert json.loads((edited / "config.json").read_text()) == config
    kept = tmp_path / "kept"
    convert(FRAMEWORKS / "hf_model", kept, dtype="fp32")  # already float32: nothing cast
    assert (kept / "config.json").read_bytes() == (
        FRAMEWORKS / "hf_model" / "config.json"
    ).read_bytes()
