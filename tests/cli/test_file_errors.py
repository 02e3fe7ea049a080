"""Every error about a file names the file, whichever command reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ckpttool.cli import cli
from tests.support.helpers import FIXTURES

GOOD = FIXTURES / "minimind/pretrain_32_resume.pth"

#: (file name, bytes, what the error says): not a checkpoint, and a zip cut short.
BAD_FILES = [
    ("config.json", b'{\n  "architectures": ["MiniMindForCausalLM"]\n}\n', "unrecognised format"),
    ("cut.pth", GOOD.read_bytes()[:5000], "corrupt or truncated zip"),
]


def run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _commands(bad: Path, tmp_path: Path) -> dict[str, list[object]]:
    return {
        "show": ["show", bad],
        "show --stats": ["show", bad, "--stats"],
        "convert": ["convert", bad, tmp_path / "out.safetensors"],
        "diff A": ["diff", bad, GOOD],
        "diff B": ["diff", GOOD, bad],
        "rescale-step": ["rescale-step", bad, "--world-size", 2],
        "average": ["average", GOOD, bad, "-o", tmp_path / "avg.safetensors"],
        "merge": ["merge", GOOD, bad, "-o", tmp_path / "m.safetensors", "--method", "linear"],
    }


@pytest.mark.parametrize("command", ["show", "show --stats", "convert", "diff A", "diff B",
                                     "rescale-step", "average", "merge"])  # fmt: skip
@pytest.mark.parametrize(("name", "content", "fragment"), BAD_FILES, ids=["json", "cut_zip"])
def test_the_error_line_names_the_file(
    tmp_path: Path, command: str, name: str, content: bytes, fragment: str
) -> None:
    bad = tmp_path / name
    bad.write_bytes(content)
    result = run(*_commands(bad, tmp_path)[command])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {bad}: ")
    assert fragment in result.stderr
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize(("name", "content", "fragment"), BAD_FILES, ids=["json", "cut_zip"])
def test_verify_and_scan_name_the_file(
    tmp_path: Path, name: str, content: bytes, fragment: str
) -> None:
    bad = tmp_path / name
    bad.write_bytes(content)
    verified = run("verify", bad)
    report = verified.stdout + verified.stderr
    assert f"{bad}: " in report and fragment in report
    # The path leads the report or the error line, and is not repeated inside the message.
    assert report.count(str(bad)) == 1
    scanned = run("scan", bad)
    assert scanned.exit_code == 2
    row = next(line for line in scanned.stdout.splitlines() if fragment in line)
    assert row.startswith(str(bad))
