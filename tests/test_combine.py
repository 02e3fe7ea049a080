"""average and merge beyond their arithmetic (tests/test_average.py, tests/test_merge.py): convert's
--filter and --map, average --like-input (the first input's own layout), --jobs (the same bytes
for every N) and the progress callbacks, over MiniMind resume files, Hugging Face folders, DCP
directories and a DeepSpeed ZeRO-2 run."""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpttool.cli import cli
from ckpttool.commands.average import PROVENANCE_KEY, average
from ckpttool.commands.merge import merge
from tests.support.helpers import FIXTURES
from tests.test_average import STEPS, resume_files
from tests.test_json_schemas import assert_valid

HF_MODEL = FIXTURES / "frameworks/hf_model"  # written by transformers' save_pretrained
DEEPSPEED_RUN = FIXTURES / "deepspeed/stage2_fp32_1proc/checkpoints"  # written by DeepSpeed


def invoke(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_line_error(result: Result, fragment: str) -> None:
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr
    assert fragment in result.stderr, result.stderr


def mean(states: list[dict[str, torch.Tensor]], key: str) -> torch.Tensor:
    """torch's float64 mean, rounded once to the first input's dtype."""
    return torch.stack([s[key].double() for s in states]).mean(0).to(states[0][key].dtype)


def resume_run(tmp_path: Path, dtype: torch.dtype = torch.float16) -> tuple[list[dict[str, torch.Tensor]], list[Path]]:  # fmt: skip
    states = resume_files(tmp_path / "run", dtype)
    return states, [tmp_path / "run" / f"resume_{s}.pth" for s in STEPS]


def hf_models(tmp_path: Path, count: int) -> list[Path]:
    """``count`` copies of the Hugging Face fixture folder, the i-th with its float weights
    moved by ``0.25 * i`` (saved as save_pretrained saves them: metadata format pt)."""
    folders = []
    for index in range(count):
        folder = tmp_path / f"hf_{index}"
        shutil.copytree(HF_MODEL, folder)
        state = load_file(folder / "model.safetensors")
        moved = {k: v + 0.25 * index if v.is_floating_point() else v for k, v in state.items()}
        save_file(moved, folder / "model.safetensors", metadata={"format": "pt"})
        folders.append(folder)
    return folders


# --- --map and --filter ------------------------------------------------------------------------


BASE_NAMES = {"model.layers.0.w": (4, 3), "model.layers.1.w": (4, 3), "model.norm.weight": (3,)}
#: A MODEL in other names, one tensor stored transposed: the map renames and transposes.
MAP = {
    "rules": [
        {"from": "blocks.{L}.w_t", "to": "model.layers.{L}.w", "op": "transpose"},
        {"from": "final_norm", "to": "model.norm.weight"},
    ]
}


def named_models(tmp_path: Path) -> tuple[list[dict[str, torch.Tensor]], list[Path], Path]:
    """BASE and a MODEL in BASE's names (safetensors), and a MODEL in other names (a .pth of
    a plain state dict); each one's tensors in BASE's names; the map file."""
    torch.manual_seed(0)
    states = [{k: torch.randn(shape) for k, shape in BASE_NAMES.items()} for _ in range(3)]
    base, same = tmp_path / "base.safetensors", tmp_path / "same.safetensors"
    save_file(states[0], base)
    save_file(states[1], same)
    other = tmp_path / "other.pth"
    torch.save({"blocks.0.w_t": states[2]["model.layers.0.w"].T.contiguous(),
                "blocks.1.w_t": states[2]["model.layers.1.w"].T.contiguous(),
                "final_norm": states[2]["model.norm.weight"]}, other)  # fmt: skip
    map_file = tmp_path / "map.json"
    map_file.write_text(json.dumps(MAP))
    return states, [base, same, other], map_file


def test_merge_map_renames_each_model_into_the_base_names(tmp_path: Path) -> None:
    states, (base, same, other), map_file = named_models(tmp_path)
    out = tmp_path / "out.safetensors"
    result = invoke("merge", base, same, other, "-o", out, "--method", "linear", "--map", map_file)
    assert result.exit_code == 0, result.stderr
    assert f"note: {same} holds {base}'s names: --map not applied" in result.stderr
    got = load_file(out)
    assert set(got) == set(BASE_NAMES)
    for key, tensor in got.items():
        want = torch.stack([s[key].double() for s in states]).mean(0).float()
        torch.testing.assert_close(tensor, want, rtol=0, atol=1e-7)
    # without the map the names do not match: named, nothing written
    result = invoke("merge", base, other, "-o", tmp_path / "no.safetensors", "--method", "linear")
    one_line_error(result, f"{other} lacks model.layers.0.w")


def test_merge_map_errors_name_the_tensors_it_leaves(tmp_path: Path) -> None:
    _, (base, _, other), map_file = named_models(tmp_path)
    out = tmp_path / "out.safetensors"
    extra = tmp_path / "extra.pth"
    torch.save({**torch.load(other), "head": torch.ones(2)}, extra)
    one_line_error(invoke("merge", base, extra, "-o", out, "--method", "linear", "--map", map_file), "head")  # fmt: skip
    short = tmp_path / "short.pth"
    kept = {k: v for k, v in torch.load(other).items() if k != "final_norm"}
    torch.save(kept, short)
    result = invoke("merge", base, short, "-o", out, "--method", "linear", "--map", map_file)
    one_line_error(result, f"{short} lacks model.norm.weight")
    assert not out.exists()


def test_merge_filter_picks_the_base_tensors_and_ignores_the_models_others(tmp_path: Path) -> None:
    states, (base, same, other), map_file = named_models(tmp_path)
    bigger = tmp_path / "bigger.safetensors"
    save_file({**states[1], "lm_head.weight": torch.ones(5, 3)}, bigger)
    out = tmp_path / "out.safetensors"
    result = invoke("merge", base, bigger, other, "-o", out, "--method", "task-arithmetic",
                    "--filter", "model.layers.*", "--map", map_file, "--json")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert_valid("merge", data)
    assert data["tensors"] == 2
    got = load_file(out)
    assert set(got) == {"model.layers.0.w", "model.layers.1.w"}
    for key, tensor in got.items():
        b = states[0][key].double()
        want = b + (states[1][key].double() - b) + (states[2][key].double() - b)
        torch.testing.assert_close(tensor, want.float(), rtol=0, atol=1e-6)
    one_line_error(
        invoke("merge", base, same, "-o", out, "--force", "--method", "linear", "--filter", "nothing*"),
        "--filter 'nothing*' matches no tensor",
    )  # fmt: skip


def test_average_filter_and_map_apply_to_every_checkpoint(tmp_path: Path) -> None:
    states, paths = resume_run(tmp_path, torch.float32)
    out = tmp_path / "out.safetensors"
    average(paths, out, pattern="*layers.0.*")
    got = load_file(out)
    assert got and all(".layers.0." in key for key in got)
    assert set(got) == {k for k in states[0] if ".layers.0." in k}
    for key, tensor in got.items():
        assert torch.equal(tensor, mean(states, key)), key
    map_file = tmp_path / "map.json"
    map_file.write_text(json.dumps({"unmatched": "drop", "rules": [
        {"from": "lm_head.weight", "to": "output.weight"},
        {"from": "model.norm.weight", "to": "final_norm"},
    ]}))  # fmt: skip
    report = average(paths, out, map_name=str(map_file), force=True)
    got = load_file(out)
    assert set(got) == {"output.weight", "final_norm"} and report.tensors == 2
    assert torch.equal(got["output.weight"], mean(states, "lm_head.weight"))
    assert torch.equal(got["final_norm"], mean(states, "model.norm.weight"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(
    ("layout", "pattern"),
    [("dcp", "layers.1.*"), ("deepspeed-zero2", "*.bias"), ("hf-folders", "*layers.0.*")],
)
def test_average_filter_over_layouts_is_the_mean_of_what_convert_selects(
    tmp_path: Path, layout: str, pattern: str
) -> None:
    """Each input converted with the same --filter (convert's own selection), averaged by torch
    here: the same tensors, bit for bit."""
    from ckpttool.commands.convert.run import convert

    paths = {
        "dcp": lambda: dcp_run(tmp_path),
        "deepspeed-zero2": lambda: [DEEPSPEED_RUN / "global_step2", DEEPSPEED_RUN / "global_step4"],
        "hf-folders": lambda: hf_models(tmp_path, 3),
    }[layout]()
    states = []
    for index, path in enumerate(paths):
        convert(path, tmp_path / f"c{index}.safetensors", pattern=pattern)
        states.append(load_file(tmp_path / f"c{index}.safetensors"))
    out = tmp_path / "avg.safetensors"
    result = invoke("average", *paths, "-o", out, "--filter", pattern, "--json")
    assert result.exit_code == 0, result.stderr
    assert_valid("average", json.loads(result.stdout))
    got = load_file(out)
    assert set(got) == set(states[0]) and len(got) > 0
    assert all(fnmatch.fnmatchcase(key, pattern) for key in got)
    for key, tensor in got.items():
        want = mean(states, key) if tensor.is_floating_point() else states[0][key]
        assert torch.equal(tensor, want), key


# --- --like-input ------------------------------------------------------------------------------


def test_like_input_of_resume_files_is_a_resume_file_with_the_average(tmp_path: Path) -> None:
    states, paths = resume_run(tmp_path)
    out = tmp_path / "avg_resume.pth"
    result = invoke("average", *paths, "-o", out, "--like-input", "--ints", "last", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert_valid("average", data)
    assert data["like_input"] is True and data["format"] == "pth"
    assert "the provenance is not written" in " ".join(data["notes"])
    assert data["layout"] == str(paths[-1])
    written = torch.load(out, weights_only=True)
    newest = torch.load(paths[-1], weights_only=True)  # the run goes on from the newest
    assert set(written) == set(newest)
    assert written["step"] == newest["step"] == STEPS[-1] and written["epoch"] == newest["epoch"]
    assert written["optimizer"] == newest["optimizer"]
    assert set(written["model"]) == set(states[0])
    for key, tensor in written["model"].items():
        want = mean(states, key) if tensor.is_floating_point() else states[-1][key]
        assert tensor.dtype == want.dtype and torch.equal(tensor, want), key
    model = written["model"]  # the tied embedding and head are still one tensor
    assert model["lm_head.weight"].data_ptr() == model["model.embed_tokens.weight"].data_ptr()


@pytest.mark.parametrize("ema", [False, True])
def test_like_input_of_the_last_n_is_the_newest_resume_file(tmp_path: Path, ema: bool) -> None:
    # --last N RUN/ --like-input: the step, optimizer and scheduler of the newest checkpoint,
    # whatever order the run lists them in (it used to be the oldest's)
    states, paths = resume_run(tmp_path, torch.float32)
    out = tmp_path / "avg_resume.pth"
    report = average([tmp_path / "run"], out, last=3, like_input=True, ints="last",
                     ema=0.5 if ema else None)  # fmt: skip
    assert report.layout == "resume_300.pth"
    written, newest = torch.load(out, weights_only=True), torch.load(paths[-1], weights_only=True)
    assert written["step"] == STEPS[-1] and written["optimizer"] == newest["optimizer"]
    weights = [i.weight for i in report.inputs]
    for key, tensor in written["model"].items():
        if tensor.is_floating_point():
            want = sum(w * s[key].double() for w, s in zip(weights, states))
            torch.testing.assert_close(tensor, want.float(), rtol=1e-6, atol=1e-7)  # type: ignore[union-attr]


def test_merge_like_input_writes_the_base_resume_file(tmp_path: Path) -> None:
    states, paths = resume_run(tmp_path, torch.float32)
    out = tmp_path / "merged_resume.pth"
    result = invoke("merge", *paths, "-o", out, "--method", "task-arithmetic", "--lambda", "0.5",
                    "--like-input", "--json")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert_valid("merge", data)
    assert data["like_input"] is True and data["format"] == "pth"
    written, base = torch.load(out, weights_only=True), torch.load(paths[0], weights_only=True)
    assert written["step"] == base["step"] and written["optimizer"] == base["optimizer"]
    for key, tensor in written["model"].items():
        if not tensor.is_floating_point():
            assert torch.equal(tensor, states[0][key])
            continue
        b = states[0][key].double()
        want = b + 0.5 * ((states[1][key].double() - b) + (states[2][key].double() - b))
        torch.testing.assert_close(tensor, want.float(), rtol=1e-6, atol=1e-7)


def test_like_input_of_a_safetensors_file_keeps_its_metadata(tmp_path: Path) -> None:
    states = []
    for index in range(3):
        torch.manual_seed(index)
        states.append({"a": torch.randn(3, 2).half(), "b": torch.randn(5)})
        save_file(states[-1], tmp_path / f"m{index}.safetensors", metadata={"format": "pt"})
    out = tmp_path / "avg.safetensors"
    report = average([tmp_path / f"m{i}.safetensors" for i in range(3)], out, like_input=True,
                     weights=[1, 1, 2])  # fmt: skip
    assert report.format == "safetensors" and report.like_input
    with safe_open(out, "pt") as handle:
        metadata = handle.metadata()
    assert metadata["format"] == "pt"
    assert json.loads(metadata[PROVENANCE_KEY])["method"] == "weighted"
    got = load_file(out)
    for key in ("a", "b"):
        total = sum(w * s[key].double() for w, s in zip((0.25, 0.25, 0.5), states))
        assert torch.equal(got[key], total.to(states[0][key].dtype))  # type: ignore[union-attr]


def test_like_input_of_hugging_face_folders_is_a_model_folder(tmp_path: Path) -> None:
    folders = hf_models(tmp_path, 3)
    out = tmp_path / "avg"
    result = invoke("average", *folders, "-o", out, "--like-input", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert_valid("average", data)
    assert data["format"] == "directory" and data["output"] == str(out)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"
    ]  # fmt: skip
    assert (out / "config.json").read_bytes() == (HF_MODEL / "config.json").read_bytes()
    states = [load_file(f / "model.safetensors") for f in folders]
    got = load_file(out / "model.safetensors")
    assert set(got) <= set(states[0]) and got
    for key, tensor in got.items():
        want = mean(states, key) if tensor.is_floating_point() else states[0][key]
        assert torch.equal(tensor, want), key


def test_like_input_of_sharded_folders_is_sharded_as_they_are(tmp_path: Path) -> None:
    from safetensors.torch import load_file as load

    folders = []
    for index in range(2):
        folder = tmp_path / f"sharded_{index}"
        shutil.copytree(FIXTURES / "frameworks/hf_sharded", folder)
        for shard in folder.glob("*.safetensors"):
            state = {
                k: v * (index + 1) if v.is_floating_point() else v for k, v in load(shard).items()
            }
            save_file(state, shard, metadata={"format": "pt"})
        folders.append(folder)
    out = tmp_path / "avg"
    average(folders, out, like_input=True)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in folders[0].iterdir())  # 3 shards and the index
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for name, shard in index.items():
        got = load(out / shard)[name]
        first = load(folders[0] / json.loads(
            (folders[0] / "model.safetensors.index.json").read_text())["weight_map"][name])[name]  # fmt: skip
        want = (first.double() * 1.5).to(first.dtype) if first.is_floating_point() else first
        assert torch.equal(got, want), name


@pytest.mark.parametrize(
    "inputs",
    [lambda tmp: [DEEPSPEED_RUN / "global_step2", DEEPSPEED_RUN / "global_step4"],
     lambda tmp: [FIXTURES / "dcp/checkpoint", FIXTURES / "dcp/checkpoint"]],
    ids=["deepspeed", "dcp"],
)  # fmt: skip
def test_like_input_refuses_layouts_it_cannot_write_in_one_line(tmp_path: Path, inputs) -> None:
    out = tmp_path / "out"
    one_line_error(invoke("average", *inputs(tmp_path), "-o", out, "--like-input"),
                   "which is not written in its own layout")  # fmt: skip
    assert not out.exists()


def test_like_input_of_files_into_a_directory_is_refused(tmp_path: Path) -> None:
    _, paths = resume_run(tmp_path)
    out = tmp_path / "already_a_dir"
    out.mkdir()
    result = invoke("average", *paths, "-o", out, "--like-input", "--ints", "last")
    one_line_error(result, "is a directory; --like-input of a file writes a file: name a file")
    assert list(out.iterdir()) == []


def test_like_input_with_filter_is_refused(tmp_path: Path) -> None:
    _, paths = resume_run(tmp_path)
    result = invoke("average", *paths, "-o", tmp_path / "o.pth", "--like-input", "--filter", "x*")
    one_line_error(result, "not with --filter or --map")


# --- --jobs and progress -----------------------------------------------------------------------


def dcp_run(tmp_path: Path) -> list[Path]:
    import torch.distributed.checkpoint as dcp

    paths = []
    for step in (100, 200, 300):
        torch.manual_seed(step)
        model = {f"layers.{i}.w": torch.randn(16, 8) for i in range(4)}
        paths.append(tmp_path / f"dcp_{step}")
        dcp.save({"model": model, "step": step}, checkpoint_id=str(paths[-1]))
    return paths


def merge_with_map(tmp_path: Path) -> list[object]:
    """A TIES merge whose third input is mapped (renamed, transposed) into BASE's names."""
    _, paths, map_file = named_models(tmp_path)
    return ["merge", *paths, "--method", "ties", "--density", "0.5", "--map", map_file]


CASES = {
    "resume-pth": lambda tmp: ["average", *resume_run(tmp)[1], "--ints", "last"],
    "resume-like-input": lambda tmp: ["average", *resume_run(tmp)[1], "--ints", "last",
                                      "--like-input"],
    "hf-folders": lambda tmp: ["average", *hf_models(tmp, 3)],
    "hf-like-input": lambda tmp: ["average", *hf_models(tmp, 3), "--like-input"],
    "dcp": lambda tmp: ["average", *dcp_run(tmp), "--ema", "0.5"],
    "deepspeed-zero2": lambda tmp: ["average", DEEPSPEED_RUN],
    "merge-ties": lambda tmp: ["merge", *hf_models(tmp, 3), "--method", "ties", "--density",
                               "0.3", "--weights", "1,2"],
    "merge-map": lambda tmp: merge_with_map(tmp),
    "merge-slerp": lambda tmp: ["merge", *resume_run(tmp)[1][:2], "--method", "slerp", "--t",
                                "0.4"],
}  # fmt: skip


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("case", list(CASES))
def test_jobs_write_the_same_bytes_for_every_n(tmp_path: Path, case: str) -> None:
    args = CASES[case](tmp_path)
    like = "--like-input" in args
    written = []
    for jobs in (1, 2, 4):
        out = tmp_path / (f"out_{jobs}" + ("" if "hf" in case and like else ".pth" if like else ".safetensors"))  # fmt: skip
        result = invoke(*args, "-o", out, "--jobs", jobs)
        assert result.exit_code == 0, result.stderr
        files = sorted(out.iterdir()) if out.is_dir() else [out]
        written.append([(f.name if out.is_dir() else "", f.read_bytes()) for f in files])
    assert written[0] == written[1] == written[2]


@pytest.mark.parametrize("like_input", [False, True])
@pytest.mark.parametrize("jobs", [1, 3])
def test_progress_adds_up_to_the_total_announced(
    tmp_path: Path, like_input: bool, jobs: int
) -> None:
    _, paths = resume_run(tmp_path)
    totals: list[int] = []
    steps: list[int] = []
    out = tmp_path / ("avg.pth" if like_input else "avg.safetensors")
    average(paths, out, ints="last", like_input=like_input, jobs=jobs, progress=steps.append,
            on_total=totals.append)  # fmt: skip
    assert len(totals) == 1 and totals[0] > 0 and sum(steps) == totals[0]
    merged: list[int] = []
    merge(paths[0], paths[1:], tmp_path / "m.safetensors", method="ties", density=0.5,
          jobs=jobs, progress=merged.append, on_total=totals.append)  # fmt: skip
    assert sum(merged) == totals[1]


# --- the streaming arithmetic ------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [3, 1 << 18])
def test_trim_keeps_what_a_stable_argsort_by_magnitude_keeps(
    monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """The partition-based trim against mergekit's rule (the first k of a stable argsort by
    descending magnitude), on values full of ties (zeros, equal magnitudes of both signs),
    with chunks smaller than the ties' run."""
    import numpy as np

    from ckpttool.model import merge_methods

    monkeypatch.setattr(merge_methods, "CHUNK", chunk)
    rng = np.random.default_rng(1)
    for size, density in ((50, 0.3), (64, 0.5), (1000, 0.05), (1000, 0.999), (7, 0.2)):
        delta = rng.integers(-3, 4, size).astype(np.float64) / 2
        keep = np.argsort(-np.abs(delta), kind="stable")[: int(density * size)]
        want = np.zeros_like(delta)
        want[keep] = delta[keep]
        got = merge_methods.trim(delta.copy(), density, np.empty_like(delta))
        assert got.tolist() == want.tolist(), (size, density)


def test_streamed_methods_take_each_input_once_in_order() -> None:
    """The methods ask for the inputs one at a time, in order, each once."""
    import numpy as np

    from ckpttool.model import merge_methods

    asked: list[int] = []

    def inputs(count: int):
        for index in range(count):
            asked.append(index)
            yield np.full(4, float(index + 1), dtype=np.float32)

    assert merge_methods.linear(inputs(3), [1, 1, 2]).tolist() == [2.25] * 4
    assert asked == [0, 1, 2]
    asked.clear()
    models = inputs(3)
    next(models)  # the base, 1.0
    base = np.ones(4)
    got = merge_methods.task_arithmetic(base, models, [1, 1], consensus=True, normalize=True)
    assert got.tolist() == [2.5] * 4 and asked == [0, 1, 2]
