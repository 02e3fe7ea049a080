"""`ckpttool show` through the CLI: output contract, JSON schema, options, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result

from ckpttool.cli import cli
from tests.support.helpers import FIXTURES, fixture_files, fixture_id

RESUME = FIXTURES / "minimind/pretrain_32_resume.pth"


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("path", fixture_files(), ids=fixture_id)
def test_show_every_fixture(path: Path) -> None:
    result = run("show", path)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"file:       {path}"
    data = json.loads(run("show", path, "--json").stdout)
    assert data["num_tensors"] == len(data["tensors"]) > 0


def test_show_header_is_exact_for_a_minimind_resume() -> None:
    lines = run("show", RESUME).stdout.splitlines()
    assert lines[1].startswith("format:     torch-zip  (")
    assert lines[2] == "layout:     MiniMind-style resume checkpoint"
    assert lines[3] == "tensors:    81  (22.69K parameters)"
    assert "epoch:      1" in lines
    assert "step:       1200" in lines
    assert "world_size: 8" in lines
    assert "wandb_id:   'run-abc123'" in lines
    assert any(line.startswith("optimizer:  AdamW, state for 20 params") for line in lines)


def test_show_json_schema() -> None:
    data = json.loads(run("show", RESUME, "--json").stdout)
    assert {"format", "layout", "fields", "tensors", "size", "num_parameters"} <= set(data)
    assert data["format"] == "torch-zip"
    assert data["layout"] == "minimind_resume"
    assert data["fields"]["step"] == 1200
    assert data["fields"]["world_size"] == 8
    assert data["fields"]["wandb_id"] == "run-abc123"
    assert data["fields"]["scaler.scale"] == 65536.0
    first = data["tensors"][0]
    assert first["key"] == "model.model.embed_tokens.weight"
    assert first["dtype"] == "float16"
    assert first["shape"] == [64, 32]
    assert first["numel"] == 2048
    assert first["nbytes"] == 4096
    keys = [t["key"] for t in data["tensors"]]
    assert "optimizer.state.0.exp_avg" in keys
    assert data["optimizer"]["type_guess"] == "AdamW"
    assert data["optimizer"]["param_names"]["0"] == "model.embed_tokens.weight"  # parameter name


def test_plain_state_dict_keys_are_unprefixed() -> None:
    data = json.loads(run("show", FIXTURES / "minimind/pretrain_32.pth", "--json").stdout)
    assert data["tensors"][0]["key"] == "model.embed_tokens.weight"
    assert data["layout"] == "state_dict"


def test_filter_and_section() -> None:
    data = json.loads(run("show", RESUME, "--json", "--filter", "*exp_avg_sq").stdout)
    assert data["tensors"] and all(t["key"].endswith("exp_avg_sq") for t in data["tensors"])
    data = json.loads(run("show", RESUME, "--json", "--section", "model").stdout)
    assert all(t["key"].startswith("model.") for t in data["tensors"])
    assert len(data["tensors"]) == 21
    result = run("show", RESUME, "--section", "nope")
    assert result.exit_code == 2
    assert result.stderr == f"Error: {RESUME}: no section 'nope' in this checkpoint\n"


def test_stats_match_numpy(tmp_path: Path) -> None:
    path = tmp_path / "w.pth"
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    weight[1, 1] = float("nan")
    torch.save(
        {"w": weight, "view": weight.t()[1:], "half": torch.ones(3, dtype=torch.bfloat16)}, path
    )
    result = run("show", path, "--json", "--stats")
    stats = {t["key"]: t["stats"] for t in json.loads(result.stdout)["tensors"]}
    finite = weight[~weight.isnan()].double().numpy()
    assert stats["w"]["nan"] == 1
    assert stats["w"]["min"] == 0 and stats["w"]["max"] == 11
    assert stats["w"]["mean"] == pytest.approx(finite.mean())
    assert stats["w"]["std"] == pytest.approx(finite.std())
    view = weight.t()[1:].double().numpy()
    assert stats["view"]["mean"] == pytest.approx(np.nanmean(view))
    assert stats["half"] == {"min": 1.0, "max": 1.0, "mean": 1.0, "std": 0.0, "nan": 0, "inf": 0}
    assert "w: 1 NaN and 0 Inf values" in run("show", path, "--stats").stderr


def test_tree_view() -> None:
    out = run("show", RESUME, "--tree", "--depth", "1").stdout.splitlines()
    assert out[0] == "dict[7]"
    assert "  model: dict[21]" in out
    assert "  step: 1200" in out
    assert not any(line.startswith("    ") for line in out)


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("minimind/pretrain_32_resume.pth", "resuming from it is lossy"),
        ("wrapped/ddp.pth", "wrapper prefixes"),
        ("special/namespace_config.pth", "tests.fixtures.generate.TrainConfig"),
    ],
)
def test_warnings_go_to_stderr(name: str, fragment: str) -> None:
    result = run("show", FIXTURES / name)
    assert fragment in result.stderr
    assert fragment not in result.stdout


def test_notes_for_tied_cuda_and_views() -> None:
    out = run("show", FIXTURES / "special/cuda_storages.pth").stdout
    assert "saved on cuda:0" in out
    assert "tied with" in out
    out = run("show", FIXTURES / "special/views.pth").stdout
    assert "non-contiguous" in out
    assert "shares storage with" in out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        (b"", "the file is empty"),
        (b"just some text\n", "not a checkpoint: unrecognised format"),
    ],
)
def test_errors_are_one_line_exit_2(tmp_path: Path, content: bytes | None, message: str) -> None:
    path = tmp_path / "input.pth"
    if content is not None:
        path.write_bytes(content)
    result = run("show", path)
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1
    assert result.stdout == ""


def test_directory_truncated_and_torchscript(tmp_path: Path) -> None:
    assert "is a directory" in run("show", tmp_path).stderr
    truncated = tmp_path / "cut.pth"
    truncated.write_bytes(RESUME.read_bytes()[:5000])
    result = run("show", truncated)
    assert result.exit_code == 2 and "truncated" in result.stderr
    result = run("show", FIXTURES / "special/torchscript.pt")
    assert result.exit_code == 2 and "TorchScript" in result.stderr


def test_every_command_has_help_with_an_example() -> None:
    for name, command in cli.commands.items():
        result = run(name, "--help")
        assert result.exit_code == 0
        assert "Example" in (command.help or ""), name
    assert "Exit codes" in run("--help").stdout


# Issue 12: what the header counts, the tree of a real state dict, --stats on every dtype.


def tutorial_checkpoint(path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The PyTorch tutorial's "general checkpoint", after one AdamW step (moments exist)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    optimizer.step()
    torch.save(
        {
            "epoch": 5,
            "model_state_dict": model.state_dict(),
            "optimizer_state_dict": optimizer.state_dict(),
            "loss": 0.4,
        },
        path,
    )
    return model, optimizer


def tied_state_dict(path: Path) -> None:
    embed = torch.nn.Embedding(100, 16)
    torch.save(
        {"embed.weight": embed.weight, "head.weight": embed.weight, "norm": torch.ones(16)}, path
    )


def header(result: Result) -> dict[str, str]:
    """The header lines of show's text output, by label."""
    lines = result.stdout.split("\n\n")[0].splitlines()
    return {line[:11].rstrip(": "): line[12:] for line in lines if not line.startswith(" ")}


def test_tutorial_layout_counts_the_model_not_the_optimizer(tmp_path: Path) -> None:
    path = tmp_path / "tutorial.pt"
    model, _ = tutorial_checkpoint(path)
    size = sum(p.numel() for p in model.parameters())  # 325; with the AdamW moments: 979
    fields = header(run("show", path))
    assert fields["layout"] == (
        "training checkpoint (model in 'model_state_dict', optimizer in 'optimizer_state_dict')"
    )
    assert fields["tensors"] == f"16  ({size} parameters)"
    assert fields["optimizer"].startswith("AdamW, state for 4 params")
    data = json.loads(run("show", path, "--json").stdout)
    assert data["num_parameters"] == size
    assert (data["model_part"], data["optimizer_part"]) == (
        "model_state_dict",
        "optimizer_state_dict",
    )
    assert data["num_tensors"] == data["total_tensors"] == 16
    assert data["selection"] is None


@pytest.mark.parametrize("model_key", ["model_state", "state_dict", "model"])
def test_model_parts_by_name(tmp_path: Path, model_key: str) -> None:
    path = tmp_path / "ckpt.pt"
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    torch.save({model_key: model.state_dict(), "optimizer_state": optimizer.state_dict()}, path)
    data = json.loads(run("show", path, "--json").stdout)
    assert data["num_parameters"] == 8  # not 16: the momentum buffers are not parameters
    assert data["model_part"] == model_key


def test_files_without_a_model_print_no_parameter_count(tmp_path: Path) -> None:
    import random

    _, optimizer = tutorial_checkpoint(tmp_path / "tutorial.pt")
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")  # HF Trainer's optimizer.pt
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.get_rng_state(),
    }
    torch.save(rng, tmp_path / "rng_state.pth")
    for name, count in (("optimizer.pt", 12), ("rng_state.pth", 2)):
        result = run("show", tmp_path / name)
        assert header(result)["tensors"] == str(count), name
        assert "parameters" not in result.stdout
        data = json.loads(run("show", tmp_path / name, "--json").stdout)
        assert data["num_parameters"] is None and data["model_part"] is None
    assert header(run("show", tmp_path / "optimizer.pt"))["optimizer"].startswith("AdamW")


def test_tied_weights_count_once_in_parameters_and_bytes(tmp_path: Path) -> None:
    path = tmp_path / "tied.pth"
    tied_state_dict(path)
    fields = header(run("show", path))
    assert fields["tensors"] == "3  (1.62K parameters)"
    assert fields["bytes"] == "float32 6.3 KB"  # 1616 floats; 12.6 KB counted the tie twice
    assert fields["tied"] == "1 storage shared by 2 keys, counted once (embed.weight, head.weight)"
    data = json.loads(run("show", path, "--json").stdout)
    assert (data["num_parameters"], data["num_bytes"]) == (1616, 1616 * 4)
    assert data["bytes_by_dtype"] == {"float32": 1616 * 4}
    assert data["num_bytes"] < path.stat().st_size
    assert data["shared_storage"] == [["embed.weight", "head.weight"]]


def test_overlapping_views_count_what_the_storage_holds() -> None:
    # base [4, 6], its transpose, two of its rows, one column: one storage of 24 floats
    fields = header(run("show", FIXTURES / "special/views.pth"))
    assert fields["tensors"] == "4  (24 parameters)"
    assert fields["bytes"] == "float32 96 B"


def test_filter_and_section_narrow_the_header(tmp_path: Path) -> None:
    path = tmp_path / "tied.pth"
    tied_state_dict(path)
    result = run("show", path, "--filter", "head*")
    assert header(result)["tensors"] == "1 of 3  (filter 'head*'; 1.60K parameters)"
    assert header(result)["bytes"] == "float32 6.2 KB"
    assert "tied" not in header(result)
    data = json.loads(run("show", path, "--filter", "head*", "--json").stdout)
    assert (data["num_tensors"], data["total_tensors"], data["num_parameters"]) == (1, 3, 1600)
    assert data["selection"] == {"section": None, "filter": "head*"}
    # the optimizer of a resume file holds no parameters
    fields = header(run("show", RESUME, "--section", "optimizer"))
    assert fields["tensors"] == "60 of 81  (section 'optimizer')"
    data = json.loads(run("show", RESUME, "--section", "optimizer", "--json").stdout)
    assert data["num_parameters"] is None
    fields = header(run("show", RESUME, "--section", "model", "--filter", "*norm*"))
    assert fields["tensors"] == "5 of 81  (section 'model', filter '*norm*'; 160 parameters)"


def test_json_carries_the_numbers_of_the_text_header(tmp_path: Path) -> None:
    from ckpttool.render.text import human_count, human_size

    tutorial_checkpoint(tmp_path / "tutorial.pt")
    tied_state_dict(tmp_path / "tied.pth")
    cases = [
        (tmp_path / "tutorial.pt",),
        (tmp_path / "tied.pth",),
        (tmp_path / "tied.pth", "--filter", "*.weight"),
        (RESUME,),
        (RESUME, "--section", "model"),
    ]
    for args in cases:
        fields = header(run("show", *args))
        data = json.loads(run("show", *args, "--json").stdout)
        count = str(data["num_tensors"])
        if data["selection"] is not None:
            count += f" of {data['total_tensors']}"
        assert fields["tensors"].startswith(count + "  ("), args
        assert fields["tensors"].endswith(f"{human_count(data['num_parameters'])} parameters)")
        assert fields["bytes"] == ", ".join(
            f"{dtype} {human_size(n)}" for dtype, n in data["bytes_by_dtype"].items()
        )
        assert sum(data["bytes_by_dtype"].values()) == data["num_bytes"]


def test_filter_matching_nothing_says_so(tmp_path: Path) -> None:
    path = tmp_path / "tied.pth"
    tied_state_dict(path)
    result = run("show", path, "--filter", "nothing*")
    assert result.exit_code == 0
    assert result.stdout.splitlines()[3:] == [
        "tensors:    0 of 3  (filter 'nothing*' matched no tensor)"
    ]
    data = json.loads(run("show", path, "--filter", "nothing*", "--json").stdout)
    assert (data["num_tensors"], data["bytes_by_dtype"], data["num_parameters"]) == (0, {}, None)
    result = run("show", RESUME, "--section", "epoch")
    assert "tensors:    0 of 81  (section 'epoch' matched no tensor)" in result.stdout.splitlines()
    assert "key " not in result.stdout


def test_checkpoint_without_tensors_says_no_tensors(tmp_path: Path) -> None:
    path = tmp_path / "scheduler.pt"
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    torch.save(torch.optim.lr_scheduler.StepLR(optimizer, 10).state_dict(), path)
    result = run("show", path)
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[3] == "tensors:    none (this checkpoint holds no tensors)"
    assert "step_size:  10" in lines
    assert not any(line.startswith(("bytes:", "key ")) for line in lines)
    assert lines[-1] != ""
    data = json.loads(run("show", path, "--json").stdout)
    assert (data["num_tensors"], data["total_tensors"], data["tensors"]) == (0, 0, [])


def blocks_state_dict(blocks: int, odd: int | None = None) -> dict[str, torch.Tensor]:
    """A model-shaped flat state dict: embed, ``blocks`` identical layers, norm, tied head."""
    state: dict[str, torch.Tensor] = {"embed.weight": torch.zeros(10, 8)}
    for index in range(blocks):
        for name in ("q", "k", "v", "o"):
            state[f"layers.{index}.attn.{name}_proj.weight"] = torch.zeros(8, 8)
        width = 16 if index == odd else 8  # one block of another shape
        state[f"layers.{index}.norm.weight"] = torch.ones(width)
    state["norm.weight"] = torch.ones(8)
    state["lm_head.weight"] = state["embed.weight"]
    return state


def test_tree_shows_a_large_state_dict_as_modules(tmp_path: Path) -> None:
    path = tmp_path / "model.pth"
    torch.save(blocks_state_dict(16), path)  # 83 keys: more than the old limit of 64
    out = run("show", path, "--tree", "--depth", "3").stdout.splitlines()
    assert "items" not in "\n".join(out)
    assert out == [
        "dict[83]",
        "  embed.weight: tensor float32[10, 8]",
        "  layers.0..15: 16 identical blocks of 5 tensors, 264 params, 1.0 KB each "
        "(4.22K params, 16.5 KB in all)",
        "    attn: 4 tensors, 256 params, 1.0 KB",
        "      q_proj.weight: tensor float32[8, 8]",
        "      k_proj.weight: tensor float32[8, 8]",
        "      v_proj.weight: tensor float32[8, 8]",
        "      o_proj.weight: tensor float32[8, 8]",
        "    norm.weight: tensor float32[8]",
        "  norm.weight: tensor float32[8]",
        "  lm_head.weight: tensor float32[10, 8]",
    ]
    shallow = run("show", path, "--tree", "--depth", "1").stdout.splitlines()
    assert shallow[2].startswith("  layers.0..15: 16 identical blocks")
    assert len(shallow) == 5


def test_tree_collapses_only_identical_blocks(tmp_path: Path) -> None:
    path = tmp_path / "model.pth"
    torch.save({"model": blocks_state_dict(6, odd=3), "step": 7}, path)
    out = run("show", path, "--tree", "--depth", "3").stdout.splitlines()
    layer_lines = [line for line in out if line.startswith("      ") and line[6] != " "]
    assert layer_lines == [
        "      0..2: 3 identical blocks of 5 tensors, 264 params, 1.0 KB each "
        "(792 params, 3.1 KB in all)",
        "      3: 5 tensors, 272 params, 1.1 KB",
        "      4..5: 2 identical blocks of 5 tensors, 264 params, 1.0 KB each "
        "(528 params, 2.1 KB in all)",
    ]
    assert "  model: dict[33]" in out
    assert "    layers: 30 tensors, 1.59K params, 6.2 KB" in out
    assert "  step: 7" in out


def test_tree_still_elides_long_runs_of_plain_values(tmp_path: Path) -> None:
    import random

    path = tmp_path / "rng.pth"
    torch.save({"python": random.getstate(), "cpu": torch.get_rng_state()}, path)
    out = run("show", path, "--tree").stdout.splitlines()
    assert "      ... 625 items" in out
    assert "  cpu: tensor uint8[5056]" in out


def every_dtype() -> dict[str, torch.Tensor]:
    values = torch.tensor([0.5, -1.0, 2.0, 0.25])
    return {
        "e4m3fn": values.to(torch.float8_e4m3fn),
        "e5m2": values.to(torch.float8_e5m2),
        "e4m3fnuz": values.to(torch.float8_e4m3fnuz),
        "e5m2fnuz": values.to(torch.float8_e5m2fnuz),
        "e8m0fnu": values.abs().to(torch.float8_e8m0fnu),
        "bf16": values.to(torch.bfloat16),
        "c64": torch.tensor([3 + 4j, 0j, -1j], dtype=torch.complex64),
        "flags": torch.tensor([True, False, True]),
        "u16": torch.tensor([1, 65535, 7], dtype=torch.uint16),
        "u64": torch.tensor([2**63 + 1, 5], dtype=torch.uint64),
        "w": torch.arange(6, dtype=torch.float32),
    }


def test_stats_cover_every_dtype(tmp_path: Path) -> None:
    path = tmp_path / "dtypes.pth"
    tensors = every_dtype()
    torch.save(tensors, path)
    result = run("show", path, "--stats", "--json")
    assert result.exit_code == 0, result.output
    stats = {t["key"]: t["stats"] for t in json.loads(result.stdout)["tensors"]}
    for key, tensor in tensors.items():
        if tensor.is_complex():
            value = tensor.abs().double()
        elif tensor.dtype == torch.uint64:  # torch cannot widen uint64; its values are known
            value = torch.tensor([2.0**63 + 1, 5.0], dtype=torch.float64)
        else:
            value = tensor.double() if tensor.dtype != torch.uint16 else tensor.int().double()
        assert stats[key]["min"] == value.min().item(), key
        assert stats[key]["max"] == value.max().item(), key
        assert stats[key]["mean"] == pytest.approx(value.mean().item()), key
        assert stats[key]["std"] == pytest.approx(value.std(unbiased=False).item()), key
    table = run("show", path, "--stats").stdout
    assert "stats of |z|" in table and "stats of False=0, True=1" in table


def test_stats_never_abort_the_report(tmp_path: Path) -> None:
    path = tmp_path / "mixed.pth"
    torch.save(
        {
            "meta": torch.empty(3, device="meta"),
            "bits": torch.zeros(2, dtype=torch.uint16).view(torch.bits16),
            "f8": torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn),
            "w": torch.ones(2),
        },
        path,
    )
    result = run("show", path, "--stats")
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[-4:]}
    assert "n/a" in rows["meta"] and "no stats: a meta tensor stores no values" in rows["meta"]
    assert "no stats: bits16 holds raw bits with no numeric meaning" in rows["bits"]
    assert rows["f8"].split()[6:8] == ["1", "2"]  # min, max after "2 B"
    data = json.loads(run("show", path, "--stats", "--json").stdout)
    by_key = {t["key"]: t for t in data["tensors"]}
    assert by_key["meta"]["stats"] is None
    assert by_key["meta"]["stats_unavailable"] == "a meta tensor stores no values"
    assert by_key["w"]["stats"]["mean"] == 1.0 and "stats_unavailable" not in by_key["w"]


def test_stats_report_a_damaged_tensor_and_go_on(tmp_path: Path) -> None:
    path = tmp_path / "damaged.pth"
    torch.save({"a": torch.ones(4), "b": torch.full((4,), 2.0)}, path)
    from ckpttool.checkpoint import open_checkpoint
    from ckpttool.commands.show import build_report

    with open_checkpoint(path) as ckpt:
        first = ckpt.tensors()[0]
        offset, _ = ckpt.storage_span(first.storage)  # type: ignore[arg-type]
        with open(path, "r+b") as handle:  # the file shrinks after it was opened
            handle.truncate(offset + 4)
        report = build_report(ckpt, stats=True)
    by_key = {info.record.key: info for info in report.tensors}
    assert by_key["a"].stats is None and by_key["a"].stats_unavailable
    # a's record was located before the file shrank: its read comes up short
    assert "a: no statistics: file ends inside its data (truncated)" in report.warnings
    # b's record is located after: its local header says it reaches past the end
    assert any(w.startswith("b: no statistics: record ") for w in report.warnings)


# --- the examples of docs/show.md are real output ------------------------------------------


ROOT = Path(__file__).resolve().parents[2]


def documented_runs(page: str) -> list[tuple[list[str], list[str]]]:
    """(arguments, documented output lines) of each ``$ ckpttool show tests/fixtures/...`` in
    the console blocks of ``docs/<page>``."""
    import shlex

    text = (ROOT / "docs" / page).read_text()
    runs: list[tuple[list[str], list[str]]] = []
    for block in text.split("```")[1::2]:
        current: list[str] | None = None
        for line in block.splitlines():
            if line.startswith("$ "):
                current = None
                words = shlex.split(line[2:].split("  #")[0])
                if words[:2] == ["ckpttool", "show"] and words[2].startswith("tests/fixtures/"):
                    current = []
                    runs.append((words[2:], current))
            elif current is not None:
                current.append(line)
    return runs


@pytest.mark.parametrize(
    ("arguments", "documented"),
    documented_runs("show.md"),
    ids=[" ".join(arguments) for arguments, _ in documented_runs("show.md")],
)
def test_the_examples_in_docs_show_md_are_real_output(
    arguments: list[str], documented: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each run of "..."-free lines is found, in order and unbroken, in what the command
    prints (stdout, then its warnings)."""
    monkeypatch.chdir(ROOT)  # the examples name fixtures relative to the repository
    result = CliRunner().invoke(cli, ["show", *arguments])
    incomplete = any(line.startswith("missing:") for line in documented)  # exit 1: found
    assert result.exit_code == (1 if incomplete else 0), result.output
    real = [line.rstrip() for line in (result.stdout + result.stderr).splitlines()]
    segments: list[list[str]] = [[]]
    for line in documented:
        if line.strip() == "...":
            segments.append([])
        else:
            segments[-1].append(line.rstrip())
    position = 0
    for segment in filter(None, segments):
        for start in range(position, len(real) - len(segment) + 1):
            if real[start : start + len(segment)] == segment:
                position = start + len(segment)
                break
        else:
            shown = "\n".join(real)
            raise AssertionError(f"docs/show.md shows {segment}; the command prints:\n{shown}")


def test_the_docs_show_md_examples_are_checked() -> None:
    commands = [" ".join(arguments) for arguments, _ in documented_runs("show.md")]
    assert "tests/fixtures/frameworks/trainer_1proc/half_written/checkpoint-8" in commands
    assert "tests/fixtures/minimind/pretrain_32_resume.pth" in commands


# --- what was saved beside the tensors --------------------------------------------------------


def test_show_prints_what_was_saved_beside_the_tensors() -> None:
    """A config dataclass, an argparse.Namespace, Lightning's hyper_parameters and a
    scheduler's position are in the default view and in --json's parts, not only in --tree."""
    lines = run("show", FIXTURES / "special/namespace_config.pth").stdout.splitlines()
    assert "args:       lr=0.0005, batch_size=32, save_dir='../out', use_moe=false" in lines
    assert (
        'config:     lr=0.0005, batch_size=32, hidden_size=32, tags=["pretrain", "tiny"]' in lines
    )
    lightning = run("show", FIXTURES / "lightning/epoch=1-step=40.ckpt").stdout
    assert "hyper_parameters: lr=0.001, hidden_size=16, num_layers=1," in lightning
    assert (
        "lr_schedulers.0: last_epoch=3, _step_count=4, base_lrs=[0.001], _last_lr=[0.0005],"
        in lightning
    )
    resume = run("show", FIXTURES / "ckpttool/pretrain_32_resume.pth").stdout.splitlines()
    assert "scaler:     scale=2048.0, _growth_tracker=1, growth_factor=2.0, backoff_factor=0.5, growth_interval=2" in resume  # fmt: skip
    assert not any(line.startswith(("rng:", "optimizer:", "model:")) and "=" in line.split()[1]
                   for line in resume)  # fmt: skip
    trainer = FIXTURES / "frameworks/trainer_1proc/output/checkpoint-8"
    section = run("show", trainer, "--section", "scheduler").stdout.splitlines()
    assert "tensors:    0 of 82  (section 'scheduler' matched no tensor)" in section
    assert [line for line in section if line.startswith(("scheduler:", "config:"))] == [
        "scheduler:  last_epoch=8, _step_count=9, base_lrs=[0.001, 0.001], _last_lr=[0.0, 0.0], "
        "_is_initial=false, _get_lr_called_within_step=false"
    ]
    data = json.loads(run("show", trainer, "--json").stdout)
    assert data["parts"]["scheduler"] == {
        "last_epoch": 8, "_step_count": 9, "base_lrs": [0.001, 0.001], "_last_lr": [0.0, 0.0],
        "_is_initial": False, "_get_lr_called_within_step": False,
    }  # fmt: skip
    assert data["parts"]["config"]["hidden_size"] == 16
    assert len(data["parts"]["training_args"]) > 100  # all of them, the text shows ten
    assert "rng" not in data["parts"] and "model" not in data["parts"]
    deepspeed = FIXTURES / "deepspeed/stage2_bf16_2proc/checkpoints"  # its lines say the rest
    assert json.loads(run("show", deepspeed, "--json").stdout)["parts"] == {}
    assert json.loads(run("show", RESUME, "--json").stdout)["parts"] == {
        "scaler": {"scale": 65536.0, "_growth_tracker": 3, "growth_factor": 2.0,
                   "backoff_factor": 0.5, "growth_interval": 2000},
    }  # fmt: skip
