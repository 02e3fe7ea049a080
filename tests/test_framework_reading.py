"""ckpttool reads what the frameworks wrote as the frameworks' own loaders see it.

tests/fixtures/frameworks/manifest.json froze, per file, what torch/safetensors read (keys,
dtypes, shapes, value digests, globals) and, per case, what the framework's loader builds
(``from_pretrained``'s state dict, ``load_state``'s model...). Here ckpttool's safe reader must
give the same: file by file, and each directory opened as one checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from ckpttool.checkpoint import open_checkpoint
from ckpttool.cli import cli
from ckpttool.errors import CheckpointCollectionError, CorruptCheckpointError, InputError
from ckpttool.io.values import read_array
from ckpttool.model.records import get_path

FRAMEWORKS = Path(__file__).resolve().parent / "fixtures" / "frameworks"
MANIFEST: dict[str, Any] = json.loads((FRAMEWORKS / "manifest.json").read_text())
FILES = {
    name: entry
    for case in MANIFEST["cases"].values()
    for name, entry in case["files"].items()
    if "tensors" in entry
}


def digest(ckpt: Any, record: Any) -> str:
    array = read_array(ckpt, record)
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def described(ckpt: Any, records: list[Any]) -> dict[str, dict[str, Any]]:
    return {r.key: describe(ckpt, r) for r in records}


def describe(ckpt: Any, record: Any) -> dict[str, Any]:
    """As the manifest describes a tensor; a DTensor by its global dtype and shape, its
    placements and this rank's piece (ckpttool does not read the mesh it was saved on)."""
    if record.dtensor is None:
        return {"dtype": record.dtype, "shape": list(record.shape), "sha256": digest(ckpt, record)}
    local = record.dtensor.local
    return {
        "dtype": record.dtype,
        "shape": list(record.shape),
        "dtensor": {
            "placements": list(record.dtensor.placements),
            "local": {
                "dtype": local.dtype,
                "shape": list(local.shape),
                "sha256": digest(ckpt, local),
            },
        },
    }


def _value(root: Any, key: str) -> Any:
    """The value at a dotted key; keys that hold dots themselves (Lightning's
    ``epoch_loop.state_dict``) are found among the flattened leaves."""
    from ckpttool.model.records import walk

    try:
        return get_path(root, key)
    except KeyError:
        return dict(walk(root))[key]


def as_json(value: Any) -> Any:
    """A value as the manifest (JSON) holds it: tuples are lists."""
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    return value


def without_values(tensors: dict[str, Any]) -> dict[str, Any]:
    return {k: _fields(v) for k, v in tensors.items()}


def _fields(entry: dict[str, Any]) -> dict[str, Any]:
    """What :func:`describe` gives for a manifest tensor (a DTensor without its mesh)."""
    if "dtensor" not in entry:
        return {f: entry[f] for f in ("dtype", "shape", "sha256")}
    piece = entry["dtensor"]
    return {
        "dtype": entry["dtype"],
        "shape": entry["shape"],
        "dtensor": {"placements": piece["placements"], "local": _fields(piece["local"])},
    }


@pytest.mark.parametrize("name", sorted(FILES))
def test_every_file_reads_as_torch_reads_it(name: str) -> None:
    expected = FILES[name]
    with open_checkpoint(FRAMEWORKS / name) as ckpt:
        assert described(ckpt, ckpt.tensors()) == without_values(expected["tensors"])
        for key, value in expected.get("values", {}).items():
            if isinstance(value, dict) and set(value) == {"length", "sha256"}:
                continue  # a long list (Python's RNG state): digested, not stored
            assert as_json(_value(ckpt.root, key)) == value, key


@pytest.mark.parametrize(
    "name", sorted(n for n, e in FILES.items() if e.get("globals") is not None)
)
def test_scan_names_the_globals_torch_would_import(name: str) -> None:
    from ckpttool.commands.scan import scan

    expected = set(FILES[name]["globals"])
    (result,) = scan([FRAMEWORKS / name]).files
    assert {u.qualname for u in result.globals} == expected


def _framework_model(case: str, checkpoint: str | None = None) -> dict[str, Any]:
    framework = MANIFEST["cases"][case]["framework"]
    if checkpoint is not None:
        framework = framework["output"]["checkpoints"][checkpoint]
    return framework.get("model", framework)  # a model directory's case is the model


DIRECTORY_CASES = [
    ("hf_model", "hf_model", None),
    ("hf_sharded", "hf_sharded", None),
    ("hf_bin_sharded", "hf_bin_sharded", None),
    ("trainer_1proc", "trainer_1proc/output/checkpoint-4", "trainer_1proc/output/checkpoint-4"),
    ("trainer_2proc", "trainer_2proc/output/checkpoint-8", "trainer_2proc/output/checkpoint-8"),
    ("accelerate_1proc", "accelerate_1proc/state", None),
    ("accelerate_2proc", "accelerate_2proc/state", None),
]


@pytest.mark.parametrize(("case", "path", "checkpoint"), DIRECTORY_CASES)
def test_a_directory_opens_as_the_model_its_framework_loads(
    case: str, path: str, checkpoint: str | None
) -> None:
    """The merged ``model`` equals the loader's state dict, except the tied keys the files do
    not store (transformers re-ties ``lm_head.weight`` from config.json)."""
    model = _framework_model(case, checkpoint)
    with open_checkpoint(FRAMEWORKS / path) as ckpt:
        ours = described(ckpt, ckpt.tensors("model"))
    ours = {key.removeprefix("model."): value for key, value in ours.items()}
    theirs = without_values(model["tensors"])
    assert {k: theirs[k] for k in ours} == ours
    untied = set(theirs) - set(ours)
    assert untied <= {"lm_head.weight"}, untied  # tied to the embedding: transformers re-ties it
    assert all(theirs[k]["sha256"] == theirs["model.embed_tokens.weight"]["sha256"] for k in untied)


def test_the_bin_shards_keep_the_tie_as_one_storage() -> None:
    with open_checkpoint(FRAMEWORKS / "hf_bin_sharded") as ckpt:
        head, embed = (
            r
            for r in ckpt.tensors("model")
            if r.key.endswith(("lm_head.weight", "embed_tokens.weight"))
        )
        assert head.storage == embed.storage  # same shard file, one storage
        other = [r.storage for r in ckpt.tensors("model") if r.storage is not None]
        members = {s.member for s in other}  # type: ignore[union-attr]
        assert len(members) == 3  # three .bin files, each numbering its storages from "0"
        assert len(set(other)) == len({(s.member, s.key) for s in other})  # type: ignore[union-attr]


def test_an_index_file_opens_its_directory() -> None:
    index = FRAMEWORKS / "hf_sharded/model.safetensors.index.json"
    with open_checkpoint(index) as by_index, open_checkpoint(index.parent) as by_directory:
        assert [r.key for r in by_index.tensors()] == [r.key for r in by_directory.tensors()]


def test_trainer_output_directory_is_a_collection() -> None:
    with pytest.raises(CheckpointCollectionError) as raised:
        open_checkpoint(FRAMEWORKS / "trainer_1proc/output")
    assert "checkpoint-4 complete; checkpoint-8 complete" in str(raised.value)
    assert "checkpoint-8 (the latest complete)" in str(raised.value)
    half = CliRunner().invoke(cli, ["show", str(FRAMEWORKS / "trainer_1proc/half_written")])
    assert half.exit_code == 0
    assert "checkpoint-8  8       no          trainer_state.json" in half.stdout
    listing = CliRunner().invoke(
        cli, ["show", "--json", str(FRAMEWORKS / "trainer_1proc/half_written")]
    )
    checkpoints = json.loads(listing.stdout)["checkpoints"]
    assert [(c["name"], c["complete"]) for c in checkpoints] == [
        ("checkpoint-4", True), ("checkpoint-8", False),
    ]  # fmt: skip
    diffed = CliRunner().invoke(
        cli, ["diff", str(FRAMEWORKS / "trainer_1proc/output"), str(FRAMEWORKS / "hf_model")]
    )
    assert diffed.exit_code == 2 and "name one of them" in diffed.stderr


@pytest.mark.parametrize(
    ("directory", "weights"),
    [
        ("hf_model", "hf_model/model.safetensors"),
        ("hf_sharded", "hf_sharded/model-00001-of-00003.safetensors"),
        ("hf_bin_sharded", "hf_bin_sharded/pytorch_model-00001-of-00003.bin"),
        (
            "trainer_1proc/output/checkpoint-8",
            "trainer_1proc/output/checkpoint-8/model.safetensors",
        ),
        ("accelerate_2proc/state", "accelerate_2proc/state/model.safetensors"),
    ],
)
def test_show_keys_a_directorys_weights_as_its_files_store_them(
    directory: str, weights: str
) -> None:
    """``show DIR --filter`` matches what the same filter matches in the weights file itself:
    no ``model.model.`` (the section's name before keys that start with ``model.``)."""

    def shown(path: Path, *options: str) -> list[str]:
        result = CliRunner().invoke(cli, ["show", str(path), "--json", *options])
        assert result.exit_code == 0, result.output
        return [t["key"] for t in json.loads(result.stdout)["tensors"]]

    pattern = "model.layers.0.*"
    in_file = shown(FRAMEWORKS / weights, "--filter", pattern)
    assert in_file
    in_directory = shown(FRAMEWORKS / directory, "--filter", pattern)
    assert in_directory == in_file or set(in_file) < set(in_directory)  # a shard holds a part
    everything = shown(FRAMEWORKS / directory)
    assert not any(key.startswith("model.model.") for key in everything)
    assert "model.norm.weight" in everything
    assert shown(FRAMEWORKS / directory, "--section", "model", "--filter", pattern) == in_directory
    details = json.loads(
        CliRunner().invoke(cli, ["show", str(FRAMEWORKS / directory), "--json"]).stdout
    )["details"]
    assert details["weights_section"] == "model"
    text = CliRunner().invoke(cli, ["show", str(FRAMEWORKS / directory)]).stdout
    assert "keys:       the weights' keys as their files store them (section 'model')" in text
    if directory.startswith(("trainer", "accelerate")):  # the other parts keep their section
        assert "optimizer.state.0.exp_avg" in everything


def diffed(a: str, b: str, *options: str, exit_code: int) -> tuple[dict[str, Any], str]:
    """``diff --json`` of two paths under the fixtures: the document and stderr's notes."""
    result = CliRunner().invoke(cli, ["diff", str(FRAMEWORKS / a), str(FRAMEWORKS / b), "--json", *options])  # fmt: skip
    assert result.exit_code == exit_code, result.output
    return json.loads(result.stdout), result.stderr


@pytest.mark.parametrize(
    ("a", "b", "exit_code"),
    [
        ("trainer_1proc/output/checkpoint-4", "trainer_1proc/output/checkpoint-8", 1),
        ("hf_model", "hf_sharded", 0),
        ("hf_model", "hf_bin_sharded", 1),  # transformers 4 and 5 configs
        ("accelerate_1proc/state", "accelerate_2proc/state", 1),
    ],
)
def test_diff_keys_two_directories_weights_as_their_files_store_them(
    a: str, b: str, exit_code: int
) -> None:
    """Two framework directories of the same kind: diff keys the weights as ``show`` lists
    them and as diff keys them against the other's weights file (no ``model.model.``), says
    the section once; the other parts keep their section's name."""
    data, notes = diffed(a, b, exit_code=exit_code)
    keys = [t["key"] for t in data["tensors"]]
    assert not any(key.startswith("model.model.") for key in keys)
    entry = next(t for t in data["tensors"] if t["key"] == "model.layers.0.mlp.up_proj.weight")
    assert entry["a"]["key"] == entry["b"]["key"] == "model.layers.0.mlp.up_proj.weight"
    assert data["a"]["weights_section"] == data["b"]["weights_section"] == "model"
    assert notes.count("their tensors are keyed as the files store them, without 'model.'") == 1
    # the keys a directory's weights have against its own weights file
    against_file, _ = diffed(a, f"{a}/model.safetensors", exit_code=0)
    weights = {t["key"] for t in against_file["tensors"]}
    assert len(weights) == 20 and weights <= set(keys)
    shown = CliRunner().invoke(cli, ["show", str(FRAMEWORKS / a), "--json"]).stdout
    in_a = [t for t in data["tensors"] if t["a"] is not None]
    assert {t["key"] for t in json.loads(shown)["tensors"]} == {
        t["key"] for t in in_a if not (t["alias"] and t["alias"]["side"] == "a")
    }
    if a.startswith(("trainer", "accelerate")):  # the other parts keep their section
        assert "optimizer.state.0.exp_avg" in keys


def test_diff_of_two_directories_selects_by_the_key_as_printed() -> None:
    """``--strip-prefix`` works on the keys diff prints: ``model.`` comes off the stored keys
    once (they are not ``model.model.``), and the text table lists them the same way."""
    data, _ = diffed("hf_model", "hf_sharded", "--strip-prefix", "model.", exit_code=0)
    keys = {t["key"] for t in data["tensors"]}
    assert "layers.0.mlp.up_proj.weight" in keys and "norm.weight" in keys
    assert not any(key.startswith("model.") for key in keys)
    result = CliRunner().invoke(
        cli, ["diff", str(FRAMEWORKS / "hf_model"), str(FRAMEWORKS / "hf_sharded"), "--all"]
    )
    assert result.exit_code == 0, result.output
    rows = [line.split()[0] for line in result.stdout.splitlines()[2:] if line.strip()][:-1]
    assert "model.layers.0.mlp.up_proj.weight" in rows and "model.norm.weight" in rows
    assert not any(row.startswith("model.model.") for row in rows)
    assert "note: A's and B's weights files fill their 'model' section" in result.stderr


def test_show_gives_an_accelerate_folders_counters() -> None:
    result = CliRunner().invoke(cli, ["show", str(FRAMEWORKS / "accelerate_2proc/state")])
    lines = result.stdout.splitlines()
    framework = MANIFEST["cases"]["accelerate_2proc"]["framework"]
    assert f"step:       {framework['step']}" in lines  # accelerator.step as load_state sets it
    assert "scheduler_last_epoch: 4" in lines and "ranks:      2" in lines


def test_show_describes_a_trainer_checkpoint() -> None:
    result = CliRunner().invoke(
        cli, ["show", str(FRAMEWORKS / "trainer_2proc/output/checkpoint-8")]
    )
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert "layout:     Hugging Face Trainer checkpoint" in lines
    assert "global_step: 8" in lines and "ranks:      2" in lines
    assert any(line.split()[:3] == ["rng_state_1.pth", "14.0", "KB"] for line in lines)
    assert "rng:        rank0, rank1" in lines
    assert any(line.startswith("optimizer:  AdamW, state for 20 params") for line in lines)
    assert "missing:" not in result.stdout


@pytest.mark.parametrize(
    ("path", "exit_code", "problem"),
    [
        ("trainer_1proc/output/checkpoint-8", 0, None),
        ("trainer_2proc/output/checkpoint-4", 0, None),
        ("accelerate_2proc/state", 0, None),
        ("hf_sharded", 0, None),
        ("trainer_1proc/half_written/checkpoint-8", 1, "incomplete: trainer_state.json is missing"),
    ],
)
def test_verify_knows_each_layouts_completeness(
    path: str, exit_code: int, problem: str | None
) -> None:
    result = CliRunner().invoke(cli, ["verify", str(FRAMEWORKS / path)])
    assert result.exit_code == exit_code, result.output
    if problem:
        assert problem in result.stdout


def _copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(FRAMEWORKS / name, tmp_path / Path(name).name))


def _verify(path: Path) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["verify", str(path)])
    return result.exit_code, result.stdout


def test_diff_keeps_full_keys_when_a_stored_key_is_another_parts(tmp_path: Path) -> None:
    """A weights file storing ``optimizer.state.0.exp_avg``: keyed as stored it would be the
    optimizer's tensor, so diff (like show) keeps both directories' full keys, and says nothing
    of a weights section. Guards the fallback: without it this diff fails on the clash."""
    from safetensors.numpy import load_file, save_file

    directory = _copy("trainer_1proc/output/checkpoint-4", tmp_path)
    weights = load_file(directory / "model.safetensors")
    weights["optimizer.state.0.exp_avg"] = np.zeros(2, np.float32)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    original = FRAMEWORKS / "trainer_1proc/output/checkpoint-4"
    for a, b in ((directory, original), (original, directory)):
        result = CliRunner().invoke(cli, ["diff", str(a), str(b), "--json"])
        assert result.exit_code == 1, result.output
        data = json.loads(result.stdout)
        keys = {t["key"] for t in data["tensors"]}
        assert {"model.model.norm.weight", "model.optimizer.state.0.exp_avg"} <= keys
        assert "optimizer.state.0.exp_avg" in keys
        assert "weights_section" not in data["a"] and "weights_section" not in data["b"]
        assert "keyed as the files store them" not in result.stderr


def test_verify_a_trainer_rank_without_its_rng_file(tmp_path: Path) -> None:
    checkpoint = _copy("trainer_2proc/output/checkpoint-8", tmp_path)
    (checkpoint / "rng_state_0.pth").unlink()
    code, out = _verify(checkpoint)
    assert code == 1 and "incomplete: rng_state_0.pth is missing" in out


def test_verify_an_accelerate_rank_without_its_random_states(tmp_path: Path) -> None:
    state = _copy("accelerate_2proc/state", tmp_path)
    (state / "random_states_0.pkl").unlink()
    code, out = _verify(state)
    assert code == 1 and "incomplete: random_states_0.pkl is missing" in out


def test_verify_a_shard_the_index_names_but_is_gone(tmp_path: Path) -> None:
    model = _copy("hf_sharded", tmp_path)
    (model / "model-00002-of-00003.safetensors").unlink()
    code, out = _verify(model)
    assert (
        code == 1
        and "model-00002-of-00003.safetensors: listed in model.safetensors.index.json but missing"
        in out
    )
    with pytest.raises(CorruptCheckpointError, match=r"listed in model\.safetensors\.index\.json"):
        open_checkpoint(model)


def test_verify_an_orphan_shard_and_a_wrong_index(tmp_path: Path) -> None:
    model = _copy("hf_sharded", tmp_path)
    shutil.copy(
        model / "model-00003-of-00003.safetensors", model / "model-00004-of-00004.safetensors"
    )
    index = json.loads((model / "model.safetensors.index.json").read_text())
    key = next(k for k, v in index["weight_map"].items() if v == "model-00001-of-00003.safetensors")
    index["weight_map"][key] = "model-00002-of-00003.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    code, out = _verify(model)
    assert code == 1
    assert (
        "model-00004-of-00004.safetensors: a weight shard that model.safetensors.index.json does not list"
        in out
    )
    assert (
        f"{key}: model.safetensors.index.json says model-00002-of-00003.safetensors, but it is stored in model-00001-of-00003.safetensors"
        in out
    )


def test_a_tensor_in_two_shards_is_a_problem(tmp_path: Path) -> None:
    model = _copy("hf_sharded", tmp_path)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shutil.copy(model / "model-00003-of-00003.safetensors", model / "model-00003-of-00003.copy")
    # a fourth shard holding the third's tensors again, listed by the index
    (model / "model-00003-of-00003.copy").rename(model / "model-00004-of-00004.safetensors")
    index["weight_map"]["extra"] = "model-00004-of-00004.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    code, out = _verify(model)
    assert (
        code == 1
        and "stored in two shards (model-00003-of-00003.safetensors and model-00004-of-00004.safetensors)"
        in out
    )


def test_an_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    model = _copy("hf_sharded", tmp_path)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../../etc/passwd"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InputError, match="outside the checkpoint"):
        open_checkpoint(model)
    result = CliRunner().invoke(cli, ["show", str(model)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1


def test_a_broken_index_is_a_one_line_error(tmp_path: Path) -> None:
    model = _copy("hf_sharded", tmp_path)
    (model / "model.safetensors.index.json").write_text("{not json")
    result = CliRunner().invoke(cli, ["show", str(model)])
    assert (
        result.exit_code == 2
        and "not valid JSON" in result.stderr
        and result.stderr.count("\n") == 1
    )


def test_the_tutorial_layouts_are_read_by_role() -> None:
    framework = MANIFEST["cases"]["tutorial"]["framework"]
    for name, part in (
        ("general_checkpoint.pt", "model_state_dict"),
        ("step_checkpoint.pth", "model_state"),
    ):
        with open_checkpoint(FRAMEWORKS / "tutorial" / name) as ckpt:
            ours = described(ckpt, ckpt.tensors(part))
        theirs = without_values(framework[name]["model"]["tensors"])
        assert {k.removeprefix(part + "."): v for k, v in ours.items()} == theirs
    with open_checkpoint(FRAMEWORKS / "tutorial/whole_model.pt") as whole:
        assert described(whole, whole.tensors()) == without_values(
            framework["whole_model.pt"]["model"]["tensors"]
        )


def test_convert_takes_a_tutorial_checkpoints_model_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "weights.safetensors"
    result = CliRunner().invoke(
        cli, ["convert", str(FRAMEWORKS / "tutorial/general_checkpoint.pt"), str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "(training checkpoint, section 'model_state_dict')" in result.stdout
    assert "not converted (not weights): optimizer_state_dict" in result.stderr
    from safetensors import safe_open

    with safe_open(str(out), "np") as handle:
        assert not any(k.startswith(("state.", "optimizer")) for k in handle.keys())  # noqa: SIM118


def test_a_member_cut_after_opening_is_an_error_naming_that_member(tmp_path: Path) -> None:
    """Reading a directory's tensor goes to its member file, through the reader's one storage
    read: a member cut short after the open is a one-line error that names it."""
    model = _copy("hf_sharded", tmp_path)
    shard = model / "model-00001-of-00003.safetensors"
    with open_checkpoint(model) as ckpt:
        in_shard = [r for r in ckpt.tensors() if getattr(r.storage, "member", None) == shard.name]
        assert in_shard and all(read_array(ckpt, r).nbytes == r.nbytes for r in in_shard)
        with open(shard, "r+b") as handle:
            handle.truncate(shard.stat().st_size // 2)
        with pytest.raises(CorruptCheckpointError, match=f"{shard}: .*truncated"):
            for record in in_shard:
                read_array(ckpt, record)


@pytest.mark.parametrize(
    "relative", ["hf_sharded", "trainer_1proc/output/checkpoint-8", "hf_model"]
)
def test_opening_a_directory_reads_each_json_file_once(
    relative: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Detection reads the index and trainer_state.json; reading the directory uses what it
    parsed instead of reading them again."""
    from ckpttool.frameworks import base as huggingface  # read_json reads through base

    reads: list[str] = []
    original = huggingface.read_small

    def counted(path: str, limit: int) -> bytes:
        reads.append(Path(path).name)
        return original(path, limit)

    monkeypatch.setattr(huggingface, "read_small", counted)
    with open_checkpoint(str(FRAMEWORKS / relative)) as ckpt:
        assert ckpt.tensors()
    assert reads and sorted(reads) == sorted(set(reads)), reads
